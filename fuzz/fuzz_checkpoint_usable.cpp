// libFuzzer target: checkpoints whose every CRC is right, so the fuzzer reaches past the
// checksums into the loader's invariants and the usability check `sluice train --resume`
// makes after it (mlp_sizes: at least one layer, each taking what the one below gives).
// A load either refuses with a sluice::Error and changes nothing, or gives counters in
// range and layers whose shapes the check accepts or refuses with a sluice::Error.
//
// Input: records of [selector u8][length u16 LE][payload]; the selector's low two bits
// pick the tag (HEAD, MODL, LAYR, END), and the file is "SLUICECK", version 3, then each
// record as a section with its CRC computed here.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <vector>

#include "core/crc32.hpp"
#include "fuzz_checkpoint_load.hpp"
#include "fuzz_input_file.hpp"
#include "sluice/error.hpp"
#include "sluice/executor.hpp"

namespace {

template <typename T>
void put(std::vector<std::uint8_t>& out, T value) {
  std::array<std::uint8_t, sizeof(T)> bytes{};
  std::memcpy(bytes.data(), &value, sizeof(T));
  out.insert(out.end(), bytes.begin(), bytes.end());
}

std::vector<std::uint8_t> checkpoint_of(const std::uint8_t* data, std::size_t size) {
  static constexpr std::array<const char*, 4> kTags = {"HEAD", "MODL", "LAYR", "END "};
  std::vector<std::uint8_t> out = {'S', 'L', 'U', 'I', 'C', 'E', 'C', 'K'};
  put<std::uint32_t>(out, 3);
  std::size_t at = 0;
  while (at + 3 <= size) {
    const char* tag = kTags[data[at] & 3];
    const std::size_t length = data[at + 1] | (std::size_t{data[at + 2]} << 8);
    at += 3;
    const std::size_t n = std::min(length, size - at);
    std::uint32_t tag_value = 0;
    std::memcpy(&tag_value, tag, 4);
    put<std::uint32_t>(out, tag_value);
    put<std::uint64_t>(out, n);
    put<std::uint32_t>(out, sluice::crc32(std::as_bytes(std::span(data + at, n))));
    out.insert(out.end(), data + at, data + at + n);
    at += n;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<std::uint8_t> file = checkpoint_of(data, size);
  const auto path = sluice::fuzz::input_file(file.data(), file.size(), ".ckpt");
  sluice::HostModelMemory memory;
  if (!sluice::fuzz::load_checked(path, memory)) return 0;
  // Loaded: the counters are in range, whatever the file said.
  if (memory.step() < 0 || memory.epochs < 0) std::abort();
  try {
    const std::vector<std::int64_t> sizes = sluice::mlp_sizes(memory);
    if (static_cast<std::int32_t>(sizes.size()) != memory.layer_count() + 1) std::abort();
    for (const std::int64_t s : sizes) {
      if (s < 1) std::abort();
    }
  } catch (const sluice::Error&) {
    // Not a network: sluice train refuses it as bad data, naming the file.
  }
  return 0;
}
