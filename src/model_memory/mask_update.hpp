#pragma once
// Internal: one layer's prune and regrow on its pattern, values and optimizer state, as
// ModelMemory::regrow does it (see sluice/dynamic_sparsity.hpp).
#include <cstdint>
#include <span>
#include <vector>

#include "sluice/csr_matrix.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::detail {

/// The `count` active weights with the smallest |w|, as indices into w's CSR arrays, in
/// increasing order. Ties go to the earlier index (row-major position), so the choice
/// does not depend on how a sort breaks them.
std::vector<std::int64_t> smallest_magnitudes(const CsrMatrix& w, std::int64_t count);

/// A layer's new pattern: `weights` holds the kept values and 0 at grown positions;
/// source[j] is where new non-zero j was in the old CSR arrays, or -1 if it was grown.
struct MaskChange {
  CsrMatrix weights;
  std::vector<std::int64_t> source;
};

/// Drops the non-zeros at CSR indices `drop` (increasing) and adds the positions `grow`
/// (row * cols + col, increasing, inactive in w). ArgumentError if an index or position is
/// out of range, out of order, or a grown position is already active.
MaskChange prune_and_regrow(const CsrMatrix& w, std::span<const std::int64_t> drop,
                            std::span<const std::int64_t> grow);

/// new_state[j] = old_state[source[j]], or 0 where source[j] is -1: optimizer state
/// carried over to the new pattern, zeroed for grown weights.
std::vector<float> carry_over(std::span<const float> old_state,
                              std::span<const std::int64_t> source);

/// Layer `layer`'s mask: the matrix itself from a ModelMemory that keeps it in RAM, else
/// decoded from its mask stream into `copy` (a tiered store's layer is in files).
const CsrMatrix& layer_mask(ModelMemory& memory, std::int32_t layer, CsrMatrix& copy);

/// After update step `step`'s commit, layer `layer` drops its smallest weights and grows as
/// many (ModelMemory::regrow): with rule rigl the positions `growth` (scored during the
/// step), with rule set `d`'s seeded draw for this step and layer. What the MLP's executor
/// and the GPT do alike.
void update_layer_mask(ModelMemory& memory, const DynamicSparsity& d, std::int64_t step,
                       std::int32_t layer, std::span<const std::int64_t> growth);

}  // namespace sluice::detail
