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

/// Sets the callers' OpenMP threads for a scope (0: leaves them), and restores them.
class OmpThreads {
 public:
  explicit OmpThreads(int threads) : before_(omp_get_max_threads()), set_(threads > 0) {
    if (set_) omp_set_num_threads(threads);
  }
  ~OmpThreads() {
    if (set_) omp_set_num_threads(before_);
  }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int before_;
  bool set_;
};

struct DenseMatmul::Impl {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c;
  dnnl::memory::desc b_f32;    ///< B stored as the caller says, in fp32 (pack_b's source)
  dnnl::memory::desc b_plain;  ///< B stored as the caller says, in the matmul's type
  std::int64_t m = 0, k = 0, n = 0;
};

DenseMatmul::DenseMatmul(DenseType type, std::int64_t m, std::int64_t n, std::int64_t k,
                         bool transpose_a, std::int64_t lda, bool transpose_b, std::int64_t ldb,
                         std::int64_t ldc, bool packed_b)
    : impl_(std::make_unique<Impl>()) {
  if (m <= 0 || n <= 0 || k <= 0) {
    throw ShapeError("dense matmul: every dimension must be positive, got " + std::to_string(m) +
                     "x" + std::to_string(k) + " times " + std::to_string(k) + "x" +
                     std::to_string(n));
  }
  try {
    impl_->m = m;
    impl_->k = k;
    impl_->n = n;
    impl_->a = plain(type, m, k, transpose_a, lda);
    impl_->b_plain = plain(type, k, n, transpose_b, ldb);
    impl_->b_f32 = plain(DenseType::f32, k, n, transpose_b, ldb);
    impl_->c = plain(DenseType::f32, m, n, false, ldc);
    const dnnl::memory::desc b_any(
        {k, n},
        type == DenseType::bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32,
        dnnl::memory::format_tag::any);
    const dnnl::matmul::desc desc(impl_->a, packed_b ? b_any : impl_->b_plain, impl_->c);
    // The caller's scratchpad: one primitive then runs on several threads at once (the
    // engine's dense path calls it from each of its tasks).
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    impl_->pd = dnnl::matmul::primitive_desc(desc, attr, cpu_engine());
    impl_->primitive = dnnl::matmul(impl_->pd);
    impl_->b = impl_->pd.weights_desc();
  } catch (const dnnl::error& e) {
    throw Error(std::string("oneDNN matmul could not be set up: ") + e.what());
  }
}

DenseMatmul::~DenseMatmul() = default;
DenseMatmul::DenseMatmul(DenseMatmul&&) noexcept = default;
DenseMatmul& DenseMatmul::operator=(DenseMatmul&&) noexcept = default;

void DenseMatmul::run(const void* a, const void* b, float* c, int threads) const {
  const OmpThreads scope(threads);
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
    throw Error(std::string("oneDNN matmul failed: ") + e.what());
  }
}

bool DenseMatmul::packs_b_as(const DenseMatmul& other) const {
  return impl_->b == other.impl_->b;
}

std::int64_t DenseMatmul::rows() const {
  return impl_->m;
}

std::size_t DenseMatmul::packed_b_bytes() const {
  return impl_->b.get_size();
}

std::int64_t DenseMatmul::inner() const {
  return impl_->k;
}

void DenseMatmul::pack_b(const void* b, bool b_f32, void* packed, std::int64_t first,
                         std::int64_t last) const {
  const OmpThreads scope(1);
  try {
    dnnl::stream stream(cpu_engine());
    const dnnl::memory::desc& whole = b_f32 ? impl_->b_f32 : impl_->b_plain;
    const dnnl::memory::dims dims{last - first, impl_->n}, offsets{first, 0};
    dnnl::memory from(whole.submemory_desc(dims, offsets), cpu_engine(), const_cast<void*>(b));
    dnnl::memory to(impl_->b.submemory_desc(dims, offsets), cpu_engine(), packed);
    dnnl::reorder(from, to).execute(stream, from, to);
    stream.wait();
  } catch (const dnnl::error& e) {
    throw Error(std::string("oneDNN could not pack a matmul operand: ") + e.what());
  }
}

std::string DenseMatmul::implementation() const {
  return impl_->pd.impl_info_str();
}

Bf16Unit DenseMatmul::bf16_unit() {
  const auto isa = dnnl::get_effective_cpu_isa();
  using dnnl::cpu_isa;
  if (isa == cpu_isa::avx512_core_amx) return Bf16Unit::amx;
  return isa == cpu_isa::avx512_core_bf16 ? Bf16Unit::avx512_bf16 : Bf16Unit::none;
}

}  // namespace sluice::detail
