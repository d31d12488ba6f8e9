#include "sluice/stream_packets.hpp"
#include "core/enum_names.hpp"

namespace sluice {

constexpr detail::EnumName<StreamKind> kStreamKindNames[] = {{StreamKind::weights, "weights"},
                                                             {StreamKind::mask, "mask"},
                                                             {StreamKind::gradient, "gradient"}};

const char* to_string(StreamKind kind) {
  return detail::name_of(kStreamKindNames, kind);
}

constexpr detail::EnumName<StreamOrder> kStreamOrderNames[] = {
    {StreamOrder::by_output, "by_output"}, {StreamOrder::by_input, "by_input"}};

const char* to_string(StreamOrder order) {
  return detail::name_of(kStreamOrderNames, order);
}

std::uint64_t WeightStream::packet_count() const {
  std::uint64_t n = 0;
  for (const ChunkPtr& chunk : chunks) n += chunk->size();
  return n;
}

std::uint64_t WeightStream::byte_size() const {
  std::uint64_t n = 0;
  for (const ChunkPtr& chunk : chunks) n += chunk->byte_size();
  return n;
}

}  // namespace sluice
