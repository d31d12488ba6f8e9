#include "model_memory/model_sections.hpp"

#include <algorithm>
#include <string>

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
  Section s;
  s.tag = kModelTag;
  s.arrays.push_back(std::as_bytes(std::span(model)));
  return s;
}

std::string read_model_section(FileReader& in) {
  SectionReader s(in, kModelTag, "model section");
  if (s.length() > ModelMemory::kMaxModelDescription) {
    s.fail("length " + std::to_string(s.length()) + ", at most " +
           std::to_string(ModelMemory::kMaxModelDescription));
  }
  const std::vector<char> text = s.get_array<char>(s.length(), "model");
  s.finish();
  std::string model(text.begin(), text.end());
  if (!storable_model(model)) s.fail("not printable ASCII");
  return model;
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

}  // namespace sluice::detail
