// Sluice's streamed forward against other sparse libraries on the same operands: oneDNN
// dense (the zeros included; sgemm, and matmul in bf16), and, when found at configure
// time, Eigen 3, SuiteSparse:GraphBLAS, librsb and LIBXSMM's spmdm, all on the same number
// of threads. Counters: useful GFLOP/s (2 nnz tokens / time), acceleration over oneDNN's
// matmul of the peer's precision and over the fastest dense of any (acceleration_vs_best),
// all measured in this run. Every library's product is checked once per operand set against
// sluice's, so a peer that computes something else fails loudly instead of looking fast.
//
// Google Benchmark owns argv, so real masks come from the environment: with
// SLUICE_DLMC_DIR set, every .smtx file under it (recursively) is also benchmarked with
// 256 tokens and seeded values, named by its path relative to that directory.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"
#include "sluice/planner.hpp"

#ifdef SLUICE_HAVE_EIGEN
#include <Eigen/Core>
#include <Eigen/SparseCore>
#endif
#ifdef SLUICE_HAVE_GRAPHBLAS
// GraphBLAS 7 declares C functions without extern "C" (it wraps its own C++ parts).
extern "C" {
#include <GraphBLAS.h>
}
#endif
#ifdef SLUICE_HAVE_RSB
#include <rsb.h>
#endif
#ifdef SLUICE_HAVE_LIBXSMM
#include <libxsmm.h>
#include <omp.h>
#endif

namespace sluice::bench {
namespace {

constexpr std::int64_t kDlmcTokens = 256;
// Largest |peer - sluice| over largest |sluice|: float reorderings stay near 1e-6, a
// dropped or misplaced term is of order 1e-2 or more.
constexpr double kAgreement = 1e-4;
// Sluice itself against float64 (relative to sum |w x|, as tests/test_engine.cpp), when
// the reference costs at most a second or so.
constexpr double kReferenceTolerance = 1e-5;
constexpr double kReferenceFlopLimit = 2.0 * (1 << 30);

int bench_threads() {
  return engine().threads();
}

double useful_flops(const Layer& l) {
  return 2.0 * static_cast<double>(l.w.nnz()) * static_cast<double>(l.x.cols());
}

// ---- the libraries, each behind the same small interface ---------------------------
// Built once per operand set (outside the timing), multiply() is what is timed and
// result() returns one freshly computed W X for the check.

struct SluicePeer {
  const Layer& l;
  Placement placement;
  DenseMatrix y;
  explicit SluicePeer(const Layer& layer)
      : l(layer), placement(placement_for(layer)), y(l.w.rows(), l.x.cols()) {}
  void multiply() { engine().forward(l.stream, placement, l.x.view(), y.view()); }
  DenseMatrix result() {
    multiply();
    return y.clone();
  }
  double reference_error(const DenseMatrix& got) const {
    return testing::forward_error(l.w, l.x.view(), got.view());
  }
};

// sluice with the weights streamed and the activations held in bf16 (fp32 sums).
struct SluiceBf16Peer {
  const Layer& l;
  Placement placement;
  WeightStream stream;
  DenseMatrix y;
  explicit SluiceBf16Peer(const Layer& layer)
      : l(layer),
        placement(placement_for(layer)),
        stream(encode_stream(l.w, StreamKind::weights, kDefaultChunkPackets, Precision::bf16)),
        y(l.w.rows(), l.x.cols()) {}
  static constexpr Precision precision = Precision::bf16;
  void multiply() { engine().forward(stream, placement, l.x.view(), y.view()); }
  DenseMatrix result() {
    multiply();
    return y.clone();
  }
  /// Against float64 on the operands as the engine holds them (X in bf16 only where the
  /// lanes pack their rows): fp32 tolerances apply.
  double reference_error(const DenseMatrix& got) const {
    const DenseMatrix x = testing::rounded_to_bf16(l.x.view());
    const bool held = CpuEngine::holds_bf16(placement.lanes, l.w.nnz(), l.w.cols(), l.x.cols());
    return testing::forward_error(testing::rounded_to_bf16(l.w), held ? x.view() : l.x.view(),
                                  got.view());
  }
};

struct OneDnnDensePeer {
  const Layer& l;
  DenseMatrix y;
  explicit OneDnnDensePeer(const Layer& layer) : l(layer), y(l.w.rows(), l.x.cols()) {}
  void multiply() { baseline::dense_sgemm(l.w_dense.view(), false, l.x.view(), false, y.view()); }
  DenseMatrix result() {
    multiply();
    return y.clone();
  }
};

// oneDNN's matmul in bf16 (AMX or AVX512-BF16 where the CPU has them), W and X held in bf16.
struct OneDnnDenseBf16Peer {
  static constexpr Precision precision = Precision::bf16;
  const Layer& l;
  baseline::DenseProduct product;
  DenseMatrix y;
  explicit OneDnnDenseBf16Peer(const Layer& layer)
      : l(layer),
        product(baseline::DenseKind::matmul_bf16, l.w_dense.view(), false, l.x.view(), false),
        y(l.w.rows(), l.x.cols()) {}
  void multiply() { product.run(y.view()); }
  DenseMatrix result() {
    multiply();
    return y.clone();
  }
  double reference_error(const DenseMatrix& got) const {
    return testing::forward_error(testing::rounded_to_bf16(l.w),
                                  testing::rounded_to_bf16(l.x.view()).view(), got.view());
  }
};

#ifdef SLUICE_HAVE_EIGEN
// Row-major sparse times row-major dense: the one layout Eigen runs on OpenMP threads.
struct EigenPeer {
  using Sparse = Eigen::SparseMatrix<float, Eigen::RowMajor>;
  using Dense = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Sparse w;
  Dense x, y;
  explicit EigenPeer(const Layer& l) : w(l.w.rows(), l.w.cols()) {
    std::vector<Eigen::Triplet<float>> entries;
    entries.reserve(static_cast<std::size_t>(l.w.nnz()));
    const auto& offsets = l.w.row_offsets();
    for (std::int64_t r = 0; r < l.w.rows(); ++r) {
      for (std::int64_t k = offsets[r]; k < offsets[r + 1]; ++k) {
        entries.emplace_back(static_cast<int>(r), static_cast<int>(l.w.col_indices()[k]),
                             l.w.values()[k]);
      }
    }
    w.setFromTriplets(entries.begin(), entries.end());
    w.makeCompressed();
    x.resize(l.x.rows(), l.x.cols());
    for (std::int64_t r = 0; r < l.x.rows(); ++r) {
      std::copy_n(l.x.row(r), l.x.cols(), x.row(r).data());
    }
    y.resize(l.w.rows(), l.x.cols());
  }
  void multiply() { y.noalias() = w * x; }
  DenseMatrix result() {
    multiply();
    DenseMatrix out(y.rows(), y.cols());
    for (Eigen::Index r = 0; r < y.rows(); ++r) std::copy_n(y.row(r).data(), y.cols(), out.row(r));
    return out;
  }
};
#endif

#ifdef SLUICE_HAVE_GRAPHBLAS
void grb(GrB_Info info, const char* what) {
  if (info != GrB_SUCCESS) {
    throw std::runtime_error(std::string("GraphBLAS ") + what + " failed (GrB_Info " +
                             std::to_string(static_cast<int>(info)) + ")");
  }
}

template <typename T>
T* malloc_array(std::size_t count) {
  // GraphBLAS takes ownership of packed arrays and frees them with free().
  auto* p = static_cast<T*>(std::malloc(std::max<std::size_t>(count, 1) * sizeof(T)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

// W sparse by row (CSR, never converted to bitmap), X and C full by row; the timed
// call is C += W X, GraphBLAS' in-place path for a full C.
struct GraphBlasPeer {
  GrB_Index rows, cols, tokens;
  GrB_Matrix w = nullptr, x = nullptr, c = nullptr;

  explicit GraphBlasPeer(const Layer& l)
      : rows(static_cast<GrB_Index>(l.w.rows())),
        cols(static_cast<GrB_Index>(l.w.cols())),
        tokens(static_cast<GrB_Index>(l.x.cols())) {
    try {
      build(l);
    } catch (...) {
      release();
      throw;
    }
  }
  GraphBlasPeer(const GraphBlasPeer&) = delete;
  GraphBlasPeer& operator=(const GraphBlasPeer&) = delete;
  ~GraphBlasPeer() { release(); }

  void build(const Layer& l) {
    const auto nnz = static_cast<std::size_t>(l.w.nnz());
    grb(GrB_Matrix_new(&w, GrB_FP32, rows, cols), "GrB_Matrix_new(W)");
    grb(GxB_Matrix_Option_set_INT32(w, GxB_FORMAT, GxB_BY_ROW), "set W by row");
    grb(GxB_Matrix_Option_set_INT32(w, GxB_SPARSITY_CONTROL, GxB_SPARSE), "set W sparse");
    auto* ap = malloc_array<GrB_Index>(rows + 1);
    auto* aj = malloc_array<GrB_Index>(nnz);
    auto* ax = malloc_array<float>(nnz);
    std::copy(l.w.row_offsets().begin(), l.w.row_offsets().end(), ap);
    std::copy(l.w.col_indices().begin(), l.w.col_indices().end(), aj);
    std::copy(l.w.values().begin(), l.w.values().end(), ax);
    void* ax_void = ax;
    const GrB_Info packed =
        GxB_Matrix_pack_CSR(w, &ap, &aj, &ax_void, (rows + 1) * sizeof(GrB_Index),
                            std::max<std::size_t>(nnz, 1) * sizeof(GrB_Index),
                            std::max<std::size_t>(nnz, 1) * sizeof(float), false, false, nullptr);
    if (packed != GrB_SUCCESS) {  // on failure the arrays are still ours
      std::free(ap);
      std::free(aj);
      std::free(ax_void);
      grb(packed, "GxB_Matrix_pack_CSR(W)");
    }

    grb(GrB_Matrix_new(&x, GrB_FP32, cols, tokens), "GrB_Matrix_new(X)");
    grb(GxB_Matrix_Option_set_INT32(x, GxB_FORMAT, GxB_BY_ROW), "set X by row");
    grb(GxB_Matrix_Option_set_INT32(x, GxB_SPARSITY_CONTROL, GxB_FULL), "set X full");
    auto* xx = malloc_array<float>(cols * tokens);
    for (GrB_Index r = 0; r < cols; ++r) {
      std::copy_n(l.x.row(static_cast<std::int64_t>(r)), tokens, xx + r * tokens);
    }
    void* xx_void = xx;
    const GrB_Info packed_x = GxB_Matrix_pack_FullR(
        x, &xx_void, std::max<GrB_Index>(cols * tokens, 1) * sizeof(float), false, nullptr);
    if (packed_x != GrB_SUCCESS) {
      std::free(xx_void);
      grb(packed_x, "GxB_Matrix_pack_FullR(X)");
    }

    grb(GrB_Matrix_new(&c, GrB_FP32, rows, tokens), "GrB_Matrix_new(C)");
    grb(GxB_Matrix_Option_set_INT32(c, GxB_FORMAT, GxB_BY_ROW), "set C by row");
    grb(GxB_Matrix_Option_set_INT32(c, GxB_SPARSITY_CONTROL, GxB_FULL), "set C full");
    zero_c();
  }

  void release() {
    if (w != nullptr) GrB_Matrix_free(&w);
    if (x != nullptr) GrB_Matrix_free(&x);
    if (c != nullptr) GrB_Matrix_free(&c);
  }

  void zero_c() {
    grb(GrB_Matrix_assign_FP32(c, nullptr, nullptr, 0.0F, GrB_ALL, rows, GrB_ALL, tokens, nullptr),
        "GrB_Matrix_assign(C = 0)");
  }

  void multiply() {
    grb(GrB_mxm(c, nullptr, GrB_PLUS_FP32, GrB_PLUS_TIMES_SEMIRING_FP32, w, x, nullptr),
        "GrB_mxm(C += W X)");
  }

  DenseMatrix result() {
    zero_c();
    multiply();
    GrB_Index present = rows * tokens;
    std::vector<GrB_Index> i(present), j(present);
    std::vector<float> v(present);
    grb(GrB_Matrix_extractTuples_FP32(i.data(), j.data(), v.data(), &present, c),
        "GrB_Matrix_extractTuples(C)");
    if (present != rows * tokens) {
      throw std::runtime_error("GraphBLAS: C lost entries (" + std::to_string(present) + " of " +
                               std::to_string(rows * tokens) + " present), so it is not full");
    }
    DenseMatrix out(static_cast<std::int64_t>(rows), static_cast<std::int64_t>(tokens));
    for (GrB_Index k = 0; k < present; ++k) {
      out(static_cast<std::int64_t>(i[k]), static_cast<std::int64_t>(j[k])) = v[k];
    }
    return out;
  }
};
#endif

#ifdef SLUICE_HAVE_RSB
void rsb(rsb_err_t err, const char* what) {
  if (err != RSB_ERR_NO_ERROR) {
    char text[256] = {};
    rsb_strerror_r(err, text, sizeof text);
    throw std::runtime_error(std::string("librsb ") + what + " failed: " + text);
  }
}

struct RsbPeer {
  const Layer& l;
  rsb_mtx_t* w = nullptr;
  DenseMatrix y;

  explicit RsbPeer(const Layer& layer) : l(layer), y(l.w.rows(), l.x.cols()) {
    if (l.w.rows() > INT_MAX || l.w.cols() > INT_MAX || l.w.nnz() > INT_MAX ||
        l.x.stride() > INT_MAX) {
      throw std::runtime_error("librsb: this build indexes with int; the layer is too large");
    }
    std::vector<rsb_coo_idx_t> ia, ja;
    ia.reserve(static_cast<std::size_t>(l.w.nnz()));
    ja.reserve(static_cast<std::size_t>(l.w.nnz()));
    const auto& offsets = l.w.row_offsets();
    for (std::int64_t r = 0; r < l.w.rows(); ++r) {
      for (std::int64_t k = offsets[r]; k < offsets[r + 1]; ++k) {
        ia.push_back(static_cast<rsb_coo_idx_t>(r));
        ja.push_back(static_cast<rsb_coo_idx_t>(l.w.col_indices()[k]));
      }
    }
    rsb_err_t err = RSB_ERR_NO_ERROR;
    w = rsb_mtx_alloc_from_coo_const(
        l.w.values().data(), ia.data(), ja.data(), static_cast<rsb_nnz_idx_t>(l.w.nnz()),
        RSB_NUMERICAL_TYPE_FLOAT, static_cast<rsb_coo_idx_t>(l.w.rows()),
        static_cast<rsb_coo_idx_t>(l.w.cols()), RSB_DEFAULT_ROW_BLOCKING, RSB_DEFAULT_COL_BLOCKING,
        RSB_FLAG_NOFLAGS, &err);
    if (w == nullptr && err == RSB_ERR_NO_ERROR) err = RSB_ERR_GENERIC_ERROR;
    rsb(err, "rsb_mtx_alloc_from_coo_const");
  }
  RsbPeer(const RsbPeer&) = delete;
  RsbPeer& operator=(const RsbPeer&) = delete;
  ~RsbPeer() {
    if (w != nullptr) rsb_mtx_free(w);
  }

  void multiply() {
    const float one = 1.0F, zero = 0.0F;
    rsb(rsb_spmm(RSB_TRANSPOSITION_N, &one, w, static_cast<rsb_coo_idx_t>(l.x.cols()),
                 RSB_FLAG_WANT_ROW_MAJOR_ORDER, l.x.data(),
                 static_cast<rsb_nnz_idx_t>(l.x.stride()), &zero, y.data(),
                 static_cast<rsb_nnz_idx_t>(y.stride())),
        "rsb_spmm");
  }
  DenseMatrix result() {
    multiply();
    return y.clone();
  }
};
#endif

// ---- caches: the run order is one operand set after another, so one slot each -------

#ifdef SLUICE_HAVE_LIBXSMM
// LIBXSMM's spmdm: W held dense (its zeros included) and cut once into 16-bit CSR slices
// of blocks (outside the timing, as other peers' formats are built), then the blocked
// sparse-times-dense product on OpenMP threads. Debian's LIBXSMM 1.17 gets the first row
// of a block wrong when the block is all or nearly all non-zeros (a standalone program
// reproduces it: docs/performance_notes.md), so at sparsity 0 the check reports an error.
struct LibxsmmPeer {
  const Layer& l;
  libxsmm_spmdm_handle handle{};
  libxsmm_CSR_sparseslice* slices = nullptr;
  DenseMatrix y;
  int threads;
  explicit LibxsmmPeer(const Layer& layer)
      : l(layer), y(l.w.rows(), l.x.cols()), threads(bench_threads()) {
    if (l.w_dense.stride() != l.w.cols() || l.x.stride() != l.x.cols() || y.stride() != y.cols()) {
      throw std::runtime_error("libxsmm spmdm: operands must be contiguous");
    }
    libxsmm_spmdm_init(static_cast<int>(l.w.rows()), static_cast<int>(l.x.cols()),
                       static_cast<int>(l.w.cols()), threads, &handle, &slices);
    const int blocks = libxsmm_spmdm_get_num_createSparseSlice_blocks(&handle);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), n = omp_get_num_threads();
      for (int b = tid; b < blocks; b += n) {
        libxsmm_spmdm_createSparseSlice_fp32_thread(&handle, 'N', l.w_dense.data(), slices, b, tid,
                                                    n);
      }
    }
  }
  ~LibxsmmPeer() {
    libxsmm_spmdm_destroy(&handle);
  }
  LibxsmmPeer(const LibxsmmPeer&) = delete;
  LibxsmmPeer& operator=(const LibxsmmPeer&) = delete;
  void multiply() {
    const float alpha = 1, beta = 0;
    const int blocks = libxsmm_spmdm_get_num_compute_blocks(&handle);
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), n = omp_get_num_threads();
      for (int b = tid; b < blocks; b += n) {
        libxsmm_spmdm_compute_fp32_thread(&handle, 'N', 'N', &alpha, slices, l.x.data(), 'N', &beta,
                                          y.data(), b, tid, n);
      }
    }
  }
  DenseMatrix result() {
    multiply();
    return y.clone();
  }
};
#endif

template <typename T>
struct Slot {
  std::string key;
  std::unique_ptr<T> value;
  bool checked = false;
};

template <typename T>
Slot<T>& slot() {
  static Slot<T> instance;
  return instance;
}

template <typename Peer>
Slot<Peer>& peer_for(const std::string& key, const Layer& l) {
  Slot<Peer>& s = slot<Peer>();
  if (s.key != key || !s.value) {
    s.value.reset();  // free the previous operands before building the next
    s.value = std::make_unique<Peer>(l);
    s.key = key;
    s.checked = false;
  }
  return s;
}

const DenseMatrix& sluice_result(const std::string& key, const Layer& l) {
  Slot<DenseMatrix>& s = slot<DenseMatrix>();
  if (s.key != key || !s.value) {
    s.value = std::make_unique<DenseMatrix>(SluicePeer(l).result());
    s.key = key;
  }
  return *s.value;
}

void release_caches() {
  slot<SluicePeer>().value.reset();
  slot<SluiceBf16Peer>().value.reset();
  slot<OneDnnDensePeer>().value.reset();
  slot<OneDnnDenseBf16Peer>().value.reset();
  slot<DenseMatrix>().value.reset();
#ifdef SLUICE_HAVE_EIGEN
  slot<EigenPeer>().value.reset();
#endif
#ifdef SLUICE_HAVE_GRAPHBLAS
  slot<GraphBlasPeer>().value.reset();
#endif
#ifdef SLUICE_HAVE_RSB
  slot<RsbPeer>().value.reset();
#endif
#ifdef SLUICE_HAVE_LIBXSMM
  slot<LibxsmmPeer>().value.reset();
#endif
}

/// max |got - want| / max |want| (or the bare difference when want is all zeros).
double relative_difference(ConstMatrixView got, ConstMatrixView want) {
  double diff = 0, scale = 0;
  for (std::int64_t r = 0; r < want.rows; ++r) {
    for (std::int64_t c = 0; c < want.cols; ++c) {
      const double d = std::abs(double(got(r, c)) - double(want(r, c)));
      diff = std::isnan(d) ? INFINITY : std::max(diff, d);
      scale = std::max(scale, std::abs(double(want(r, c))));
    }
  }
  return scale > 0 ? diff / scale : diff;
}

bool any_failed = false;  // makes the exit status non-zero, so scripts notice too

void skip(benchmark::State& state, const std::string& message) {
  any_failed = true;
  // Kept alive to the end of the run, whatever the library version does with the pointer.
  static std::deque<std::string> messages;
  messages.push_back(message);
  state.SkipWithError(messages.back().c_str());
}

// ---- the benchmark body, the same for every library ---------------------------------

template <typename Peer>
void run_peer(benchmark::State& state, const char* name, const std::string& key, const Layer& l) {
  try {
    Slot<Peer>& s = peer_for<Peer>(key, l);
    Peer& peer = *s.value;
    if (!s.checked) {
      const DenseMatrix got = peer.result();
      if constexpr (requires { peer.reference_error(got); }) {
        // Sluice is everyone's reference, so it answers to float64 where that is affordable.
        if (useful_flops(l) <= kReferenceFlopLimit) {
          const double error = peer.reference_error(got);
          if (!(error < kReferenceTolerance)) {
            throw std::runtime_error(std::string(name) +
                                     " disagrees with the float64 reference on " + key +
                                     ": relative error " + std::to_string(error));
          }
        }
      } else {
        const double difference = relative_difference(got.view(), sluice_result(key, l).view());
        if (!(difference < kAgreement)) {
          throw std::runtime_error(std::string(name) + " disagrees with sluice on " + key +
                                   ": max |diff| / max |y| = " + std::to_string(difference));
        }
      }
      s.checked = true;
    }
    for (auto _ : state) peer.multiply();
    state.counters["useful_GFLOPs"] =
        benchmark::Counter(useful_flops(l) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    // The peer first: oneDNN's OpenMP threads spin on after each call and would slow it.
    const double peer_s = median_seconds([&] { peer.multiply(); });
    Precision precision = Precision::fp32;
    if constexpr (requires { Peer::precision; }) precision = Peer::precision;
    DenseMatrix y(l.w.rows(), l.x.cols());
    set_dense_counters(state,
                       baseline::time_dense(
                           {{l.w_dense.view(), false, l.x.view(), false, y.view()}}, precision, 5),
                       peer_s);
    state.counters["nnz"] = static_cast<double>(l.w.nnz());
  } catch (const std::exception& e) {
    skip(state, e.what());
  }
}

std::string sweep_key(const benchmark::State& state) {
  return std::to_string(state.range(0)) + "x" + std::to_string(state.range(1)) + "x" +
         std::to_string(state.range(2)) + "@" + std::to_string(state.range(3));
}

template <typename Peer>
void register_peer_sweep(const char* name) {
  register_sweep(name, [name](benchmark::State& state) {
    run_peer<Peer>(state, name, sweep_key(state), layer(state));
  });
}

// ---- DLMC masks --------------------------------------------------------------------

const Layer& dlmc_layer(const std::filesystem::path& path) {
  Slot<Layer>& s = slot<Layer>();
  if (s.key != path.string() || !s.value) {
    s.value.reset();
    auto l = std::make_unique<Layer>();
    l->w = read_smtx(path, 42);
    l->w_dense = l->w.to_dense();
    l->x = testing::random_dense(l->w.cols(), kDlmcTokens, 43);
    l->stream = encode_stream(l->w);
    s.value = std::move(l);
    s.key = path.string();
  }
  return *s.value;
}

struct PeerEntry {
  const char* name;
  void (*run)(benchmark::State&, const char*, const std::string&, const Layer&);
};

std::vector<PeerEntry> peers() {
  std::vector<PeerEntry> list = {{"sluice_fp32", run_peer<SluicePeer>},
                                 {"sluice_bf16", run_peer<SluiceBf16Peer>},
                                 {"onednn_dense", run_peer<OneDnnDensePeer>}};
  if (baseline::DenseKind::matmul_bf16 == baseline::same_precision_kind(Precision::bf16)) {
    list.push_back({"onednn_dense_bf16", run_peer<OneDnnDenseBf16Peer>});
  }
#ifdef SLUICE_HAVE_EIGEN
  list.push_back({"eigen", run_peer<EigenPeer>});
#endif
#ifdef SLUICE_HAVE_GRAPHBLAS
  list.push_back({"graphblas", run_peer<GraphBlasPeer>});
#endif
#ifdef SLUICE_HAVE_RSB
  list.push_back({"librsb", run_peer<RsbPeer>});
#endif
#ifdef SLUICE_HAVE_LIBXSMM
  list.push_back({"libxsmm_spmdm", run_peer<LibxsmmPeer>});
#endif
  return list;
}

// File by file (every library on one mask before the next is read), so one cached
// layer at a time suffices however large the collection.
void register_dlmc(const std::filesystem::path& root) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    if (entry.is_regular_file() && entry.path().extension() == ".smtx") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    const std::string relative = std::filesystem::relative(file, root).generic_string();
    for (const PeerEntry& peer : peers()) {
      const std::string name = std::string(peer.name) + "/dlmc/" + relative;
      benchmark::RegisterBenchmark(name.c_str(),
                                   [peer, file](benchmark::State& state) {
                                     const Layer* l = nullptr;
                                     try {
                                       l = &dlmc_layer(file);
                                     } catch (const std::exception& e) {
                                       skip(state, e.what());
                                       return;
                                     }
                                     peer.run(state, peer.name, file.string(), *l);
                                   })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

/// Puts every library on the same thread count as the engine; returns a description.
std::string configure_threads(int threads) {
  baseline::set_dense_threads(threads);
  std::string found = "onednn";
#ifdef SLUICE_HAVE_EIGEN
  Eigen::setNbThreads(threads);
  found += " eigen-" + std::to_string(EIGEN_WORLD_VERSION) + "." +
           std::to_string(EIGEN_MAJOR_VERSION) + "." + std::to_string(EIGEN_MINOR_VERSION);
#endif
#ifdef SLUICE_HAVE_GRAPHBLAS
  grb(GrB_init(GrB_BLOCKING), "GrB_init");
  grb(GxB_Global_Option_set_INT32(GxB_GLOBAL_NTHREADS, threads), "set GxB_NTHREADS");
  found += " graphblas-" + std::to_string(GxB_IMPLEMENTATION_MAJOR) + "." +
           std::to_string(GxB_IMPLEMENTATION_MINOR) + "." + std::to_string(GxB_IMPLEMENTATION_SUB);
#endif
#ifdef SLUICE_HAVE_RSB
  rsb(rsb_lib_init(RSB_NULL_INIT_OPTIONS), "rsb_lib_init");
  const rsb_int_t rsb_threads = threads;
  rsb(rsb_lib_set_opt(RSB_IO_WANT_EXECUTING_THREADS, &rsb_threads), "set executing threads");
  found += std::string(" librsb-") + RSB_LIBRSB_VER_STRING;
#endif
#ifdef SLUICE_HAVE_LIBXSMM
  libxsmm_init();
  found += std::string(" libxsmm-") + LIBXSMM_VERSION;
#endif
  return found;
}

void finalize_libraries() {
  release_caches();
#ifdef SLUICE_HAVE_GRAPHBLAS
  GrB_finalize();
#endif
#ifdef SLUICE_HAVE_RSB
  rsb_lib_exit(RSB_NULL_EXIT_OPTIONS);
#endif
}

}  // namespace
}  // namespace sluice::bench

int main(int argc, char** argv) {
  using namespace sluice::bench;
  const int threads = bench_threads();
  benchmark::AddCustomContext("threads", std::to_string(threads));
  benchmark::AddCustomContext("libraries", configure_threads(threads));
  register_peer_sweep<SluicePeer>("sluice_fp32");
  register_peer_sweep<SluiceBf16Peer>("sluice_bf16");
  register_peer_sweep<OneDnnDensePeer>("onednn_dense");
  if (sluice::baseline::DenseKind::matmul_bf16 ==
      sluice::baseline::same_precision_kind(sluice::Precision::bf16)) {
    register_peer_sweep<OneDnnDenseBf16Peer>("onednn_dense_bf16");
  }
#ifdef SLUICE_HAVE_EIGEN
  register_peer_sweep<EigenPeer>("eigen");
#endif
#ifdef SLUICE_HAVE_GRAPHBLAS
  register_peer_sweep<GraphBlasPeer>("graphblas");
#endif
#ifdef SLUICE_HAVE_RSB
  register_peer_sweep<RsbPeer>("librsb");
#endif
#ifdef SLUICE_HAVE_LIBXSMM
  register_peer_sweep<LibxsmmPeer>("libxsmm_spmdm");
#endif
  if (const char* dlmc = std::getenv("SLUICE_DLMC_DIR"); dlmc != nullptr && *dlmc != '\0') {
    register_dlmc(dlmc);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  finalize_libraries();
  return any_failed ? 1 : 0;
}
