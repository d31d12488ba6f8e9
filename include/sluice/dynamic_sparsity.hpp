#pragma once
// Dynamic sparsity: masks that change while a model trains (prune and regrow, as SET and
// RigL do). In weight streaming the mask lives only in ModelMemory, so a new mask costs
// the engines nothing: they see it from the next stream on.
//
// Every `update_every` steps until the fraction `update_until` of the run, each layer
// drops the fraction
//     drop(t) = drop / 2 * (1 + cos(pi * t / (update_until * total_steps)))
// of its active weights, those with the smallest |w|, and grows as many inactive positions
// (ModelMemory::regrow): SET picks them uniformly at random, RigL takes those with the
// largest |dense gradient| of that step. Grown weights start at 0 with zeroed optimizer
// state; every layer keeps its number of non-zeros.
#include <cstdint>
#include <string>
#include <vector>

#include "sluice/csr_matrix.hpp"

namespace sluice {

enum class MaskUpdateRule {
  // The values are kept in checkpoints: never renumber.
  none = 0,  ///< the mask fixed at initialisation
  set = 1,   ///< SET: grow uniformly random inactive positions
  rigl = 2,  ///< RigL: grow the inactive positions with the largest |dense gradient|
};
const char* to_string(MaskUpdateRule rule);
/// "none", "set" or "rigl"; ArgumentError otherwise.
MaskUpdateRule parse_mask_update_rule(const std::string& name);

/// When and how much the masks change. Steps are counted from 1, as ModelMemory::step()
/// counts them after the step's commit.
struct DynamicSparsity {
  MaskUpdateRule rule = MaskUpdateRule::none;
  std::int64_t update_every = 100;  ///< steps between mask updates
  double drop = 0.3;                ///< fraction of active weights swapped at step 0
  double update_until = 0.75;       ///< fraction of the run after which masks stay fixed
  std::int64_t total_steps = 0;     ///< the run's length: the schedule's horizon
  std::uint64_t seed = 1;           ///< SET's draws (one stream per step and layer)

  /// ArgumentError naming the field: update_every >= 1, drop in (0, 1], update_until in
  /// [0, 1], total_steps >= 0 and, unless the rule is none, > 0.
  void validate() const;
  /// Whether the masks change after step `step` (a multiple of update_every before
  /// update_until * total_steps; never with rule none).
  bool is_update_step(std::int64_t step) const;
  /// drop(step), the cosine-decayed fraction; 0 outside the update window.
  double drop_fraction(std::int64_t step) const;
  /// Weights a layer of `nnz` non-zeros in `cells` positions swaps at `step`:
  /// round(drop_fraction * nnz), at most the inactive positions (cells - nnz).
  std::int64_t swap_count(std::int64_t step, std::int64_t nnz, std::int64_t cells) const;
};

/// `count` distinct positions (row * cols + col) inactive in `mask`, drawn uniformly at
/// random from `seed`, in increasing order: SET's growth. Same seed, same positions.
/// ArgumentError if the mask has fewer than `count` inactive positions.
std::vector<std::int64_t> random_inactive_positions(const CsrMatrix& mask, std::int64_t count,
                                                    std::uint64_t seed);

/// The seed of SET's draws for one layer at one step (splitmix64 of the three).
std::uint64_t mask_update_seed(std::uint64_t seed, std::int64_t step, std::int32_t layer);

}  // namespace sluice
