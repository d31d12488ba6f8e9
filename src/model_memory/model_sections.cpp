#include "model_memory/model_sections.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>
#include <unordered_set>

#include "sluice/error.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::detail {
namespace {

constexpr std::uint64_t kScheduleBytes = 4 + 8 + 8 + 8 + 8 + 8;
constexpr std::uint64_t kDecayBytes = 8 + 8 + 8;
/// As the CLI's --update-every bound: more steps than any run takes.
constexpr std::int64_t kMaxUpdateEvery = std::int64_t{1} << 40;
/// As the checkpoint's counters: steps count exactly as doubles only this far.
constexpr std::int64_t kMaxTotalSteps = std::int64_t{1} << 53;

/// What keeps `names` from a checkpoint (empty: nothing).
std::string class_names_problem(const std::vector<std::string>& names) {
  if (names.size() > ModelMemory::kMostClassNames) {
    return std::to_string(names.size()) + " class names, more than " +
           std::to_string(ModelMemory::kMostClassNames);
  }
  std::unordered_set<std::string_view> seen;
  for (std::size_t c = 0; c < names.size(); ++c) {
    const std::string& name = names[c];
    if (name.empty()) return "class name " + std::to_string(c) + " is empty";
    if (name.find('\0') != std::string::npos) {
      return "class name " + std::to_string(c) + " holds a NUL byte";
    }
    if (!seen.insert(name).second) {
      return "class name " + std::to_string(c) + " repeats an earlier one";
    }
  }
  return {};
}

/// A section holding `text` alone (a model description, a training data's name).
Section text_section(std::uint32_t tag, const std::string& text) {
  Section s;
  s.tag = tag;
  s.arrays.push_back(std::as_bytes(std::span(text)));
  return s;
}

/// Reads the next section, `tag`, as the text `name` of at most `most` bytes; FormatError
/// naming the file and the byte for a wrong CRC, a longer one, or one `storable` refuses
/// (`refusal` says why).
std::string read_text_section(FileReader& in, std::uint32_t tag, const std::string& name,
                              std::size_t most, bool (*storable)(const std::string&),
                              const char* refusal) {
  SectionReader s(in, tag, name + " section");
  if (s.length() > most) {
    s.fail("length " + std::to_string(s.length()) + ", at most " + std::to_string(most));
  }
  const std::vector<char> bytes = s.get_array<char>(s.length(), name.c_str());
  s.finish();
  std::string text(bytes.begin(), bytes.end());
  if (!storable(text)) s.fail(refusal);
  return text;
}

bool storable_training_data(const std::string& name) {
  return name.size() <= ModelMemory::kMaxTrainingData && name.find('\0') == std::string::npos;
}

/// The most inputs a layer has (add_layer's bound on its columns).
constexpr std::uint64_t kMostInputs = std::uint64_t{1} << 31;

/// What keeps an input scaling from a checkpoint (empty: nothing).
std::string input_scaling_problem(const std::vector<double>& mean,
                                  const std::vector<double>& scale) {
  if (mean.size() != scale.size()) {
    return std::to_string(mean.size()) + " input means and " + std::to_string(scale.size()) +
           " scales";
  }
  if (mean.size() > kMostInputs) return std::to_string(mean.size()) + " inputs, more than 2^31";
  for (std::size_t f = 0; f < mean.size(); ++f) {
    if (!std::isfinite(mean[f]) || !std::isfinite(scale[f]) || !(scale[f] > 0)) {
      return "input " + std::to_string(f) + "'s mean " + std::to_string(mean[f]) + " and scale " +
             std::to_string(scale[f]) + " are not finite with a positive scale";
    }
  }
  return {};
}

}  // namespace

bool storable_model(const std::string& model) {
  if (model.size() > ModelMemory::kMaxModelDescription) return false;
  return std::all_of(model.begin(), model.end(), [](char c) { return c >= 0x20 && c < 0x7F; });
}

void require_storable_model(const std::string& model, const std::string& what) {
  if (!storable_model(model)) {
    throw ShapeError(what + ": the model description is not printable ASCII of at most " +
                     std::to_string(ModelMemory::kMaxModelDescription) + " characters");
  }
}

Section model_section(const std::string& model) {
  return text_section(kModelTag, model);
}

std::string read_model_section(FileReader& in) {
  return read_text_section(in, kModelTag, "model", ModelMemory::kMaxModelDescription,
                           storable_model, "not printable ASCII");
}

Section schedule_section(const DynamicSparsity& schedule) {
  Section s;
  s.tag = kScheduleTag;
  s.fields.put(static_cast<std::uint32_t>(schedule.rule));
  s.fields.put(schedule.update_every);
  s.fields.put(schedule.drop);
  s.fields.put(schedule.update_until);
  s.fields.put(schedule.total_steps);
  s.fields.put(schedule.seed);
  return s;
}

DynamicSparsity read_schedule_section(FileReader& in) {
  SectionReader s(in, kScheduleTag, "dynamic sparsity section");
  if (s.length() != kScheduleBytes) {
    s.fail("length " + std::to_string(s.length()) + ", expected " + std::to_string(kScheduleBytes));
  }
  DynamicSparsity d;
  const auto rule = s.get<std::uint32_t>("rule");
  d.update_every = s.get<std::int64_t>("update_every");
  d.drop = s.get<double>("drop");
  d.update_until = s.get<double>("update_until");
  d.total_steps = s.get<std::int64_t>("total_steps");
  d.seed = s.get<std::uint64_t>("seed");
  s.finish();
  if (rule > 2) s.fail("unknown dynamic sparsity rule " + std::to_string(rule));
  d.rule = static_cast<MaskUpdateRule>(rule);
  if (d.update_every > kMaxUpdateEvery) {
    s.fail("update_every " + std::to_string(d.update_every) + " out of range [1, 2^40]");
  }
  if (d.total_steps > kMaxTotalSteps) {
    s.fail("total_steps " + std::to_string(d.total_steps) + " out of range [0, 2^53]");
  }
  try {
    d.validate();
  } catch (const ArgumentError& e) {
    s.fail(e.what());
  }
  return d;
}

Section decay_section(const LearningRateDecay& decay) {
  Section s;
  s.tag = kDecayTag;
  s.fields.put(decay.warmup_steps);
  s.fields.put(decay.decay_steps);
  s.fields.put(decay.final_fraction);
  return s;
}

LearningRateDecay read_decay_section(FileReader& in) {
  SectionReader s(in, kDecayTag, "learning-rate decay section");
  if (s.length() != kDecayBytes) {
    s.fail("length " + std::to_string(s.length()) + ", expected " + std::to_string(kDecayBytes));
  }
  LearningRateDecay d;
  d.warmup_steps = s.get<std::int64_t>("warmup_steps");
  d.decay_steps = s.get<std::int64_t>("decay_steps");
  d.final_fraction = s.get<double>("final_fraction");
  s.finish();
  try {
    d.validate();
  } catch (const ArgumentError& e) {
    s.fail(e.what());
  }
  return d;
}

void require_storable_class_names(const std::vector<std::string>& names, const std::string& what) {
  if (const std::string problem = class_names_problem(names); !problem.empty()) {
    throw ShapeError(what + ": " + problem);
  }
}

Section class_names_section(const std::vector<std::string>& names) {
  static constexpr char kEnd[1] = {'\0'};
  Section s;
  s.tag = kClassNamesTag;
  for (const std::string& name : names) {
    s.arrays.push_back(std::as_bytes(std::span(name)));
    s.arrays.push_back(std::as_bytes(std::span(kEnd)));
  }
  return s;
}

std::vector<std::string> read_class_names_section(FileReader& in) {
  SectionReader s(in, kClassNamesTag, "class names section");
  const std::vector<char> text = s.get_array<char>(s.length(), "class names");
  s.finish();
  if (!text.empty() && text.back() != '\0') s.fail("the last class name is not ended");
  const auto count = static_cast<std::size_t>(std::count(text.begin(), text.end(), '\0'));
  if (count > ModelMemory::kMostClassNames) {
    s.fail(std::to_string(count) + " class names, more than " +
           std::to_string(ModelMemory::kMostClassNames));
  }
  std::vector<std::string> names;
  names.reserve(count);
  for (auto begin = text.begin(); begin != text.end();) {  // each name ends in a NUL
    const auto end = std::find(begin, text.end(), '\0');
    names.emplace_back(begin, end);
    begin = end + 1;
  }
  if (const std::string problem = class_names_problem(names); !problem.empty()) s.fail(problem);
  return names;
}

void require_storable_input_scaling(const std::vector<double>& mean,
                                    const std::vector<double>& scale, const std::string& what) {
  if (const std::string problem = input_scaling_problem(mean, scale); !problem.empty()) {
    throw ShapeError(what + ": " + problem);
  }
}

Section input_scaling_section(const std::vector<double>& mean, const std::vector<double>& scale) {
  Section s;
  s.tag = kInputScalingTag;
  s.fields.put(static_cast<std::uint64_t>(mean.size()));
  s.arrays.push_back(std::as_bytes(std::span(mean)));
  s.arrays.push_back(std::as_bytes(std::span(scale)));
  return s;
}

void read_input_scaling_section(FileReader& in, std::vector<double>& mean,
                                std::vector<double>& scale) {
  SectionReader s(in, kInputScalingTag, "input scaling section");
  if (s.length() < 8) s.fail("length " + std::to_string(s.length()) + ", too short for its count");
  const auto count = s.get<std::uint64_t>("input count");
  if (count > kMostInputs || s.length() != 8 + 16 * count) {
    s.fail("length " + std::to_string(s.length()) + " does not hold " + std::to_string(count) +
           " inputs' mean and scale");
  }
  std::vector<double> m = s.get_array<double>(count, "input means");
  std::vector<double> k = s.get_array<double>(count, "input scales");
  s.finish();
  if (const std::string problem = input_scaling_problem(m, k); !problem.empty()) s.fail(problem);
  mean = std::move(m);
  scale = std::move(k);
}

void require_storable_training_data(const std::string& name, const std::string& what) {
  if (!storable_training_data(name)) {
    throw ShapeError(what + ": the training data's name is over " +
                     std::to_string(ModelMemory::kMaxTrainingData) + " bytes or holds a NUL");
  }
}

Section training_data_section(const std::string& name) {
  return text_section(kTrainingDataTag, name);
}

std::string read_training_data_section(FileReader& in) {
  return read_text_section(in, kTrainingDataTag, "training data", ModelMemory::kMaxTrainingData,
                           storable_training_data, "the training data's name holds a NUL");
}

}  // namespace sluice::detail
