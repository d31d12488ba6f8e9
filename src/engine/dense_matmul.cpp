#include "engine/dense_matmul.hpp"

#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <vector>

#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::memory::desc plain(DenseType type, std::int64_t rows, std::int64_t cols, bool transposed,
                         std::int64_t ld) {
  const auto dt =
      type == DenseType::bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  // A transposed operand is its transpose stored row-major: column-major with stride ld.
  const dnnl::memory::dims strides =
      transposed ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1};
  return {{rows, cols}, dt, strides};
}

}  // namespace

struct DenseMatmul::Impl {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c;
};

DenseMatmul::DenseMatmul(DenseType type, std::int64_t m, std::int64_t n, std::int64_t k,
                         bool transpose_a, std::int64_t lda, bool transpose_b, std::int64_t ldb,
                         std::int64_t ldc)
    : impl_(std::make_unique<Impl>()) {
  if (m <= 0 || n <= 0 || k <= 0) {
    throw ShapeError("dense matmul: every dimension must be positive, got " + std::to_string(m) +
                     "x" + std::to_string(k) + " times " + std::to_string(k) + "x" +
                     std::to_string(n));
  }
  try {
    impl_->a = plain(type, m, k, transpose_a, lda);
    impl_->b = plain(type, k, n, transpose_b, ldb);
    impl_->c = plain(DenseType::f32, m, n, false, ldc);
    const dnnl::matmul::desc desc(impl_->a, impl_->b, impl_->c);
    // The caller's scratchpad: one primitive then runs on several threads at once (the
    // engine's dense path calls it from each of its tasks).
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    impl_->pd = dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
    impl_->primitive = dnnl::matmul(impl_->pd);
  } catch (const dnnl::error& e) {
    throw Error(std::string("oneDNN matmul could not be set up: ") + e.what());
  }
}

DenseMatmul::~DenseMatmul() = default;
DenseMatmul::DenseMatmul(DenseMatmul&&) noexcept = default;
DenseMatmul& DenseMatmul::operator=(DenseMatmul&&) noexcept = default;

void DenseMatmul::run(const void* a, const void* b, float* c, int threads) const {
  const int before = omp_get_max_threads();
  if (threads > 0) omp_set_num_threads(threads);
  try {
    dnnl::stream stream(cpu_engine());
    const Impl& m = *impl_;
    dnnl::memory ma(m.a, cpu_engine(), const_cast<void*>(a));
    dnnl::memory mb(m.b, cpu_engine(), const_cast<void*>(b));
    dnnl::memory mc(m.c, cpu_engine(), c);
    thread_local std::vector<char> scratch;
    const dnnl::memory::desc scratch_desc = m.pd.scratchpad_desc();
    if (scratch.size() < scratch_desc.get_size()) scratch.resize(scratch_desc.get_size());
    dnnl::memory ms(scratch_desc, cpu_engine(), scratch.data());
    m.primitive.execute(stream, {{DNNL_ARG_SRC, ma},
                                 {DNNL_ARG_WEIGHTS, mb},
                                 {DNNL_ARG_DST, mc},
                                 {DNNL_ARG_SCRATCHPAD, ms}});
    stream.wait();
  } catch (const dnnl::error& e) {
    if (threads > 0) omp_set_num_threads(before);
    throw Error(std::string("oneDNN matmul failed: ") + e.what());
  }
  if (threads > 0) omp_set_num_threads(before);
}

std::string DenseMatmul::implementation() const {
  return impl_->pd.impl_info_str();
}

bool DenseMatmul::bf16_native() {
  const auto isa = dnnl::get_effective_cpu_isa();
  using dnnl::cpu_isa;
  return isa == cpu_isa::avx512_core_bf16 || isa == cpu_isa::avx512_core_amx;
}

}  // namespace sluice::detail
