// Prune and regrow on one layer (mask_update.hpp), and the schedule and SET draws of
// sluice/dynamic_sparsity.hpp.
#include "model_memory/mask_update.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <unordered_set>

#include "core/enum_names.hpp"
#include "core/splitmix.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/error.hpp"
#include "sluice/stream_codec.hpp"

namespace sluice {

constexpr detail::EnumName<MaskUpdateRule> kMaskUpdateRuleNames[] = {
    {MaskUpdateRule::none, "none"}, {MaskUpdateRule::set, "set"}, {MaskUpdateRule::rigl, "rigl"}};

SLUICE_ENUM_NAMES(MaskUpdateRule, kMaskUpdateRuleNames, parse_mask_update_rule,
                  "dynamic sparsity rule")

void DynamicSparsity::validate() const {
  if (rule != MaskUpdateRule::none && rule != MaskUpdateRule::set && rule != MaskUpdateRule::rigl) {
    throw ArgumentError("dynamic sparsity: unknown rule " + std::to_string(static_cast<int>(rule)));
  }
  if (update_every < 1) {
    throw ArgumentError("dynamic sparsity: update_every must be at least 1, got " +
                        std::to_string(update_every));
  }
  if (!(drop > 0 && drop <= 1)) {
    throw ArgumentError("dynamic sparsity: drop must be in (0, 1], got " + std::to_string(drop));
  }
  if (!(update_until >= 0 && update_until <= 1)) {
    throw ArgumentError("dynamic sparsity: update_until must be in [0, 1], got " +
                        std::to_string(update_until));
  }
  if (total_steps < 0) {
    throw ArgumentError("dynamic sparsity: total_steps must be >= 0, got " +
                        std::to_string(total_steps));
  }
  if (rule != MaskUpdateRule::none && total_steps == 0) {
    // The schedule is a fraction of the run: without its length no mask would ever change.
    throw ArgumentError(std::string("dynamic sparsity: rule ") + to_string(rule) +
                        " needs total_steps, the run's length, for its schedule");
  }
}

double DynamicSparsity::drop_fraction(std::int64_t step) const {
  const double end = update_until * static_cast<double>(total_steps);
  if (step < 1 || static_cast<double>(step) >= end) return 0;
  return drop / 2 * (1 + std::cos(std::numbers::pi * static_cast<double>(step) / end));
}

bool DynamicSparsity::is_update_step(std::int64_t step) const {
  return rule != MaskUpdateRule::none && step >= 1 && step % update_every == 0 &&
         drop_fraction(step) > 0;
}

std::int64_t DynamicSparsity::swap_count(std::int64_t step, std::int64_t nnz,
                                         std::int64_t cells) const {
  if (!is_update_step(step)) return 0;
  const auto count = static_cast<std::int64_t>(std::llround(drop_fraction(step) * nnz));
  return std::clamp<std::int64_t>(count, 0, std::max<std::int64_t>(0, cells - nnz));
}

std::uint64_t mask_update_seed(std::uint64_t seed, std::int64_t step, std::int32_t layer) {
  using detail::splitmix64;
  return splitmix64(splitmix64(splitmix64(seed) ^ static_cast<std::uint64_t>(step)) ^
                    static_cast<std::uint32_t>(layer));
}

std::vector<std::int64_t> random_inactive_positions(const CsrMatrix& mask, std::int64_t count,
                                                    std::uint64_t seed) {
  const std::int64_t cols = mask.cols();
  const std::int64_t inactive = mask.rows() * cols - mask.nnz();
  if (count < 0 || count > inactive) {
    throw ArgumentError("random_inactive_positions: " + std::to_string(count) + " of " +
                        std::to_string(inactive) + " inactive positions asked for");
  }
  // Floyd's sampling of `count` distinct ranks among the inactive positions: no dense
  // mask, memory in the count only. The draws are splitmix64's (the same positions on
  // every platform and standard library), reduced modulo j + 1: a bias under j / 2^64.
  std::uint64_t state = seed;
  auto draw = [&state](std::int64_t j) {
    return static_cast<std::int64_t>(detail::splitmix64(state++) %
                                     static_cast<std::uint64_t>(j + 1));
  };
  std::unordered_set<std::int64_t> chosen;
  chosen.reserve(static_cast<std::size_t>(count));
  for (std::int64_t j = inactive - count; j < inactive; ++j) {
    const std::int64_t t = draw(j);
    chosen.insert(chosen.count(t) != 0 ? j : t);
  }
  std::vector<std::int64_t> ranks(chosen.begin(), chosen.end());
  std::sort(ranks.begin(), ranks.end());
  // Rank -> position: walk the rows, counting their inactive positions.
  std::vector<std::int64_t> out;
  out.reserve(ranks.size());
  const auto& offsets = mask.row_offsets();
  const auto& indices = mask.col_indices();
  std::size_t next = 0;
  std::int64_t before = 0;  // inactive positions in the rows before r
  for (std::int64_t r = 0; r < mask.rows() && next < ranks.size(); ++r) {
    const std::int64_t active = offsets[r + 1] - offsets[r];
    const std::int64_t row_inactive = cols - active;
    std::int64_t k = offsets[r];
    while (next < ranks.size() && ranks[next] < before + row_inactive) {
      // The j-th inactive column: j plus the active columns at or before it.
      std::int64_t c = ranks[next] - before;
      k = offsets[r];
      while (k < offsets[r + 1] && indices[k] <= c) {
        ++c;
        ++k;
      }
      out.push_back(r * cols + c);
      ++next;
    }
    before += row_inactive;
  }
  return out;
}

namespace detail {

std::vector<std::int64_t> smallest_magnitudes(const CsrMatrix& w, std::int64_t count) {
  if (count < 0 || count > w.nnz()) {
    throw ArgumentError("smallest_magnitudes: " + std::to_string(count) + " of " +
                        std::to_string(w.nnz()) + " non-zeros asked for");
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(w.nnz()));
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  const float* v = w.values().data();
  auto smaller = [v](std::int64_t a, std::int64_t b) {
    const float fa = std::fabs(v[a]), fb = std::fabs(v[b]);
    return fa < fb || (fa == fb && a < b);
  };
  std::nth_element(order.begin(), order.begin() + count, order.end(), smaller);
  order.resize(static_cast<std::size_t>(count));
  std::sort(order.begin(), order.end());
  return order;
}

MaskChange prune_and_regrow(const CsrMatrix& w, std::span<const std::int64_t> drop,
                            std::span<const std::int64_t> grow) {
  const std::int64_t rows = w.rows(), cols = w.cols(), nnz = w.nnz();
  for (std::size_t i = 0; i < drop.size(); ++i) {
    if (drop[i] < 0 || drop[i] >= nnz || (i > 0 && drop[i] <= drop[i - 1])) {
      throw ArgumentError("prune_and_regrow: drop index " + std::to_string(drop[i]) + " (entry " +
                          std::to_string(i) + ") is out of range or order (" + std::to_string(nnz) +
                          " non-zeros)");
    }
  }
  for (std::size_t i = 0; i < grow.size(); ++i) {
    if (grow[i] < 0 || grow[i] >= rows * cols || (i > 0 && grow[i] <= grow[i - 1])) {
      throw ArgumentError("prune_and_regrow: grow position " + std::to_string(grow[i]) +
                          " (entry " + std::to_string(i) + ") is out of range or order (" +
                          std::to_string(rows) + "x" + std::to_string(cols) + ")");
    }
  }
  const auto& offsets = w.row_offsets();
  const auto& indices = w.col_indices();
  const auto& values = w.values();
  const std::size_t size = static_cast<std::size_t>(nnz) - drop.size() + grow.size();
  std::vector<std::int64_t> new_offsets{0};
  new_offsets.reserve(static_cast<std::size_t>(rows) + 1);
  std::vector<std::uint32_t> new_indices;
  std::vector<float> new_values;
  MaskChange out;
  new_indices.reserve(size);
  new_values.reserve(size);
  out.source.reserve(size);
  std::size_t d = 0, g = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t k = offsets[r];
    const std::int64_t end = offsets[r + 1];
    // Merge the row's kept entries with its grown positions, both in column order.
    while (k < end || (g < grow.size() && grow[g] / cols == r)) {
      const bool take_grown =
          g < grow.size() && grow[g] / cols == r && (k == end || grow[g] % cols < indices[k]);
      if (take_grown) {
        new_indices.push_back(static_cast<std::uint32_t>(grow[g] % cols));
        new_values.push_back(0.0F);
        out.source.push_back(-1);
        ++g;
        continue;
      }
      if (g < grow.size() && grow[g] == r * cols + indices[k]) {
        throw ArgumentError("prune_and_regrow: grow position " + std::to_string(grow[g]) +
                            " (row " + std::to_string(r) + ", column " +
                            std::to_string(indices[k]) + ") is already active");
      }
      if (d < drop.size() && drop[d] == k) {
        ++d;
      } else {
        new_indices.push_back(indices[k]);
        new_values.push_back(values[k]);
        out.source.push_back(k);
      }
      ++k;
    }
    new_offsets.push_back(static_cast<std::int64_t>(new_indices.size()));
  }
  out.weights =
      CsrMatrix(rows, cols, std::move(new_offsets), std::move(new_indices), std::move(new_values));
  return out;
}

std::vector<float> carry_over(std::span<const float> old_state,
                              std::span<const std::int64_t> source) {
  std::vector<float> out(source.size());
  for (std::size_t j = 0; j < source.size(); ++j) {
    out[j] = source[j] < 0 ? 0.0F : old_state[static_cast<std::size_t>(source[j])];
  }
  return out;
}

const CsrMatrix& layer_mask(ModelMemory& memory, std::int32_t layer, CsrMatrix& copy) {
  if (const auto* host = dynamic_cast<const HostModelMemory*>(&memory); host != nullptr) {
    return host->weights(layer);
  }
  copy = decode_stream(memory.stream(layer, StreamKind::mask));
  return copy;
}

void update_layer_mask(ModelMemory& memory, const DynamicSparsity& d, std::int64_t step,
                       std::int32_t layer, std::span<const std::int64_t> growth) {
  if (d.rule == MaskUpdateRule::rigl) {
    memory.regrow(layer, growth);
    return;
  }
  CsrMatrix copy;
  const CsrMatrix& w = layer_mask(memory, layer, copy);
  const std::int64_t k = d.swap_count(step, w.nnz(), w.rows() * w.cols());
  memory.regrow(layer, random_inactive_positions(w, k, mask_update_seed(d.seed, step, layer)));
}

}  // namespace detail
}  // namespace sluice
