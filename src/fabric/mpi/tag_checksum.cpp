#include "fabric/mpi/tag_checksum.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace sluice::mpi {
namespace {

// Tags are gathered into words this many at a time (on the stack, in L1) and folded.
constexpr std::size_t kBlockWords = 256;

// One raw CRC-32C step over a tag's 4 bytes (little-endian).
std::uint32_t crc32c_tag(std::uint32_t crc, std::uint32_t tag) {
  std::array<std::byte, 4> bytes;
  for (std::size_t b = 0; b < 4; ++b) bytes[b] = static_cast<std::byte>((tag >> (8 * b)) & 0xFFU);
  return ~crc32c(bytes, ~crc);
}

}  // namespace

TagChecksum::TagChecksum() : fold_(detail::crc32c_lanes(default_isa())) {}

std::uint64_t TagChecksum::add(const StreamChunk& chunk, Precision precision, float* values) {
  if (precision == Precision::bf16) {
    return scan(chunk.packets_bf16.data(), chunk.packets_bf16.size(), values);
  }
  return scan(chunk.packets.data(), chunk.packets.size(), values);
}

std::uint32_t TagChecksum::checksum() const {
  std::uint32_t lanes[4] = {lane_[0], lane_[1], lane_[2], lane_[3]};
  if (pending_) lanes[words_ % 4] = crc32c_tag(lanes[words_ % 4], pending_tag_);
  std::uint32_t c = detail::crc32c_word(~0U, words_ * 2 + (pending_ ? 1 : 0));
  c = detail::crc32c_word(c, lanes[0] | (std::uint64_t{lanes[1]} << 32));
  c = detail::crc32c_word(c, lanes[2] | (std::uint64_t{lanes[3]} << 32));
  return ~c;
}

template <typename P>
std::uint64_t TagChecksum::scan(const P* p, std::size_t n, float* values) {
  std::uint64_t written = 0;
  auto value = [&](const P& q) {
    if (!is_control(q)) {
      if (values != nullptr) values[written] = value_of(q);
      ++written;
    }
  };
  std::uint64_t words[kBlockWords];
  std::size_t i = 0;
  if (pending_ && n > 0) {  // the odd tag of the previous chunk and this chunk's first
    const std::uint64_t w = pending_tag_ | (std::uint64_t{tag_of(p[0])} << 32);
    fold_(lane_, words_++, &w, 1);
    value(p[0]);
    pending_ = false;
    i = 1;
  }
  while (i + 2 <= n) {
    const std::size_t count = std::min(kBlockWords, (n - i) / 2);
    for (std::size_t j = 0; j < count; ++j, i += 2) {
      words[j] = tag_of(p[i]) | (std::uint64_t{tag_of(p[i + 1])} << 32);
      value(p[i]);
      value(p[i + 1]);
    }
    fold_(lane_, words_, words, count);
    words_ += count;
  }
  if (i < n) {
    pending_ = true;
    pending_tag_ = tag_of(p[i]);
    value(p[i]);
  }
  return written;
}

}  // namespace sluice::mpi
