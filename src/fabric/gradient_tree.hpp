#pragma once
// The fabrics' fixed reduction order: a pairwise tree, level by level, (0,1), (2,3), ...
// so the float additions of a sum over engines are the same on every fabric and every
// run. Internal.
#include <cstddef>
#include <utility>
#include <vector>

namespace sluice::detail {

/// absorb(i, i + d) for every pair of the tree, in order: at distance d = 1, 2, 4, ...
/// element i (a multiple of 2d) absorbs element i + d. The sum ends in element 0.
template <typename Absorb>
void for_each_tree_pair(std::size_t n, Absorb&& absorb) {
  for (std::size_t d = 1; d < n; d *= 2) {
    for (std::size_t i = 0; i + d < n; i += 2 * d) absorb(i, i + d);
  }
}

/// Element k's side of the same tree, for fabrics whose elements sum apart: the
/// elements it absorbs, in the tree's order (k + 1, k + 2, k + 4, ... while k is a
/// multiple of twice the distance).
inline std::vector<std::size_t> tree_children(std::size_t k, std::size_t n) {
  std::vector<std::size_t> children;
  for (std::size_t d = 1; k % (2 * d) == 0 && k + d < n; d *= 2) children.push_back(k + d);
  return children;
}

/// The element that absorbs element k > 0: k less its lowest set bit.
inline std::size_t tree_parent(std::size_t k) {
  return k - (k & (~k + 1));
}

/// Bias gradients of n engines summed in the tree's order.
inline std::vector<float> sum_bias_tree(std::vector<std::vector<float>> biases) {
  if (biases.empty()) return {};
  for_each_tree_pair(biases.size(), [&](std::size_t i, std::size_t j) {
    for (std::size_t o = 0; o < biases[i].size(); ++o) biases[i][o] += biases[j][o];
  });
  return std::move(biases.front());
}

}  // namespace sluice::detail
