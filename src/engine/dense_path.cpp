#include "engine/dense_path.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/parallel.hpp"
#include "engine/dense_matmul.hpp"
#include "sluice/bf16.hpp"
#include "sluice/error.hpp"
#include "stream/stream_check.hpp"

namespace sluice::detail {
namespace {

// Rows of the stream's matrix per tile: a tile of a 4096-wide layer (and its gradient
// tile in fp32) stays in a core's L2 while its matmul runs.
constexpr std::int64_t kTileRows = 64;

using Clock = std::chrono::steady_clock;

/// Where row r of the stream's matrix lies: packets [begin, end) of chunk `chunk`.
struct RowRun {
  std::uint32_t chunk = 0, begin = 0, end = 0;
};

/// The whole stream, taken in and checked (in parallel over chunks), with its rows found.
struct TakenStream {
  StreamHeader header;
  std::vector<ChunkPtr> chunks;
  std::vector<RowRun> rows;
  std::uint64_t packets = 0, bytes = 0;
  bool bf16() const { return header.precision == Precision::bf16; }
};

TakenStream take(StreamSource& source, tbb::task_arena& arena) {
  TakenStream t;
  t.header = source.header();
  check_header(t.header);
  std::uint64_t outputs = 0;
  while (ChunkPtr chunk = source.next()) {
    check_sequence(t.header, *chunk, t.chunks.size(), outputs, false);
    outputs += chunk->outputs;
    t.packets += chunk->size();
    t.bytes += chunk->byte_size();
    t.chunks.push_back(std::move(chunk));
  }
  t.rows.resize(t.header.outputs);
  std::vector<std::uint64_t> weights(t.chunks.size());
  std::vector<char> ends(t.chunks.size());
  arena.execute([&] {
    parallel_for(std::size_t{0}, t.chunks.size(), [&](std::size_t c) {
      const StreamChunk& chunk = *t.chunks[c];
      std::vector<std::uint32_t> returns(chunk.outputs);
      const ChunkFacts facts = check_chunk(t.header, chunk, c, returns.data());
      weights[c] = facts.weights;
      ends[c] = facts.ends_layer ? 1 : 0;
      for (std::uint32_t r = 0; r < chunk.outputs; ++r) {
        t.rows[chunk.first_output + r] = {static_cast<std::uint32_t>(c),
                                          r == 0 ? 0 : returns[r - 1] + 1, returns[r]};
      }
    });
  });
  std::uint64_t total = 0;
  for (std::size_t c = 0; c < t.chunks.size(); ++c) {
    if (ends[c] && c + 1 != t.chunks.size()) {
      throw FormatError(describe_chunk(*t.chunks[c + 1], c + 1) + ": data after end-of-layer");
    }
    total += weights[c];
  }
  check_finished(t.header, outputs, total, !t.chunks.empty() && ends.back());
  return t;
}

/// The dense element type of a precision: fp32 as float, bf16 as its 16 bits.
template <typename T>
constexpr DenseType dense_type() {
  return std::is_same_v<T, float> ? DenseType::f32 : DenseType::bf16;
}

/// Rows [r0, r1) of the stream's matrix into `tile` (kTileRows x ld, zeros elsewhere).
template <typename T>
void densify(const TakenStream& t, std::int64_t r0, std::int64_t r1, T* tile, std::int64_t ld) {
  std::memset(tile, 0, sizeof(T) * static_cast<std::size_t>((r1 - r0) * ld));
  for (std::int64_t r = r0; r < r1; ++r) {
    const RowRun& run = t.rows[r];
    T* row = tile + (r - r0) * ld;
    const StreamChunk& chunk = *t.chunks[run.chunk];
    if constexpr (std::is_same_v<T, float>) {
      const Packet* p = chunk.packets.data();
      for (std::uint32_t k = run.begin; k < run.end; ++k) row[p[k].tag] = p[k].value;
    } else {
      const Bf16Packet* p = chunk.packets_bf16.data();
      for (std::uint32_t k = run.begin; k < run.end; ++k) row[p[k].index] = p[k].value;
    }
  }
}

/// An activation matrix as the matmul reads it: fp32 in place, or a bf16 copy.
template <typename T>
struct Operand {
  std::vector<std::uint16_t> copy;
  const T* data = nullptr;
  std::int64_t ld = 0;
  Operand(ConstMatrixView m, tbb::task_arena& arena) {
    if constexpr (std::is_same_v<T, float>) {
      data = m.data;
      ld = m.stride;
    } else {
      copy.resize(static_cast<std::size_t>(m.rows * m.cols));
      arena.execute([&] {
        parallel_for(std::int64_t{0}, m.rows, [&](std::int64_t r) {
          for (std::int64_t c = 0; c < m.cols; ++c) copy[r * m.cols + c] = to_bf16(m.row(r)[c]);
        });
      });
      data = copy.data();
      ld = m.cols;
    }
  }
  const T* row(std::int64_t r) const { return data + r * ld; }
};

/// A task's buffers, kept per thread between calls; each of the four uses has its own.
enum Buffer { kWeightTile, kRowResult, kGradientRows, kGradientTile };
template <typename T>
std::vector<T>& tile_buffer(std::size_t size, Buffer which) {
  thread_local std::vector<T> buffers[4];
  if (buffers[which].size() < size) buffers[which].resize(size);
  return buffers[which];
}

/// The weight gradient of each packet: the gradient stream's chunks, tags copied, values
/// taken from dense gradient tiles.
std::vector<std::shared_ptr<StreamChunk>> gradient_chunks(const TakenStream& t,
                                                          tbb::task_arena& arena) {
  std::vector<std::shared_ptr<StreamChunk>> out(t.chunks.size());
  arena.execute([&] {
    parallel_for(std::size_t{0}, t.chunks.size(), [&](std::size_t c) {
      const StreamChunk& from = *t.chunks[c];
      auto g = std::make_shared<StreamChunk>();
      g->first_output = from.first_output;
      g->outputs = from.outputs;
      g->packets.resize(from.size());
      if (t.bf16()) {
        for (std::size_t k = 0; k < from.size(); ++k) {
          g->packets[k] = {tag_of(from.packets_bf16[k]), 0.0F};
        }
      } else {
        for (std::size_t k = 0; k < from.size(); ++k) g->packets[k] = {from.packets[k].tag, 0.0F};
      }
      out[c] = std::move(g);
    });
  });
  return out;
}

/// The products of one call, tile by tile over the stream's rows.
template <typename T>
struct RowProducts {
  const TakenStream& t;
  std::int64_t rows, inputs, tokens;
  // Row product: out = M b_row (b_row: inputs x tokens); skipped when `out` is null.
  const Operand<T>* b_row = nullptr;
  MutableMatrixView* out = nullptr;
  // Gradient: G = a_grad b_grad^T at the mask; skipped when `gradient` is empty.
  const Operand<T>* a_grad = nullptr;
  const Operand<T>* b_grad = nullptr;
  std::vector<std::shared_ptr<StreamChunk>>* gradient = nullptr;

  void run(tbb::task_arena& arena) const {
    const std::int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    std::unique_ptr<DenseMatmul> row_mm, grad_mm;
    if (out != nullptr) {
      row_mm = std::make_unique<DenseMatmul>(dense_type<T>(), kTileRows, tokens, inputs, false,
                                             inputs, false, b_row->ld, tokens);
    }
    if (gradient != nullptr) {
      grad_mm = std::make_unique<DenseMatmul>(dense_type<T>(), kTileRows, inputs, tokens, false,
                                              tokens, true, b_grad->ld, inputs);
    }
    arena.execute([&] {
      parallel_for(std::int64_t{0}, tiles, [&](std::int64_t i) {
        const std::int64_t r0 = i * kTileRows, r1 = std::min(rows, r0 + kTileRows);
        if (row_mm) {
          std::vector<T>& tile = tile_buffer<T>(kTileRows * inputs, kWeightTile);
          std::vector<float>& result = tile_buffer<float>(kTileRows * tokens, kRowResult);
          densify(t, r0, r1, tile.data(), inputs);
          row_mm->run(tile.data(), b_row->data, result.data(), 1);
          for (std::int64_t r = r0; r < r1; ++r) {
            std::copy_n(result.data() + (r - r0) * tokens, tokens, out->row(r));
          }
        }
        if (grad_mm) gradient_tile(*grad_mm, r0, r1);
      });
    });
  }

  void gradient_tile(const DenseMatmul& mm, std::int64_t r0, std::int64_t r1) const {
    std::vector<T>& a = tile_buffer<T>(kTileRows * tokens, kGradientRows);
    std::vector<float>& g = tile_buffer<float>(kTileRows * inputs, kGradientTile);
    for (std::int64_t r = r0; r < r1; ++r)
      std::copy_n(a_grad->row(r), tokens, a.data() + (r - r0) * tokens);
    std::fill(a.begin() + (r1 - r0) * tokens, a.begin() + kTileRows * tokens, T{});
    mm.run(a.data(), b_grad->data, g.data(), 1);
    for (std::int64_t r = r0; r < r1; ++r) {
      const RowRun& run = t.rows[r];
      Packet* to = (*gradient)[run.chunk]->packets.data();
      const float* from = g.data() + (r - r0) * inputs;
      for (std::uint32_t k = run.begin; k < run.end; ++k) to[k].value = from[to[k].tag];
    }
  }
};

/// dX = M^T dY (a stream by output): M densified whole (its rows padded to whole tiles of
/// columns), then each task multiplies a slice of its columns, as in the row products: on
/// the engine's threads, one matmul thread each.
template <typename T>
void transposed_product(const TakenStream& t, const Operand<T>& dy, MutableMatrixView dx,
                        tbb::task_arena& arena) {
  const std::int64_t rows = t.header.outputs, inputs = t.header.inputs, tokens = dx.cols;
  const std::int64_t slices = (inputs + kTileRows - 1) / kTileRows, ld = slices * kTileRows;
  std::vector<T> m(static_cast<std::size_t>(rows * ld));
  const DenseMatmul mm(dense_type<T>(), kTileRows, tokens, rows, true, ld, false, dy.ld, tokens);
  arena.execute([&] {
    parallel_for(std::int64_t{0}, (rows + kTileRows - 1) / kTileRows, [&](std::int64_t i) {
      const std::int64_t r0 = i * kTileRows;
      densify(t, r0, std::min(rows, r0 + kTileRows), m.data() + r0 * ld, ld);
    });
    parallel_for(std::int64_t{0}, slices, [&](std::int64_t i) {
      const std::int64_t c0 = i * kTileRows, c1 = std::min(inputs, c0 + kTileRows);
      std::vector<float>& result = tile_buffer<float>(kTileRows * tokens, kRowResult);
      mm.run(m.data() + c0, dy.data, result.data(), 1);
      for (std::int64_t c = c0; c < c1; ++c) {
        std::copy_n(result.data() + (c - c0) * tokens, tokens, dx.row(c));
      }
    });
  });
}

void fill_zero(MutableMatrixView m) {
  for (std::int64_t r = 0; r < m.rows; ++r) std::fill_n(m.row(r), m.cols, 0.0F);
}

void count(const TakenStream& t, EngineCounters& counters, Clock::time_point start) {
  counters.packets += t.packets;
  counters.bytes += t.bytes;
  counters.busy_seconds += std::chrono::duration<double>(Clock::now() - start).count();
}

template <typename T>
void forward_as(const TakenStream& t, ConstMatrixView x, MutableMatrixView y,
                tbb::task_arena& arena) {
  const Operand<T> b(x, arena);
  RowProducts<T> p{t, y.rows, x.rows, x.cols};
  p.b_row = &b;
  p.out = &y;
  p.run(arena);
}

template <typename T>
void backward_as(const TakenStream& t, const ConstMatrixView* x, ConstMatrixView dy,
                 MutableMatrixView* dx, std::vector<std::shared_ptr<StreamChunk>>* gradient,
                 tbb::task_arena& arena) {
  const bool by_input = t.header.by_input();
  const Operand<T> dy_op(dy, arena);
  std::unique_ptr<Operand<T>> x_op;
  if (x != nullptr) x_op = std::make_unique<Operand<T>>(*x, arena);
  RowProducts<T> p{t, t.header.outputs, t.header.inputs, dy.cols};
  if (dx != nullptr && by_input) {
    p.b_row = &dy_op;
    p.out = dx;
  }
  if (gradient != nullptr) {
    p.a_grad = by_input ? x_op.get() : &dy_op;
    p.b_grad = by_input ? &dy_op : x_op.get();
    p.gradient = gradient;
  }
  if (p.rows > 0 && p.inputs > 0 && (p.out != nullptr || p.gradient != nullptr)) p.run(arena);
  if (dx != nullptr && !by_input) transposed_product<T>(t, dy_op, *dx, arena);
}

}  // namespace

void DensePath::forward(StreamSource& weights, ConstMatrixView x, MutableMatrixView y,
                        EngineCounters& counters) {
  const auto start = Clock::now();
  const TakenStream t = take(weights, arena_);
  if (y.rows > 0 && x.cols > 0) {
    if (x.rows == 0) {
      fill_zero(y);
    } else if (t.bf16()) {
      forward_as<std::uint16_t>(t, x, y, arena_);
    } else {
      forward_as<float>(t, x, y, arena_);
    }
  }
  count(t, counters, start);
}

WeightStream DensePath::backward(StreamSource& weights, const ConstMatrixView* x,
                                 ConstMatrixView dy, MutableMatrixView* dx,
                                 EngineCounters& counters) {
  const auto start = Clock::now();
  const TakenStream t = take(weights, arena_);
  std::vector<std::shared_ptr<StreamChunk>> gradient;
  if (x != nullptr) gradient = gradient_chunks(t, arena_);
  if (dx != nullptr && (dy.cols == 0 || dx->rows == 0 || dy.rows == 0)) {
    fill_zero(*dx);
    dx = nullptr;
  }
  if (dy.cols > 0) {
    auto* g = x != nullptr ? &gradient : nullptr;
    if (t.bf16()) {
      backward_as<std::uint16_t>(t, x, dy, dx, g, arena_);
    } else {
      backward_as<float>(t, x, dy, dx, g, arena_);
    }
  }
  count(t, counters, start);
  if (x == nullptr) return {};
  WeightStream out;
  out.header = t.header;
  out.header.kind = StreamKind::gradient;
  out.header.precision = Precision::fp32;
  out.chunks.assign(gradient.begin(), gradient.end());
  counters.bytes += out.byte_size();
  return out;
}

}  // namespace sluice::detail
