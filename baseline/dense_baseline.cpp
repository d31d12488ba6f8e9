#include "dense_baseline.hpp"

#include <dnnl.h>
#include <omp.h>

#include <string>

#include "sluice/error.hpp"

namespace sluice::baseline {

void dense_sgemm(ConstMatrixView a, bool transpose_a, ConstMatrixView b, bool transpose_b,
                 MutableMatrixView c) {
  const std::int64_t m = transpose_a ? a.cols : a.rows;
  const std::int64_t k = transpose_a ? a.rows : a.cols;
  const std::int64_t kb = transpose_b ? b.cols : b.rows;
  const std::int64_t n = transpose_b ? b.rows : b.cols;
  if (k != kb || c.rows != m || c.cols != n) {
    throw ShapeError("dense_sgemm: shapes do not fit (" + std::to_string(m) + "x" +
                     std::to_string(k) + " times " + std::to_string(kb) + "x" + std::to_string(n) +
                     " into " + std::to_string(c.rows) + "x" + std::to_string(c.cols) + ")");
  }
  if (m == 0 || n == 0) return;
  const dnnl_status_t status =
      dnnl_sgemm(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k, 1.0F, a.data, a.stride,
                 b.data, b.stride, 0.0F, c.data, c.stride);
  if (status != dnnl_success) {
    throw Error("oneDNN sgemm failed with status " + std::to_string(static_cast<int>(status)));
  }
}

void set_dense_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
}

}  // namespace sluice::baseline
