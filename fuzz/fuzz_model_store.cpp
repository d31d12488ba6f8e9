// libFuzzer target: a model store (TieredModelMemory) with one of its files replaced by the
// fuzz input opens and reads every layer, or is refused with a sluice::Error that leaves
// every file of the store as it was. The input's first byte picks the file (mod 3: 0
// MANIFEST, 1 a layer's pattern, 2 a layer's state with Adam's moments) and, with bit 2
// set, has every section's CRC recomputed, so the fuzzer reaches past the checksums into
// the fields and the patterns' invariants; the rest is the file's bytes. A seed store of
// two layers, trained one step, is built once per process; each input gets a copy of it.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/crc32.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/stream_codec.hpp"
#include "sluice/tiered_model_memory.hpp"

namespace {

namespace fs = std::filesystem;
constexpr std::int64_t kBudget = std::int64_t{64} << 20;

fs::path scratch(const char* name) {
  return fs::temp_directory_path() /
         ("sluice-fuzz-store-" + std::to_string(::getpid()) + "-" + name);
}

/// Every file of `dir` by name, with its bytes.
std::map<std::string, std::string> files_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    out[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

struct Seed {
  fs::path dir = scratch("seed");
  std::map<std::string, std::string> files;
  std::string pattern, state;  ///< names of the files inputs 1 and 2 replace

  Seed() {
    fs::remove_all(dir);
    {
      sluice::TieredModelMemory memory(dir, kBudget);
      memory.set_optimizer({.kind = sluice::OptimizerKind::adam, .learning_rate = 1e-2});
      sluice::build_sparse_mlp(memory, {6, 5, 3}, 0.5, 1);
      sluice::LocalFabric fabric({.engines = 1});
      sluice::LayerStreamingExecutor executor(memory, fabric);
      sluice::DenseMatrix batch(6, 4);
      for (std::int64_t r = 0; r < 6; ++r) {
        for (std::int64_t c = 0; c < 4; ++c) batch.row(r)[c] = 0.25F * static_cast<float>(r - c);
      }
      executor.train_step({batch.view(), {0, 1, 2, 1}, {}});
    }
    files = files_of(dir);
    for (const auto& [name, bytes] : files) {
      if (name.starts_with("layer-000001.") && name.ends_with(".pattern")) pattern = name;
      if (name.starts_with("layer-000001.") && name.ends_with(".state")) state = name;
    }
    if (pattern.empty() || state.empty()) std::abort();  // the seed store's layout changed
  }
  ~Seed() {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
    fs::remove_all(scratch("store"), ignored);
  }
};

/// The file's sections (after the 12-byte magic and version) given the CRCs of the bytes
/// they hold: tag u32, length u64, CRC u32, payload, the last cut short by the file's end.
void recompute_crcs(std::string& file) {
  constexpr std::size_t kPrefix = 12, kHeader = 16;
  std::size_t at = kPrefix;
  while (at + kHeader <= file.size()) {
    std::uint64_t length = 0;
    std::memcpy(&length, file.data() + at + 4, 8);
    const std::size_t n = std::min<std::uint64_t>(length, file.size() - at - kHeader);
    const std::uint32_t crc =
        sluice::crc32(std::as_bytes(std::span(file.data() + at + kHeader, n)));
    std::memcpy(file.data() + at + 12, &crc, 4);
    at += kHeader + n;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const Seed seed;
  if (size == 0) return 0;
  const std::string names[] = {"MANIFEST", seed.pattern, seed.state};
  const fs::path dir = scratch("store");
  fs::remove_all(dir);
  fs::create_directory(dir);
  for (const auto& [name, bytes] : seed.files) {
    std::ofstream(dir / name, std::ios::binary) << bytes;
  }
  std::string file(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((data[0] & 4) != 0) recompute_crcs(file);
  std::ofstream(dir / names[data[0] % 3], std::ios::binary | std::ios::trunc) << file;
  const auto before = files_of(dir);
  std::optional<sluice::TieredModelMemory> memory;
  try {
    memory.emplace(dir, kBudget);
  } catch (const sluice::Error&) {
    if (files_of(dir) != before) std::abort();  // a refused store must be left as it was
    return 0;
  }
  try {  // an opened store reads its layers back (their CRCs checked again), or refuses
    for (std::int32_t l = 0; l < memory->layer_count(); ++l) {
      (void)sluice::decode_stream(memory->stream(l));
      (void)memory->bias(l);
    }
  } catch (const sluice::Error&) {
  }
  return 0;
}
