#include "engine/dense_path.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
#include <vector>

#include "core/parallel.hpp"
#include "engine/dense_matmul.hpp"
#include "engine/dense_runs.hpp"
#include "engine/kernels/densify.hpp"
#include "sluice/bf16.hpp"

namespace sluice::detail {
namespace {

// Rows of the stream's matrix per tile: each tile's matmul reads all of B (packed), so
// fewer, taller tiles read it less often; a bf16 tile of a 4096-wide layer is about a
// core's L2. (Measured against 64, 128 and 512: docs/performance_notes.md.)
constexpr std::int64_t kTileRows = 256;
// A group's last tile of fewer rows is multiplied as the next multiple of this many.
constexpr std::int64_t kRowStep = 32;

using Clock = std::chrono::steady_clock;

/// Buffers kept per thread between calls (each use has its own), 64-byte aligned, zeroed
/// when first allocated: a tile's rows past its runs are read but never written.
enum Slot {
  kTile,
  kRuns,
  kResult,
  kGradientRows,
  kGradientTile,
  kPackedRow,
  kPackedGradient,
  kActivations,
  kWhole,
  kSlots
};
template <typename T>
T* scratch(Slot slot, std::size_t count) {
  struct Buffer {
    void* p = nullptr;
    std::size_t size = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buffers[kSlots];
  Buffer& b = buffers[slot];
  const std::size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
  if (b.size < bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, bytes);
    b.size = b.p != nullptr ? bytes : 0;
    if (b.p == nullptr) throw std::bad_alloc();
    std::memset(b.p, 0, bytes);
  }
  return static_cast<T*>(b.p);
}

/// Set-up matmuls kept between calls: setting one up costs more than a tile's product.
using MatmulKey = std::tuple<int, std::int64_t, std::int64_t, std::int64_t, bool, std::int64_t,
                             bool, std::int64_t, std::int64_t>;
std::shared_ptr<const DenseMatmul> matmul_for(DenseType type, std::int64_t m, std::int64_t n,
                                              std::int64_t k, bool ta, std::int64_t lda, bool tb,
                                              std::int64_t ldb, std::int64_t ldc) {
  static std::mutex mutex;
  static std::map<MatmulKey, std::shared_ptr<const DenseMatmul>> cache;
  const MatmulKey key{static_cast<int>(type), m, n, k, ta, lda, tb, ldb, ldc};
  const std::lock_guard lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 64) cache.clear();  // shapes come and go: keep the recent ones
  auto mm = std::make_shared<const DenseMatmul>(type, m, n, k, ta, lda, tb, ldb, ldc, true);
  cache.emplace(key, mm);
  return mm;
}

template <typename T>
constexpr DenseType dense_type() {
  return std::is_same_v<T, float> ? DenseType::f32 : DenseType::bf16;
}

/// B packed for `mm` into `packed`, its rows in parts on the arena's threads (one oneDNN
/// thread each): an OpenMP team packing it would spin after the reorder, on the cores the
/// engine's tasks then need.
void pack_in_parts(const DenseMatmul& mm, const void* b, bool b_f32, void* packed,
                   tbb::task_arena& arena) {
  constexpr std::int64_t step = DenseMatmul::kPackRows;
  const std::int64_t k = mm.inner();
  const std::int64_t parts = std::min<std::int64_t>(arena.max_concurrency(), (k + step - 1) / step);
  const std::int64_t per = ((k + parts - 1) / parts + step - 1) / step * step;
  arena.execute([&] {
    parallel_for(std::int64_t{0}, (k + per - 1) / per, [&](std::int64_t i) {
      mm.pack_b(b, b_f32, packed, i * per, std::min(k, (i + 1) * per));
    });
  });
}

/// The matmuls of one product, for a tile of each multiple of kRowStep rows: all read B
/// packed once per call (where oneDNN packs B for a short tile as for a full one; else a
/// short tile is multiplied as a full one).
struct TileMatmuls {
  std::shared_ptr<const DenseMatmul> by_rows[kTileRows / kRowStep];
  void* packed_b = nullptr;

  template <typename Make>
  TileMatmuls(Make make, const void* b, bool b_f32, Slot slot, tbb::task_arena& arena) {
    auto& full = by_rows[kTileRows / kRowStep - 1];
    full = make(kTileRows);
    packed_b = scratch<std::byte>(slot, full->packed_b_bytes());
    pack_in_parts(*full, b, b_f32, packed_b, arena);
    for (std::int64_t i = 0; i + 1 < kTileRows / kRowStep; ++i) {
      by_rows[i] = make((i + 1) * kRowStep);
      if (!by_rows[i]->packs_b_as(*full)) by_rows[i] = full;
    }
  }
  /// The matmul for a tile of `rows`, and the rows it multiplies.
  const DenseMatmul& for_rows(std::int64_t rows, std::int64_t* padded) const {
    const std::int64_t i = (rows + kRowStep - 1) / kRowStep - 1;
    *padded = by_rows[i]->rows();
    return *by_rows[i];
  }
};

/// An activation matrix as a matmul reads it for A: fp32 in place, bf16 rounded once.
template <typename T>
struct Rows {
  const T* data = nullptr;
  std::int64_t ld = 0, rows = 0;
  Rows(ConstMatrixView m, tbb::task_arena& arena) : rows(m.rows) {
    if constexpr (std::is_same_v<T, float>) {
      data = m.data;
      ld = m.stride;
    } else {
      auto* copy = scratch<std::uint16_t>(kActivations, static_cast<std::size_t>(m.rows * m.cols));
      arena.execute([&] {
        parallel_for(std::int64_t{0}, m.rows, [&](std::int64_t r) {
          for (std::int64_t c = 0; c < m.cols; ++c) copy[r * m.cols + c] = to_bf16(m.row(r)[c]);
        });
      });
      data = copy;
      ld = m.cols;
    }
  }
};

/// One call's products over the stream's runs, a group of chunks per task: each group's
/// runs are checked and densified tile by tile, each tile multiplied while in cache.
template <typename T>
struct TileProducts {
  const DenseStream& s;
  std::int64_t inputs, tokens, ld;
  // Row product: out = M B (B packed in `row`); skipped when `out` is null.
  std::unique_ptr<TileMatmuls> row;
  MutableMatrixView* out = nullptr;
  // Gradient: G = A B^T at the mask (B packed in `grad`); skipped when `gradient` is null.
  std::unique_ptr<TileMatmuls> grad;
  const Rows<T>* a = nullptr;
  std::vector<std::shared_ptr<StreamChunk>>* gradient = nullptr;
  std::atomic<std::uint64_t> weights{0};

  TileProducts(const DenseStream& stream, std::int64_t tokens_)
      : s(stream), inputs(stream.header.inputs), tokens(tokens_), ld(stream.header.inputs) {}

  void run(tbb::task_arena& arena) {
    if (gradient != nullptr) gradient->resize(s.chunks.size());
    arena.execute([&] {
      parallel_for(
          std::size_t{0}, s.groups(), [&](std::size_t g) { group(g); },
          /*one_task_each=*/true);
    });
    s.finish(weights.load());
  }

  void group(std::size_t g) {
    if (gradient != nullptr) start_gradient(g);
    RunWalker<T> walk(s, g);
    T* tile = row ? scratch<T>(kTile, static_cast<std::size_t>(kTileRows * ld)) : nullptr;
    RowRun* runs = scratch<RowRun>(kRuns, kTileRows);
    for (;;) {
      const std::int64_t r0 = walk.first_row();
      const std::int64_t n = walk.next(kTileRows, tile, ld, runs);
      if (n == 0) break;
      if (row) {
        std::int64_t m = 0;
        const DenseMatmul& mm = row->for_rows(n, &m);
        // Straight into the output where its rows are as the matmul writes them (tokens
        // apart, every row of the tile its own); else through a buffer.
        if (m == n && out->stride == tokens) {
          mm.run(tile, row->packed_b, out->row(r0), 1);
        } else {
          float* result = scratch<float>(kResult, static_cast<std::size_t>(m * tokens));
          mm.run(tile, row->packed_b, result, 1);
          for (std::int64_t r = 0; r < n; ++r) {
            std::copy_n(result + r * tokens, tokens, out->row(r0 + r));
          }
        }
      }
      if (gradient != nullptr) gradient_tile(r0, n, runs);
    }
    weights += walk.weights();
  }

  /// The gradient chunks of group g: their controls where the stream has them.
  void start_gradient(std::size_t g) const {
    for (std::size_t c = s.group_start[g]; c < s.group_start[g + 1]; ++c) {
      const StreamChunk& from = *s.chunks[c];
      auto to = std::make_shared<StreamChunk>();
      to->first_output = from.first_output;
      to->outputs = from.outputs;
      to->packets.resize(from.size());
      if (!to->packets.empty()) {
        const std::uint32_t last =
            s.bf16() ? tag_of(from.packets_bf16.back()) : tag_of(from.packets.back());
        if (last == kEndOfLayer) to->packets.back() = {kEndOfLayer, 0.0F};
      }
      (*gradient)[c] = std::move(to);
    }
  }

  /// The gradient at the tile's runs: A's rows times B^T (zero without a product).
  void gradient_tile(std::int64_t r0, std::int64_t n, const RowRun* runs) const {
    float* g = scratch<float>(kGradientTile, static_cast<std::size_t>(kTileRows * inputs));
    if (grad) {
      std::int64_t m = 0;
      const DenseMatmul& mm = grad->for_rows(n, &m);
      const T* rows = a->data + r0 * a->ld;
      if (r0 + m > a->rows) {  // a short last tile: its rows padded
        T* padded = scratch<T>(kGradientRows, static_cast<std::size_t>(kTileRows * a->ld));
        for (std::int64_t r = 0; r < n; ++r) {
          std::copy_n(rows + r * a->ld, tokens, padded + r * a->ld);
        }
        rows = padded;
      }
      mm.run(rows, grad->packed_b, g, 1);
    } else {
      std::fill_n(g, n * inputs, 0.0F);
    }
    const DensifyKernels& kernels = densify_kernels();
    for (std::int64_t r = 0; r < n; ++r) {
      const RowRun& run = runs[r];
      const StreamChunk& from = *s.chunks[run.chunk];
      Packet* to = (*gradient)[run.chunk]->packets.data() + run.begin;
      const float* values = g + r * inputs;
      if (s.bf16()) {
        kernels.gradient_bf16(from.packets_bf16.data() + run.begin, run.end - run.begin, values,
                              to);
      } else {
        kernels.gradient_fp32(from.packets.data() + run.begin, run.end - run.begin, values, to);
      }
      to[run.end - run.begin] = {kCarriageReturn, 0.0F};
    }
  }
};

/// dX = M^T dY (a stream by output): M densified whole, in parallel over the groups, then
/// each task multiplies a slice of its columns by dY (packed once), as the tiles do.
template <typename T>
void transposed_product(const DenseStream& s, ConstMatrixView dy, MutableMatrixView dx,
                        tbb::task_arena& arena) {
  const std::int64_t rows = s.header.outputs, inputs = s.header.inputs, tokens = dx.cols;
  const std::int64_t slices = (inputs + kTileRows - 1) / kTileRows;
  const std::int64_t ld = slices * kTileRows;
  T* m = scratch<T>(kWhole, static_cast<std::size_t>(rows * ld));
  const auto mm =
      matmul_for(dense_type<T>(), kTileRows, tokens, rows, true, ld, false, dy.stride, tokens);
  void* packed = scratch<std::byte>(kPackedRow, mm->packed_b_bytes());
  pack_in_parts(*mm, dy.data, true, packed, arena);
  std::atomic<std::uint64_t> weights{0};
  arena.execute([&] {
    parallel_for(
        std::size_t{0}, s.groups(),
        [&](std::size_t g) {
          RunWalker<T> walk(s, g);
          RowRun* runs = scratch<RowRun>(kRuns, kTileRows);
          for (;;) {
            const std::int64_t r0 = walk.first_row();
            if (walk.next(kTileRows, m + r0 * ld, ld, runs) == 0) break;
          }
          weights += walk.weights();
        },
        /*one_task_each=*/true);
    s.finish(weights.load());
    parallel_for(std::int64_t{0}, slices, [&](std::int64_t i) {
      const std::int64_t c0 = i * kTileRows, c1 = std::min(inputs, c0 + kTileRows);
      float* result = scratch<float>(kResult, static_cast<std::size_t>(kTileRows * tokens));
      mm->run(m + c0, packed, result, 1);
      for (std::int64_t c = c0; c < c1; ++c) {
        std::copy_n(result + (c - c0) * tokens, tokens, dx.row(c));
      }
    });
  });
}

void fill_zero(MutableMatrixView m) {
  for (std::int64_t r = 0; r < m.rows; ++r) std::fill_n(m.row(r), m.cols, 0.0F);
}

void count(const DenseStream& s, EngineCounters& counters, Clock::time_point start) {
  counters.packets += s.packets;
  counters.bytes += s.bytes;
  counters.busy_seconds += std::chrono::duration<double>(Clock::now() - start).count();
}

/// Tiles multiplying M by `b` (inputs x tokens): packed once for every tile.
template <typename T>
std::unique_ptr<TileMatmuls> row_matmuls(std::int64_t ld, ConstMatrixView b, Slot slot,
                                         tbb::task_arena& arena) {
  auto make = [&](std::int64_t m) {
    return matmul_for(dense_type<T>(), m, b.cols, b.rows, false, ld, false, b.stride, b.cols);
  };
  return std::make_unique<TileMatmuls>(make, b.data, true, slot, arena);
}

/// Tiles of the gradient A B^T, A (rows x tokens) held as `a`, B (inputs x tokens).
template <typename T>
std::unique_ptr<TileMatmuls> gradient_matmuls(const Rows<T>& a, ConstMatrixView b,
                                              tbb::task_arena& arena) {
  auto make = [&](std::int64_t m) {
    return matmul_for(dense_type<T>(), m, b.rows, b.cols, false, a.ld, true, b.stride, b.rows);
  };
  return std::make_unique<TileMatmuls>(make, b.data, true, kPackedGradient, arena);
}

/// What one call computes; any of it may be absent (an empty batch): the stream is
/// checked all the same, and a gradient asked for is zero.
struct Wanted {
  const ConstMatrixView* row_b = nullptr;  ///< out = M row_b
  MutableMatrixView* out = nullptr;
  const ConstMatrixView* grad_a = nullptr;  ///< gradient = grad_a grad_b^T at the mask
  const ConstMatrixView* grad_b = nullptr;
  std::vector<std::shared_ptr<StreamChunk>>* gradient = nullptr;
  const ConstMatrixView* transposed_b = nullptr;  ///< transposed_out = M^T transposed_b
  MutableMatrixView* transposed_out = nullptr;
};

template <typename T>
void run_as(const DenseStream& s, const Wanted& w, tbb::task_arena& arena) {
  TileProducts<T> p(s, w.row_b != nullptr ? w.row_b->cols : 0);
  std::unique_ptr<Rows<T>> a;
  if (w.row_b != nullptr) {
    p.row = row_matmuls<T>(p.ld, *w.row_b, kPackedRow, arena);
    p.out = w.out;
  }
  if (w.grad_a != nullptr) {
    a = std::make_unique<Rows<T>>(*w.grad_a, arena);
    p.tokens = w.grad_a->cols;
    p.grad = gradient_matmuls<T>(*a, *w.grad_b, arena);
    p.a = a.get();
  }
  p.gradient = w.gradient;
  if (w.transposed_b == nullptr || p.row || p.gradient != nullptr) p.run(arena);
  if (w.transposed_b != nullptr)
    transposed_product<T>(s, *w.transposed_b, *w.transposed_out, arena);
}

void run(const DenseStream& s, const Wanted& w, tbb::task_arena& arena) {
  if (s.bf16()) {
    run_as<std::uint16_t>(s, w, arena);
  } else {
    run_as<float>(s, w, arena);
  }
}

/// Runs per task: a few groups per thread, each of whole tiles but the last.
std::int64_t rows_per_group(std::int64_t rows, tbb::task_arena& arena) {
  const std::int64_t groups = 4 * static_cast<std::int64_t>(arena.max_concurrency());
  return std::max(2 * kTileRows, (rows + groups - 1) / groups);
}

}  // namespace

void DensePath::forward(StreamSource& weights, ConstMatrixView x, MutableMatrixView y,
                        EngineCounters& counters) {
  const auto start = Clock::now();
  const DenseStream s = DenseStream::take(weights, rows_per_group(y.rows, arena_));
  Wanted w;
  if (y.rows > 0 && x.cols > 0 && x.rows > 0) {
    w.row_b = &x;
    w.out = &y;
  } else {
    fill_zero(y);
  }
  run(s, w, arena_);
  count(s, counters, start);
}

WeightStream DensePath::backward(StreamSource& weights, const ConstMatrixView* x,
                                 ConstMatrixView dy, MutableMatrixView* dx,
                                 EngineCounters& counters) {
  const auto start = Clock::now();
  const DenseStream s =
      DenseStream::take(weights, rows_per_group(weights.header().outputs, arena_));
  std::vector<std::shared_ptr<StreamChunk>> gradient;
  const bool products = dy.cols > 0 && s.header.outputs > 0 && s.header.inputs > 0;
  Wanted w;
  if (dx != nullptr && products) {
    if (s.header.by_input()) {
      w.row_b = &dy;
      w.out = dx;
    } else {
      w.transposed_b = &dy;
      w.transposed_out = dx;
    }
  } else if (dx != nullptr) {
    fill_zero(*dx);
  }
  if (x != nullptr) {
    w.gradient = &gradient;
    if (products) {
      w.grad_a = s.header.by_input() ? x : &dy;
      w.grad_b = s.header.by_input() ? &dy : x;
    }
  }
  run(s, w, arena_);
  count(s, counters, start);
  if (x == nullptr) return {};
  WeightStream out;
  out.header = s.header;
  out.header.kind = StreamKind::gradient;
  out.header.precision = Precision::fp32;
  out.chunks.assign(gradient.begin(), gradient.end());
  counters.bytes += out.byte_size();
  return out;
}

}  // namespace sluice::detail
