#include "sluice/stream_packets.hpp"
#include "core/enum_names.hpp"

namespace sluice {

constexpr detail::EnumName<StreamKind> kStreamKindNames[] = {{StreamKind::weights, "weights"},
                                                             {StreamKind::mask, "mask"},
                                                             {StreamKind::gradient, "gradient"}};

SLUICE_ENUM_TO_STRING(StreamKind, kStreamKindNames)

constexpr detail::EnumName<StreamOrder> kStreamOrderNames[] = {
    {StreamOrder::by_output, "by_output"}, {StreamOrder::by_input, "by_input"}};

SLUICE_ENUM_TO_STRING(StreamOrder, kStreamOrderNames)

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
