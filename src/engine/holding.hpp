#pragma once
// How a product's lanes hold its activations: the first decision of a product's plan.
// Internal.
#include <algorithm>
#include <cstdint>

#include "engine/resident_tile.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// Whether lanes copy their activation rows into a packed resident tile. Packing pays
/// when each row is read many times per pass; a very sparse layer reads most rows a few
/// times, and copying them would cost more than it saves. Several lanes always pack: their
/// packets carry indices into the packed rows.
inline bool packs_tiles(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs) {
  constexpr std::uint64_t kReadsPerRow = 16;
  return lanes > 1 ||
         nnz >= kReadsPerRow * static_cast<std::uint64_t>(std::max<std::int64_t>(inputs, 0));
}

/// Whether a bf16 layer's lanes hold its activations in bf16: where they pack them, for
/// more than one token (one token would pad each bf16 row to 32).
inline bool holds_bf16(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs,
                       std::int64_t tokens) {
  return tokens != 1 && packs_tiles(lanes, nnz, inputs);
}

/// How lanes hold a layer's activations. Lanes that pack their rows hold a bf16 layer's in
/// bf16. A bf16 layer too sparse to pack, or a single token, keeps them in fp32
/// (converting all of them would cost more than the product) and the fp32 table's
/// *_bf16_packets kernels read its packets as they are.
struct Holding {
  bool pack;         ///< rows copied into a resident tile
  bool bf16;         ///< ... and held there in bf16
  bool bf16_stream;  ///< the packets are bf16
  Precision precision() const { return bf16 ? Precision::bf16 : Precision::fp32; }
  Hold hold() const { return bf16 ? Hold::bf16 : pack ? Hold::fp32 : Hold::in_place; }
};

/// For `lanes` lanes over a layer's `inputs` rows (the stream's tags), `tokens` wide.
inline Holding holding_for(std::int32_t lanes, std::uint64_t nnz, std::int64_t inputs,
                           std::int64_t tokens, Precision precision) {
  const bool bf16_stream = precision == Precision::bf16;
  return {packs_tiles(lanes, nnz, inputs), bf16_stream && holds_bf16(lanes, nnz, inputs, tokens),
          bf16_stream};
}
inline Holding holding_for(std::int32_t lanes, const StreamHeader& header, std::int64_t tokens) {
  return holding_for(lanes, header.nnz, header.inputs, tokens, header.precision);
}

}  // namespace sluice::detail
