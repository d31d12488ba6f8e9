// HostModelMemory checkpoints: save_impl and load_impl.
//
// File format (version 7; also in docs/checkpoint_format.md). Little-endian throughout.
//
//   magic      8 bytes  "SLUICECK"
//   version    u32      7 (versions 1 to 6 are still read: version 1 lacks the epoch count,
//                       read as 0; versions 1 and 2 lack the model section, read as empty;
//                       versions 1 to 3 lack the schedule section, read as rule none;
//                       versions 1 to 4 lack the decay section, read as no decay;
//                       versions 1 to 5 lack the class names and input scaling, read
//                       as none; versions 1 to 6 lack the training data's name, read as
//                       empty)
//   sections, each:
//     tag      u32      four ASCII characters, first character in the lowest byte
//     length   u64      payload bytes
//     crc      u32      CRC-32 (IEEE, as zlib) of the payload
//     payload  length bytes
//
// Sections, in this order, nothing before, between or after:
//   "HEAD"  once:
//       u32 layer_count, i64 step, u64 seed,
//       u32 optimizer kind (0 sgd, 1 adam, 2 adamw),
//       f64 learning_rate, momentum, beta1, beta2, epsilon, weight_decay, clip_global_norm,
//       u32 non-finite policy (0 skip_step, 1 error),
//       u32 1 if a learning-rate schedule was set (the function itself is not saved),
//       i64 epochs (version 2 on: passes over the training data completed)
//   "MODL"  once (version 3 on): ModelMemory::model, its characters (printable ASCII, at
//       most ModelMemory::kMaxModelDescription; empty for a stack of layers)
//   "DYNS"  once (version 4 on): ModelMemory::dynamic, the mask-update schedule
//       (model_memory/model_sections.hpp)
//   "LRDC"  once (version 5 on): the optimizer's LearningRateDecay (model_sections.hpp)
//   "CLAS"  once (version 6 on): ModelMemory::class_names, each followed by a NUL byte
//   "SCAL"  once (version 6 on): u64 count, f64 input_mean[count], f64 input_scale[count]
//   "DATA"  once (version 7 on): ModelMemory::training_data's bytes
//   "LAYR"  layer_count times, layer i in the i-th:
//       u32 layer index, i64 rows, i64 cols, i64 nnz, i64 bias size (0 or rows),
//       u32 optimizer state slots (sgd 1: velocity; adam/adamw 2: m, v),
//       i64 updates applied to the layer (Adam's bias-correction t),
//       i64 row_offsets[rows + 1], u32 col_indices[nnz], f32 values[nnz], f32 bias[bias size],
//       f32 state[slots][nnz], f32 bias_state[slots][bias size]
//   "END "  once, empty payload.
//
// Saving writes "<path>.tmp.<pid>", fsyncs it, renames it over <path> and fsyncs the
// directory, so a crash at any moment leaves either the old or the new checkpoint.
// Loading checks every length against the bytes left in the file before allocating,
// every CRC, and every invariant, into a new State; only then does it replace the
// current one, so a failed load changes nothing. The learning-rate schedule is code,
// not data: load keeps the schedule this ModelMemory already has.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/crc32.hpp"
#include "model_memory/checkpoint_io.hpp"
#include "model_memory/host_model_memory_state.hpp"
#include "model_memory/model_sections.hpp"
#include "model_memory/optimizer_kernels.hpp"

namespace sluice {
namespace {

using detail::bytes_of;
using detail::FileReader;
using detail::FileWriter;
using detail::fits;
using detail::fourcc;
using detail::fsync_directory;
using detail::kSectionHeaderBytes;
using detail::os_error;
using detail::Section;
using detail::SectionReader;
using detail::tag_name;
using detail::write_section;

static_assert(std::endian::native == std::endian::little,
              "checkpoints are written in host byte order, which must be little-endian");

constexpr char kMagic[8] = {'S', 'L', 'U', 'I', 'C', 'E', 'C', 'K'};
constexpr std::uint32_t kFormatVersion = 7;
constexpr std::uint32_t kOldestReadableVersion = 1;
/// Counters (steps, updates, epochs) above this are refused: they count up by one and
/// reach the optimizer as doubles, which count exactly only this far, and a file that
/// claims more was crafted, not trained (and would overflow a signed counter).
constexpr std::int64_t kMaxCounter = std::int64_t{1} << 53;

constexpr std::uint32_t kHeadTag = fourcc("HEAD");
constexpr std::uint32_t kLayerTag = fourcc("LAYR");
constexpr std::uint32_t kEndTag = fourcc("END ");

constexpr std::size_t kHeadBytesV1 = 4 + 8 + 8 + 4 + 7 * 8 + 4 + 4;
constexpr std::size_t kHeadBytes = kHeadBytesV1 + 8;
constexpr std::size_t kLayerFixedBytes = 4 + 8 + 8 + 8 + 8 + 4 + 8;

std::uint32_t encode_kind(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::sgd:
      return 0;
    case OptimizerKind::adam:
      return 1;
    case OptimizerKind::adamw:
      return 2;
  }
  return 0xFFFF'FFFFU;
}

// What a checkpoint holds beside the State: the public fields of ModelMemory.
struct Counters {
  std::uint64_t seed = 0;
  std::int64_t epochs = 0;
  std::string model;
  DynamicSparsity dynamic;
  std::vector<std::string> class_names;
  std::vector<double> input_mean, input_scale;
  std::string training_data;
};

void write_checkpoint(FileWriter& out, const detail::HostState& st, const Counters& counters) {
  out.write(std::as_bytes(std::span(kMagic)));
  out.put(kFormatVersion);

  Section head;
  head.tag = kHeadTag;
  const OptimizerConfig& c = st.config;
  head.fields.put(static_cast<std::uint32_t>(st.layers.size()));
  head.fields.put(st.step);
  head.fields.put(counters.seed);
  head.fields.put(encode_kind(c.kind));
  for (auto number : detail::kOptimizerNumbers) head.fields.put(c.*number);
  head.fields.put(static_cast<std::uint32_t>(st.policy == NonFinitePolicy::error ? 1 : 0));
  head.fields.put(static_cast<std::uint32_t>(c.schedule ? 1 : 0));
  head.fields.put(counters.epochs);
  write_section(out, head);

  write_section(out, detail::model_section(counters.model));
  write_section(out, detail::schedule_section(counters.dynamic));
  write_section(out, detail::decay_section(c.decay));
  write_section(out, detail::class_names_section(counters.class_names));
  write_section(out, detail::input_scaling_section(counters.input_mean, counters.input_scale));
  write_section(out, detail::training_data_section(counters.training_data));

  const int slots = detail::optimizer_slot_count(c.kind);
  for (std::size_t i = 0; i < st.layers.size(); ++i) {
    const detail::HostLayer& l = *st.layers[i];
    Section s;
    s.tag = kLayerTag;
    s.fields.put(static_cast<std::uint32_t>(i));
    s.fields.put(l.weights.rows());
    s.fields.put(l.weights.cols());
    s.fields.put(l.weights.nnz());
    s.fields.put(static_cast<std::int64_t>(l.bias.size()));
    s.fields.put(static_cast<std::uint32_t>(slots));
    s.fields.put(l.updates);
    s.arrays.push_back(bytes_of(l.weights.row_offsets()));
    s.arrays.push_back(bytes_of(l.weights.col_indices()));
    s.arrays.push_back(bytes_of(l.weights.values()));
    s.arrays.push_back(bytes_of(l.bias));
    for (int k = 0; k < slots; ++k) s.arrays.push_back(bytes_of(l.state[k]));
    for (int k = 0; k < slots; ++k) s.arrays.push_back(bytes_of(l.bias_state[k]));
    write_section(out, s);
  }

  Section end;
  end.tag = kEndTag;
  write_section(out, end);
}

// --- reading -------------------------------------------------------------------------

void check_finite(const std::vector<float>& v, const SectionReader& s, const std::string& what,
                  bool non_negative = false) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i]) || (non_negative && v[i] < 0)) {
      s.fail(what + "[" + std::to_string(i) + "] = " + std::to_string(v[i]) + " is invalid");
    }
  }
}

std::unique_ptr<detail::HostLayer> read_layer(FileReader& in, std::uint32_t index,
                                              const OptimizerConfig& config, std::int64_t step) {
  SectionReader s(in, kLayerTag, "layer " + std::to_string(index));
  if (s.length() < kLayerFixedBytes) s.fail("too short for its fixed fields");
  const auto stored_index = s.get<std::uint32_t>("layer index");
  const auto rows = s.get<std::int64_t>("rows");
  const auto cols = s.get<std::int64_t>("cols");
  const auto nnz = s.get<std::int64_t>("nnz");
  const auto bias_size = s.get<std::int64_t>("bias size");
  const auto slots = s.get<std::uint32_t>("optimizer slots");
  const auto updates = s.get<std::int64_t>("updates");
  if (stored_index != index) s.fail("holds layer " + std::to_string(stored_index));
  if (rows < 0 || cols < 0 || nnz < 0 || updates < 0) {
    s.fail("negative shape or count: " + std::to_string(rows) + "x" + std::to_string(cols) +
           ", nnz " + std::to_string(nnz) + ", updates " + std::to_string(updates));
  }
  // A layer is updated at most once a step.
  if (updates > step) {
    s.fail("updates " + std::to_string(updates) + " exceed the " + std::to_string(step) +
           " steps taken");
  }
  if (bias_size != 0 && bias_size != rows) {
    s.fail("bias size " + std::to_string(bias_size) + " is neither 0 nor rows (" +
           std::to_string(rows) + ")");
  }
  const int expected_slots = detail::optimizer_slot_count(config.kind);
  if (slots != static_cast<std::uint32_t>(expected_slots)) {
    s.fail(std::to_string(slots) + " optimizer state slots, " + to_string(config.kind) + " keeps " +
           std::to_string(expected_slots));
  }
  // All arrays must fit in the section exactly; checked before any allocation.
  std::uint64_t budget = s.length() - kLayerFixedBytes;
  const auto n = static_cast<std::uint64_t>(nnz);
  const auto b = static_cast<std::uint64_t>(bias_size);
  const bool ok = fits(static_cast<std::uint64_t>(rows) + 1, 8, budget) && fits(n, 4, budget) &&
                  fits(n, 4, budget) && fits(b, 4, budget) && fits(n, 4ULL * slots, budget) &&
                  fits(b, 4 * slots, budget);
  if (!ok || budget != 0) {
    s.fail("length " + std::to_string(s.length()) + " does not match a " + std::to_string(rows) +
           "x" + std::to_string(cols) + " layer with " + std::to_string(nnz) + " non-zeros, bias " +
           std::to_string(bias_size) + " and " + std::to_string(slots) + " state slots");
  }

  auto layer = std::make_unique<detail::HostLayer>();
  auto offsets = s.get_array<std::int64_t>(static_cast<std::uint64_t>(rows) + 1, "row offsets");
  auto indices = s.get_array<std::uint32_t>(n, "column indices");
  auto values = s.get_array<float>(n, "values");
  layer->bias = s.get_array<float>(b, "bias");
  for (int k = 0; k < expected_slots; ++k) layer->state[k] = s.get_array<float>(n, "state");
  for (int k = 0; k < expected_slots; ++k) {
    layer->bias_state[k] = s.get_array<float>(b, "bias state");
  }
  s.finish();  // the CRC, before trusting any of it

  try {
    layer->weights =
        CsrMatrix(rows, cols, std::move(offsets), std::move(indices), std::move(values));
  } catch (const Error& e) {
    s.fail(std::string("weights: ") + e.what());
  }
  if (layer->weights.nnz() != nnz) s.fail("nnz does not match the row offsets");
  if (!detail::storable_shape(rows, cols)) {
    s.fail("shape " + std::to_string(rows) + "x" + std::to_string(cols) + " too large");
  }
  check_finite(layer->bias, s, "bias");
  for (int k = 0; k < expected_slots; ++k) {
    // Adam's second moment (slot 1) is a mean of squares: never negative.
    const bool second_moment = config.kind != OptimizerKind::sgd && k == 1;
    check_finite(layer->state[k], s, "optimizer state " + std::to_string(k), second_moment);
    check_finite(layer->bias_state[k], s, "bias optimizer state " + std::to_string(k),
                 second_moment);
  }
  layer->updates = updates;
  return layer;
}

// Fills `st` (fresh) and `counters` from the file, or throws.
void read_checkpoint(FileReader& in, detail::HostState& st, Counters& counters) {
  char magic[8];
  in.read(std::as_writable_bytes(std::span(magic)), "magic");
  if (std::memcmp(magic, kMagic, sizeof magic) != 0) {
    in.fail("not a sluice checkpoint (magic is not SLUICECK)");
  }
  const auto version = in.get<std::uint32_t>("version");
  if (version < kOldestReadableVersion || version > kFormatVersion) {
    in.fail("version " + std::to_string(version) + ", expected " +
            std::to_string(kOldestReadableVersion) + " to " + std::to_string(kFormatVersion));
  }

  SectionReader head(in, kHeadTag, "header section");
  const std::size_t head_bytes = version == 1 ? kHeadBytesV1 : kHeadBytes;
  if (head.length() != head_bytes) {
    head.fail("length " + std::to_string(head.length()) + ", expected " +
              std::to_string(head_bytes));
  }
  const auto layer_count = head.get<std::uint32_t>("layer count");
  st.step = head.get<std::int64_t>("step");
  counters.seed = head.get<std::uint64_t>("seed");
  const auto kind = head.get<std::uint32_t>("optimizer kind");
  OptimizerConfig& c = st.config;
  for (auto number : detail::kOptimizerNumbers) c.*number = head.get<double>("optimizer config");
  const auto policy = head.get<std::uint32_t>("non-finite policy");
  const auto schedule = head.get<std::uint32_t>("schedule flag");
  counters.epochs = version == 1 ? 0 : head.get<std::int64_t>("epochs");
  head.finish();

  if (kind > 2) head.fail("unknown optimizer kind " + std::to_string(kind));
  c.kind = kind == 0 ? OptimizerKind::sgd : kind == 1 ? OptimizerKind::adam : OptimizerKind::adamw;
  if (policy > 1) head.fail("unknown non-finite policy " + std::to_string(policy));
  st.policy = policy == 1 ? NonFinitePolicy::error : NonFinitePolicy::skip_step;
  if (schedule > 1) head.fail("schedule flag " + std::to_string(schedule) + " is neither 0 nor 1");
  if (st.step < 0 || st.step > kMaxCounter) {
    head.fail("step " + std::to_string(st.step) + " out of range [0, 2^53]");
  }
  if (counters.epochs < 0 || counters.epochs > kMaxCounter) {
    head.fail("epochs " + std::to_string(counters.epochs) + " out of range [0, 2^53]");
  }
  if (layer_count > static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max())) {
    head.fail("layer count " + std::to_string(layer_count));
  }
  try {
    detail::validate_optimizer_config(c);
  } catch (const ArgumentError& e) {
    head.fail(e.what());
  }
  if (version >= 3) counters.model = detail::read_model_section(in);
  if (version >= 4) counters.dynamic = detail::read_schedule_section(in);
  if (version >= 5) c.decay = detail::read_decay_section(in);
  if (version >= 6) {
    counters.class_names = detail::read_class_names_section(in);
    detail::read_input_scaling_section(in, counters.input_mean, counters.input_scale);
  }
  if (version >= 7) counters.training_data = detail::read_training_data_section(in);
  // Every layer section takes at least its header and fixed fields: a huge count in a
  // small file is refused before reserving anything.
  if (layer_count > in.remaining() / (kSectionHeaderBytes + kLayerFixedBytes)) {
    in.fail("truncated: " + std::to_string(layer_count) + " layers cannot fit in the " +
            std::to_string(in.remaining()) + " bytes left");
  }

  st.layers.reserve(layer_count);
  for (std::uint32_t i = 0; i < layer_count; ++i)
    st.layers.push_back(read_layer(in, i, c, st.step));

  SectionReader end(in, kEndTag, "end section");
  end.finish();
  if (in.remaining() != 0) {
    in.fail(std::to_string(in.remaining()) + " bytes after the end section");
  }
}

// Removes "<path>.tmp.<pid>" files that savers killed mid-save left behind, when their
// process is gone; a live process's (a concurrent save) is left alone.
void remove_stale_temporaries(const std::filesystem::path& path) {
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  const std::string prefix = path.filename().string() + ".tmp.";
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return;  // the save itself will say what is wrong with the directory
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto pid = static_cast<pid_t>(std::stol(digits));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) != 0 && errno == ESRCH) std::filesystem::remove(entry.path(), ec);
  }
}

}  // namespace

bool ModelMemory::is_checkpoint(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[sizeof kMagic] = {};
  return in.read(magic, sizeof magic) && std::memcmp(magic, kMagic, sizeof magic) == 0;
}

void HostModelMemory::save_impl(const std::filesystem::path& path) const {
  remove_stale_temporaries(path);
  std::filesystem::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid());
  bool renamed = false;
  try {
    {
      detail::require_storable_model(model, "save checkpoint " + path.string());
      detail::require_storable_class_names(class_names, "save checkpoint " + path.string());
      detail::require_storable_input_scaling(input_mean, input_scale,
                                             "save checkpoint " + path.string());
      detail::require_storable_training_data(training_data, "save checkpoint " + path.string());
      try {  // what load would refuse is not written
        dynamic.validate();
      } catch (const ArgumentError& e) {
        throw ArgumentError("save checkpoint " + path.string() + ": " + e.what());
      }
      FileWriter out(tmp);
      write_checkpoint(
          out, *state_,
          {seed, epochs, model, dynamic, class_names, input_mean, input_scale, training_data});
      out.commit();
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      throw IoError(os_error("save checkpoint: cannot rename " + tmp.string() + " to", path));
    }
    renamed = true;
    // The rename is durable only once the directory entry is.
    const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
    fsync_directory(dir);
  } catch (...) {
    if (!renamed) ::unlink(tmp.c_str());
    throw;
  }
}

void HostModelMemory::load_impl(const std::filesystem::path& path) {
  FileReader in(path);
  Counters counters;
  auto loaded = std::make_unique<State>();
  read_checkpoint(in, *loaded, counters);
  // Everything checked out: from here on nothing can fail.
  loaded->config.schedule.swap(state_->config.schedule);
  state_ = std::move(loaded);
  seed = counters.seed;
  epochs = counters.epochs;
  model = std::move(counters.model);
  dynamic = counters.dynamic;
  class_names = std::move(counters.class_names);
  input_mean = std::move(counters.input_mean);
  input_scale = std::move(counters.input_scale);
  training_data = std::move(counters.training_data);
}

}  // namespace sluice
