#pragma once
// Internal: what every ModelMemory implementation does with a layer it holds in RAM,
// whatever holds it: encode the layer's stream into a channel, and check a gradient
// stream against the layer's mask while copying it out in CSR order; and the step's
// shared refusals.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

std::string layer_name(std::int32_t layer);

/// Encodes the layer `w` (by input through `transposed`, which must then be given) chunk
/// by chunk into `channel`; does not close it. The arguments were checked by the caller.
void encode_layer(const CsrMatrix& w, const TransposedPattern* transposed, StreamKind kind,
                  StreamChannel& channel, std::size_t chunk_packets, Precision precision,
                  StreamOrder order);

/// Checks that `gradient`'s chunks follow each other, cover the layer, and carry exactly
/// the mask's packets in the stream's order (by input through `transposed`); copies the
/// values into `out` (nnz floats, CSR order). Returns their sum of squares; FormatError
/// naming the layer, the chunk and the run otherwise. The header was checked.
double scan_gradient(std::int32_t layer, const WeightStream& gradient, const CsrMatrix& mask,
                     const TransposedPattern* transposed, float* out);

/// NumericError for a step skipped under NonFinitePolicy::error.
[[noreturn]] void throw_skipped_step(const std::vector<std::int32_t>& bad_layers,
                                     std::int64_t step);

/// ShapeError if a layer (a pointer to something with `pending_mutex` and
/// `pending.submitted`) holds a gradient waiting for commit_step; `what` names the call.
template <typename Layers>
void refuse_if_pending(const Layers& layers, const char* what) {
  for (std::size_t i = 0; i < layers.size(); ++i) {
    std::lock_guard lock(layers[i]->pending_mutex);
    if (layers[i]->pending.submitted) {
      throw ShapeError(std::string(what) + ": " + layer_name(static_cast<std::int32_t>(i)) +
                       " has a gradient waiting for commit_step");
    }
  }
}

}  // namespace sluice::detail
