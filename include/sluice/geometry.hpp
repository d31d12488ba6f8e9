#pragma once
// How an engine lays a layer's product over its threads: P lanes ("engine rows") x Q token
// blocks ("engine columns"), or S stream shares where a batch is too small to slice by
// tokens for every thread (see sluice/engine.hpp). The engine chooses it per layer; the
// cost model (sluice/layer_cost_model.hpp) prices it.
#include <cstdint>
#include <string>

namespace sluice {

struct Geometry {
  std::int32_t lanes = 0;        ///< P; 0 = choose
  std::int32_t blocks = 0;       ///< Q; 0 = choose
  std::int32_t tile_tokens = 0;  ///< tokens per pass over the stream; 0 = choose
  /// S; 0 = choose (more than 1 only where the blocks alone leave threads idle, and only
  /// when the blocks are chosen too: a fixed Q keeps S = 1 unless S is fixed as well).
  std::int32_t shares = 0;
  std::string to_string() const;  // "PxQ/tile", or "PxQxS/tile" when S > 1
};

}  // namespace sluice
