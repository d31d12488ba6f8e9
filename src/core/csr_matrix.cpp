#include "sluice/csr_matrix.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include "core/huge_pages.hpp"
#include "sluice/error.hpp"

namespace sluice {

namespace {

// Column indices are stored as uint32; keeping them below 2^31 leaves room for
// signed arithmetic on them everywhere else.
constexpr std::int64_t kMaxCols = std::int64_t{1} << 31;

// Pareto tail exponent of the per-row densities of RowDistribution::powerlaw.
// 1.5 puts the densest rows 15-20x above the median at 90% sparsity and 50-90x
// at 98% (where the cap at `cols` does not bite), like pruned transformer layers.
constexpr double kPowerlawAlpha = 1.5;

// Below this per-row density, skipping over zeros geometrically (one log per
// non-zero) is cheaper than one Bernoulli draw per entry.
constexpr double kGeometricSkipBelow = 0.1;

std::string format_float(float value) {
  return std::to_string(value);  // enough to name the offending value
}

// Our own conversions from 64-bit draws: std::uniform_*_distribution differ
// between standard libraries, and the same seed must give the same matrix anywhere.

/// Uniform in (0, 1]: never 0, so its log is finite.
double uniform_open_zero(std::uint64_t bits) {
  return static_cast<double>((bits >> 11) + 1) * 0x1.0p-53;
}

/// An odd multiple of 2^-23 in (-1, 1) from 23 bits: exact in float, uniform on
/// [-1, 1) to within 2^-23, and never exactly zero (a stored zero would vanish on
/// a trip through a dense matrix).
float signed_unit_from_bits(std::uint32_t bits23) {
  return static_cast<float>(2 * static_cast<std::int32_t>(bits23) + 1) * 0x1.0p-23F - 1.0F;
}

/// Fills `out` with uniform draws in [-scale, scale), two per 64-bit draw.
void fill_uniform(std::mt19937_64& rng, float* out, std::size_t count, float scale) {
  constexpr std::uint64_t kMask23 = (std::uint64_t{1} << 23) - 1;
  std::size_t i = 0;
  for (; i + 1 < count; i += 2) {
    const std::uint64_t bits = rng();
    out[i] = scale * signed_unit_from_bits(static_cast<std::uint32_t>(bits >> 41));
    out[i + 1] = scale * signed_unit_from_bits(static_cast<std::uint32_t>((bits >> 9) & kMask23));
  }
  if (i < count) out[i] = scale * signed_unit_from_bits(static_cast<std::uint32_t>(rng() >> 41));
}

/// Per-row probability that an entry is non-zero, so that the expected total is
/// density * rows * cols. Power law: Pareto weights scaled by s, where s solves
/// sum_r min(cols, s * w_r) = target (rows that would exceed `cols` are capped and
/// their excess goes to the others).
std::vector<double> powerlaw_row_densities(std::mt19937_64& rng, std::int64_t rows,
                                           std::int64_t cols, double density) {
  std::vector<double> weights(static_cast<std::size_t>(rows));
  for (double& w : weights) w = std::pow(uniform_open_zero(rng()), -1.0 / kPowerlawAlpha);

  std::vector<double> sorted = weights;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  // suffix[k] = sum of the weights of all rows but the k heaviest.
  std::vector<double> suffix(sorted.size() + 1, 0.0);
  for (std::size_t k = sorted.size(); k-- > 0;) suffix[k] = suffix[k + 1] + sorted[k];

  const double target = density * static_cast<double>(rows) * static_cast<double>(cols);
  const auto dcols = static_cast<double>(cols);
  double scale = 0.0;
  for (std::size_t capped = 0; capped < sorted.size(); ++capped) {
    scale = (target - static_cast<double>(capped) * dcols) / suffix[capped];
    if (scale * sorted[capped] <= dcols) break;  // the heaviest uncapped row fits
  }
  std::vector<double> densities(weights.size());
  for (std::size_t r = 0; r < weights.size(); ++r) {
    densities[r] = std::min(1.0, scale * weights[r] / dcols);
  }
  return densities;
}

/// Appends the columns of one row, each kept with probability `density`, sorted.
void sample_row(std::mt19937_64& rng, std::int64_t cols, double density,
                std::vector<std::uint32_t>& scratch, std::vector<std::uint32_t>& out) {
  if (density <= 0.0 || cols == 0) return;
  if (density >= 1.0) {
    const std::size_t start = out.size();
    out.resize(start + static_cast<std::size_t>(cols));
    std::iota(out.begin() + static_cast<std::ptrdiff_t>(start), out.end(), std::uint32_t{0});
    return;
  }
  if (density < kGeometricSkipBelow) {
    // The gap before the next non-zero is geometric: floor(log(u) / log(1 - p)).
    const double log_keep_zero = std::log1p(-density);
    std::int64_t col = -1;
    for (;;) {
      const double gap = std::floor(std::log(uniform_open_zero(rng())) / log_keep_zero);
      if (gap > static_cast<double>(cols - 2 - col)) break;  // past the last column
      col += 1 + static_cast<std::int64_t>(gap);
      out.push_back(static_cast<std::uint32_t>(col));
    }
    return;
  }
  // Dense-ish row: one draw per entry, written branch-free (p near 0.5 would
  // mispredict half the time).
  const auto threshold = static_cast<std::uint64_t>(std::ldexp(density, 64));
  scratch.resize(static_cast<std::size_t>(cols));
  std::uint32_t* dst = scratch.data();
  std::size_t kept = 0;
  for (std::int64_t c = 0; c < cols; ++c) {
    dst[kept] = static_cast<std::uint32_t>(c);
    kept += rng() < threshold ? 1 : 0;
  }
  out.insert(out.end(), scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(kept));
}

}  // namespace

CsrMatrix::CsrMatrix(std::int64_t rows, std::int64_t cols, std::vector<std::int64_t> row_offsets,
                     std::vector<std::uint32_t> col_indices, std::vector<float> values)
    : rows_(rows),
      cols_(cols),
      row_offsets_(std::move(row_offsets)),
      col_indices_(std::move(col_indices)),
      values_(std::move(values)) {
  validate();
}

void CsrMatrix::validate() const {
  const std::string where = "CsrMatrix " + std::to_string(rows_) + "x" + std::to_string(cols_);
  if (rows_ < 0 || cols_ < 0) throw FormatError(where + ": negative shape");
  if (cols_ >= kMaxCols) {
    throw FormatError(where + ": " + std::to_string(cols_) + " columns, at most 2^31 - 1 allowed");
  }
  if (static_cast<std::int64_t>(row_offsets_.size()) != rows_ + 1) {
    throw FormatError(where + ": row_offsets has " + std::to_string(row_offsets_.size()) +
                      " entries, expected rows + 1 = " + std::to_string(rows_ + 1));
  }
  if (row_offsets_.front() != 0) {
    throw FormatError(where + ": row_offsets[0] is " + std::to_string(row_offsets_.front()) +
                      ", expected 0");
  }
  for (std::int64_t r = 0; r < rows_; ++r) {
    const auto begin = row_offsets_[static_cast<std::size_t>(r)];
    const auto end = row_offsets_[static_cast<std::size_t>(r) + 1];
    if (end < begin) {
      throw FormatError(where + ": row_offsets decrease at row " + std::to_string(r) +
                        " (row_offsets[" + std::to_string(r) + "] = " + std::to_string(begin) +
                        " > row_offsets[" + std::to_string(r + 1) + "] = " + std::to_string(end) +
                        ")");
    }
  }
  if (row_offsets_.back() != nnz()) {
    throw FormatError(where + ": row_offsets end at " + std::to_string(row_offsets_.back()) +
                      " but there are " + std::to_string(nnz()) + " column indices");
  }
  if (values_.size() != col_indices_.size()) {
    throw FormatError(where + ": " + std::to_string(values_.size()) + " values for " +
                      std::to_string(nnz()) + " column indices");
  }
  for (std::int64_t r = 0; r < rows_; ++r) {
    const auto begin = row_offsets_[static_cast<std::size_t>(r)];
    const auto end = row_offsets_[static_cast<std::size_t>(r) + 1];
    for (auto i = begin; i < end; ++i) {
      const auto col = col_indices_[static_cast<std::size_t>(i)];
      // Built only on failure: this loop runs over every non-zero.
      const auto at = [&] {
        return where + ": row " + std::to_string(r) + ", position " + std::to_string(i - begin);
      };
      if (static_cast<std::int64_t>(col) >= cols_) {
        throw FormatError(at() + ": column index " + std::to_string(col) +
                          " out of range (cols = " + std::to_string(cols_) + ")");
      }
      if (i > begin) {
        const auto previous = col_indices_[static_cast<std::size_t>(i) - 1];
        if (col == previous) {
          throw FormatError(at() + ": duplicate column index " + std::to_string(col));
        }
        if (col < previous) {
          throw FormatError(at() + ": column index " + std::to_string(col) + " after " +
                            std::to_string(previous) + " (unsorted; must increase within a row)");
        }
      }
      const float value = values_[static_cast<std::size_t>(i)];
      if (!std::isfinite(value)) {
        throw FormatError(where + ": row " + std::to_string(r) + ", col " + std::to_string(col) +
                          ": value " + format_float(value) + " is not finite");
      }
    }
  }
}

double CsrMatrix::sparsity() const {
  const double entries = static_cast<double>(rows_) * static_cast<double>(cols_);
  if (entries == 0.0) return 0.0;
  return 1.0 - static_cast<double>(nnz()) / entries;
}

std::vector<std::int64_t> CsrMatrix::column_counts() const {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(cols_), 0);
  for (const auto col : col_indices_) ++counts[col];
  return counts;
}

TransposedPattern transposed_pattern(const CsrMatrix& w) {
  if (w.rows() >= kMaxCols) {
    throw ShapeError("transpose: " + std::to_string(w.rows()) +
                     " rows would be too many columns (at most 2^31 - 1)");
  }
  if (static_cast<std::uint64_t>(w.nnz()) > std::numeric_limits<std::uint32_t>::max()) {
    throw ShapeError("transpose: " + std::to_string(w.nnz()) +
                     " non-zeros, more than 32-bit positions address");
  }
  TransposedPattern t;
  t.rows = w.cols();
  t.cols = w.rows();
  // A counting sort by column: walking W's rows in order leaves each column's entries
  // sorted by row.
  t.row_offsets.assign(static_cast<std::size_t>(t.rows) + 1, 0);
  for (const std::uint32_t c : w.col_indices()) ++t.row_offsets[c + 1];
  std::partial_sum(t.row_offsets.begin(), t.row_offsets.end(), t.row_offsets.begin());
  detail::resize_for_overwrite(t.col_indices, static_cast<std::size_t>(w.nnz()));
  detail::resize_for_overwrite(t.source, static_cast<std::size_t>(w.nnz()));
  std::vector<std::int64_t> next(t.row_offsets.begin(), t.row_offsets.end() - 1);
  const auto& offsets = w.row_offsets();
  const auto& indices = w.col_indices();
  for (std::int64_t row = 0; row < w.rows(); ++row) {
    for (std::int64_t k = offsets[row]; k < offsets[row + 1]; ++k) {
      const auto at = static_cast<std::size_t>(next[indices[k]]++);
      t.col_indices[at] = static_cast<std::uint32_t>(row);
      t.source[at] = static_cast<std::uint32_t>(k);
    }
  }
  return t;
}

CsrMatrix transpose(const CsrMatrix& w) {
  TransposedPattern t = transposed_pattern(w);
  std::vector<float> values(t.source.size());
  for (std::size_t k = 0; k < values.size(); ++k) values[k] = w.values()[t.source[k]];
  return CsrMatrix(t.rows, t.cols, std::move(t.row_offsets), std::move(t.col_indices),
                   std::move(values));
}

CsrMatrix CsrMatrix::from_dense(ConstMatrixView dense) {
  if (dense.rows < 0 || dense.cols < 0 || (dense.rows > 0 && dense.stride < dense.cols)) {
    throw ShapeError("CsrMatrix::from_dense: bad view " + std::to_string(dense.rows) + "x" +
                     std::to_string(dense.cols) + " with stride " + std::to_string(dense.stride));
  }
  if (dense.cols >= kMaxCols) {
    throw ShapeError("CsrMatrix::from_dense: " + std::to_string(dense.cols) +
                     " columns, at most 2^31 - 1 allowed");
  }
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(dense.rows) + 1, 0);
  std::vector<std::uint32_t> cols;
  std::vector<float> values;
  for (std::int64_t r = 0; r < dense.rows; ++r) {
    const float* row = dense.row(r);
    for (std::int64_t c = 0; c < dense.cols; ++c) {
      if (row[c] != 0.0F) {
        cols.push_back(static_cast<std::uint32_t>(c));
        values.push_back(row[c]);
      }
    }
    offsets[static_cast<std::size_t>(r) + 1] = static_cast<std::int64_t>(cols.size());
  }
  return CsrMatrix(dense.rows, dense.cols, std::move(offsets), std::move(cols), std::move(values));
}

DenseMatrix CsrMatrix::to_dense() const {
  DenseMatrix dense(rows_, cols_);
  for (std::int64_t r = 0; r < rows_; ++r) {
    float* row = dense.row(r);
    for (auto i = row_offsets_[static_cast<std::size_t>(r)];
         i < row_offsets_[static_cast<std::size_t>(r) + 1]; ++i) {
      row[col_indices_[static_cast<std::size_t>(i)]] = values_[static_cast<std::size_t>(i)];
    }
  }
  return dense;
}

CsrMatrix CsrMatrix::random(std::int64_t rows, std::int64_t cols, double sparsity,
                            std::uint64_t seed, RowDistribution distribution) {
  if (rows < 0 || cols < 0) {
    throw ShapeError("CsrMatrix::random: negative shape " + std::to_string(rows) + "x" +
                     std::to_string(cols));
  }
  if (cols >= kMaxCols) {
    throw ShapeError("CsrMatrix::random: " + std::to_string(cols) +
                     " columns, at most 2^31 - 1 allowed");
  }
  if (!(sparsity >= 0.0 && sparsity <= 1.0)) {  // also refuses NaN
    throw ArgumentError("CsrMatrix::random: sparsity " + std::to_string(sparsity) +
                        " is outside [0, 1]");
  }
  const double density = 1.0 - sparsity;
  std::mt19937_64 rng(seed);

  std::vector<double> row_density;
  if (distribution == RowDistribution::powerlaw && rows > 0 && cols > 0 && density > 0.0) {
    row_density = powerlaw_row_densities(rng, rows, cols, density);
  } else {
    row_density.assign(static_cast<std::size_t>(rows), density);
  }

  const double expected_nnz = density * static_cast<double>(rows) * static_cast<double>(cols);
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(rows) + 1, 0);
  std::vector<std::uint32_t> col_indices;
  col_indices.reserve(static_cast<std::size_t>(expected_nnz * 1.01) + 64);
  std::vector<std::uint32_t> scratch;
  for (std::int64_t r = 0; r < rows; ++r) {
    sample_row(rng, cols, row_density[static_cast<std::size_t>(r)], scratch, col_indices);
    offsets[static_cast<std::size_t>(r) + 1] = static_cast<std::int64_t>(col_indices.size());
  }

  // Scaled so a row's dot product with unit-variance inputs has about the same
  // variance whatever the sparsity.
  const double expected_per_row = density * static_cast<double>(cols);
  const auto scale = static_cast<float>(1.0 / std::sqrt(std::max(1.0, expected_per_row)));
  std::vector<float> values(col_indices.size());
  fill_uniform(rng, values.data(), values.size(), scale);
  return CsrMatrix(rows, cols, std::move(offsets), std::move(col_indices), std::move(values));
}

void CsrMatrix::fill_values(std::uint64_t seed, float scale) {
  if (!std::isfinite(scale)) {
    throw ArgumentError("CsrMatrix::fill_values: scale " + format_float(scale) + " is not finite");
  }
  std::mt19937_64 rng(seed);
  fill_uniform(rng, values_.data(), values_.size(), scale);
}

}  // namespace sluice
