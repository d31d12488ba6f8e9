#pragma once
// Plain float64 references the tests compare the engine against, and the error measure
// the CLI uses: |got - want| / sum_k |w_k| |x_k| for each output element, so a result is
// judged against the size of what was summed, not against a value that may cancel to 0.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "sluice/bf16.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/dense.hpp"
#include "sluice/stream.hpp"

namespace sluice::testing {

inline DenseMatrix random_dense(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  DenseMatrix m(rows, cols);
  std::mt19937_64 rng(seed);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      m(r, c) = static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
  }
  return m;
}

/// W with every value rounded to bf16: what a bf16 stream carries, so a bf16 product can
/// be checked against float64 with fp32 tolerances.
inline CsrMatrix rounded_to_bf16(const CsrMatrix& w) {
  std::vector<float> values = w.values();
  for (float& v : values) v = round_to_bf16(v);
  return CsrMatrix(w.rows(), w.cols(), w.row_offsets(), w.col_indices(), std::move(values));
}
inline DenseMatrix rounded_to_bf16(ConstMatrixView x) {
  DenseMatrix m(x.rows, x.cols);
  for (std::int64_t r = 0; r < x.rows; ++r) {
    for (std::int64_t c = 0; c < x.cols; ++c) m(r, c) = round_to_bf16(x.row(r)[c]);
  }
  return m;
}

/// |got - want| relative to `scale` = sum |products| of a sum of `terms` products. Below
/// fp32's smallest normal number a product is a denormal (or flushed to zero), so each
/// term may be off by up to that much: a sum of such tiny products is judged against
/// terms x FLT_MIN, or its underflow would read as a 100% error.
inline double relative_error(double err, double scale, std::int64_t terms) {
  const double underflow =
      static_cast<double>(terms + 1) * static_cast<double>(std::numeric_limits<float>::min());
  return err / std::max(scale, underflow);
}

/// The larger of two errors. A NaN error — an element never written (tests fill outputs
/// with NaN first) or a NaN computed — is infinite: std::max would drop it.
inline double worse(double worst, double err) {
  return std::isnan(err) ? std::numeric_limits<double>::infinity() : std::max(worst, err);
}

/// Largest relative error of `got` against W*X (W as CSR), in float64.
inline double forward_error(const CsrMatrix& w, ConstMatrixView x, ConstMatrixView got) {
  double worst = 0;
  const auto& off = w.row_offsets();
  for (std::int64_t o = 0; o < w.rows(); ++o) {
    for (std::int64_t t = 0; t < x.cols; ++t) {
      double sum = 0, scale = 0;
      for (std::int64_t k = off[o]; k < off[o + 1]; ++k) {
        const double p = double(w.values()[k]) * x(w.col_indices()[k], t);
        sum += p;
        scale += std::abs(p);
      }
      worst = worse(worst, relative_error(std::abs(got(o, t) - sum), scale, off[o + 1] - off[o]));
    }
  }
  return worst;
}

/// Largest relative error of `got` against W^T * dY.
inline double backward_data_error(const CsrMatrix& w, ConstMatrixView dy, ConstMatrixView got) {
  std::vector<double> sum(w.cols() * dy.cols, 0.0), scale(w.cols() * dy.cols, 0.0);
  const auto& off = w.row_offsets();
  for (std::int64_t o = 0; o < w.rows(); ++o) {
    for (std::int64_t k = off[o]; k < off[o + 1]; ++k) {
      const std::int64_t i = w.col_indices()[k];
      for (std::int64_t t = 0; t < dy.cols; ++t) {
        const double p = double(w.values()[k]) * dy(o, t);
        sum[i * dy.cols + t] += p;
        scale[i * dy.cols + t] += std::abs(p);
      }
    }
  }
  const std::vector<std::int64_t> terms = w.column_counts();
  double worst = 0;
  for (std::int64_t i = 0; i < w.cols(); ++i) {
    for (std::int64_t t = 0; t < dy.cols; ++t) {
      const double err = std::abs(got(i, t) - sum[i * dy.cols + t]);
      worst = worse(worst, relative_error(err, scale[i * dy.cols + t], terms[i]));
    }
  }
  return worst;
}

/// A gradient stream's values in the layer's CSR order, whichever way it was streamed.
inline std::vector<float> csr_gradient(const WeightStream& gradient) {
  WeightStream values = gradient;
  values.header.kind = StreamKind::weights;  // decoded as values, not as a gradient
  return decode_stream(values).values();
}

/// Largest relative error of the weight gradient (CSR order) against dot(dY[o], X[i]).
inline double backward_weight_error(const CsrMatrix& mask, ConstMatrixView dy, ConstMatrixView x,
                                    const std::vector<float>& got) {
  double worst = 0;
  const auto& off = mask.row_offsets();
  for (std::int64_t o = 0; o < mask.rows(); ++o) {
    for (std::int64_t k = off[o]; k < off[o + 1]; ++k) {
      const std::int64_t i = mask.col_indices()[k];
      double sum = 0, scale = 0;
      for (std::int64_t t = 0; t < x.cols; ++t) {
        const double p = double(dy(o, t)) * x(i, t);
        sum += p;
        scale += std::abs(p);
      }
      worst = worse(worst, relative_error(std::abs(got[k] - sum), scale, x.cols));
    }
  }
  return worst;
}

}  // namespace sluice::testing
