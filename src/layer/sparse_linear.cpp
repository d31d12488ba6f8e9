#include "sluice/sparse_linear.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>
#include <string>

#include "core/parallel.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"
#include "sluice/stream_codec.hpp"

namespace sluice {

struct SparseLinear::Cache {
  std::mutex mutex;
  std::map<std::int32_t, Placement> placements;
  std::once_flag by_output_once;
  TransposedPattern by_output;
};

namespace {

std::string shape(std::int64_t rows, std::int64_t cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}

/// " (row, column)", as messages name an entry of a dense matrix.
std::string position(std::int64_t row, std::int64_t col) {
  return " (" + std::to_string(row) + ", " + std::to_string(col) + ")";
}

/// The feature count and token count of an activation view.
struct Extent {
  std::int64_t features = 0;
  std::int64_t tokens = 0;
};
template <typename T>
Extent extent(const MatrixView<T>& v, Layout layout) {
  return layout == Layout::feature_major ? Extent{v.rows, v.cols} : Extent{v.cols, v.rows};
}

template <typename T>
void check_activation(const MatrixView<T>& v, Layout layout, std::int64_t features,
                      std::int64_t tokens, const char* name) {
  if (v.rows < 0 || v.cols < 0 || v.stride < v.cols || (v.data == nullptr && v.rows * v.cols > 0)) {
    throw ShapeError(std::string("SparseLinear: bad ") + name + " view " + shape(v.rows, v.cols) +
                     " with stride " + std::to_string(v.stride));
  }
  const Extent e = extent(v, layout);
  if (e.features != features || (tokens >= 0 && e.tokens != tokens)) {
    const bool fm = layout == Layout::feature_major;
    throw ShapeError(std::string("SparseLinear: ") + name + " is " + shape(v.rows, v.cols) +
                     (fm ? " (features x tokens)" : " (tokens x features)") + ", expected " +
                     std::to_string(features) + " features" +
                     (tokens >= 0 ? " and " + std::to_string(tokens) + " tokens" : ""));
  }
}

/// dst = src^T. A row of a layer's activations is often a power of two bytes long (4096
/// features are 16 KiB), so walking src down a column reads lines that share one cache set
/// and evict each other before the next column comes back to them. Instead each 16 x 16
/// tile is read row by row into a local buffer (every line of src taken whole, once) and
/// written from it row by row of dst; blocks of 128 x 128 keep a block's lines of both in
/// cache, and are the parallel tasks.
void transpose(ConstMatrixView src, MutableMatrixView dst) {
  constexpr std::int64_t kTile = 16, kBlock = 128;
  const std::int64_t row_blocks = (src.rows + kBlock - 1) / kBlock;
  const std::int64_t col_blocks = (src.cols + kBlock - 1) / kBlock;
  auto block = [&](std::int64_t r0, std::int64_t c0) {
    const std::int64_t r1 = std::min(r0 + kBlock, src.rows), c1 = std::min(c0 + kBlock, src.cols);
    float tile[kTile][kTile];
    for (std::int64_t tr = r0; tr < r1; tr += kTile) {
      const std::int64_t rows = std::min(kTile, r1 - tr);
      for (std::int64_t tc = c0; tc < c1; tc += kTile) {
        const std::int64_t cols = std::min(kTile, c1 - tc);
        for (std::int64_t r = 0; r < rows; ++r) std::copy_n(src.row(tr + r) + tc, cols, tile[r]);
        for (std::int64_t c = 0; c < cols; ++c) {
          float* out = dst.row(tc + c) + tr;
          for (std::int64_t r = 0; r < rows; ++r) out[r] = tile[r][c];
        }
      }
    }
  };
  const auto blocks = static_cast<std::size_t>(row_blocks * col_blocks);
  detail::parallel_for_ranges(0, blocks, 1, [&](std::size_t lo, std::size_t hi) {
    for (auto b = static_cast<std::int64_t>(lo); b < static_cast<std::int64_t>(hi); ++b) {
      block(b / col_blocks * kBlock, b % col_blocks * kBlock);
    }
  });
}

/// The feature-major form of `v`: `v` itself, or a transposed copy kept in `scratch`.
ConstMatrixView features_of(ConstMatrixView v, Layout layout, DenseMatrix& scratch) {
  if (layout == Layout::feature_major) return v;
  scratch = DenseMatrix(v.cols, v.rows);
  transpose(v, scratch.view());
  return scratch.view();
}

/// Where the engine writes a result bound for `out`: `out` itself, or scratch to be
/// transposed into it afterwards (see deliver).
MutableMatrixView target_of(MutableMatrixView out, Layout layout, DenseMatrix& scratch) {
  if (layout == Layout::feature_major) return out;
  scratch = DenseMatrix(out.cols, out.rows);
  return scratch.view();
}
void deliver(const DenseMatrix& scratch, MutableMatrixView out, Layout layout) {
  if (layout == Layout::token_major) transpose(scratch.view(), out);
}

void add_bias(MutableMatrixView y, std::span<const float> bias) {
  if (bias.empty()) return;
  detail::parallel_for_ranges(0, static_cast<std::size_t>(y.rows), 16,
                              [&](std::size_t lo, std::size_t hi) {
                                for (std::size_t o = lo; o < hi; ++o) {
                                  float* row = y.row(static_cast<std::int64_t>(o));
                                  const float b = bias[o];
                                  for (std::int64_t t = 0; t < y.cols; ++t) row[t] += b;
                                }
                              });
}

/// db[o] = sum over tokens of dY[o, :]: the fabric's bias gradient (so the layer's equals one
/// engine's in a training run bit for bit), over ranges of rows on the caller's threads.
std::vector<float> row_sums(ConstMatrixView dy) {
  std::vector<float> sums(static_cast<std::size_t>(dy.rows));
  detail::parallel_for_ranges(0, sums.size(), 16, [&](std::size_t lo, std::size_t hi) {
    const auto first = static_cast<std::int64_t>(lo);
    const ConstMatrixView rows{dy.row(first), static_cast<std::int64_t>(hi) - first, dy.cols,
                               dy.stride};
    const std::vector<float> part = bias_gradient(rows);
    std::copy(part.begin(), part.end(), sums.begin() + static_cast<std::ptrdiff_t>(lo));
  });
  return sums;
}

/// The gradient stream's values in the layer's CSR order.
std::vector<float> values_of(const WeightStream& gradient, const TransposedPattern* by_input) {
  std::vector<float> values(gradient.header.nnz);
  std::size_t k = 0;
  for (const ChunkPtr& chunk : gradient.chunks) {
    for (const Packet& p : chunk->packets) {
      if (is_control(p)) continue;
      if (k >= values.size())
        throw FormatError("SparseLinear: gradient stream has too many weights");
      values[by_input != nullptr ? by_input->source[k] : k] = p.value;
      ++k;
    }
  }
  if (k != values.size()) throw FormatError("SparseLinear: gradient stream has too few weights");
  return values;
}

}  // namespace

SparseLinear::SparseLinear(std::shared_ptr<ModelMemory> memory, CsrMatrix weights,
                           std::vector<float> bias)
    : memory_(std::move(memory)), cache_(std::make_unique<Cache>()) {
  if (!memory_) throw ArgumentError("SparseLinear: no ModelMemory");
  layer_ = memory_->add_layer(std::move(weights), std::move(bias));
}

SparseLinear::SparseLinear(std::shared_ptr<ModelMemory> memory, std::int32_t layer)
    : memory_(std::move(memory)), layer_(layer), cache_(std::make_unique<Cache>()) {
  if (!memory_) throw ArgumentError("SparseLinear: no ModelMemory");
  if (layer < 0 || layer >= memory_->layer_count()) {
    throw ArgumentError("SparseLinear: no layer " + std::to_string(layer) +
                        " in a ModelMemory of " + std::to_string(memory_->layer_count()));
  }
}

SparseLinear::~SparseLinear() = default;
SparseLinear::SparseLinear(SparseLinear&& other) noexcept = default;
SparseLinear& SparseLinear::operator=(SparseLinear&& other) noexcept = default;

SparseLinear SparseLinear::from_dense(std::shared_ptr<ModelMemory> memory, ConstMatrixView dense,
                                      ConstMatrixView mask, std::vector<float> bias) {
  if (mask.rows != dense.rows || mask.cols != dense.cols) {
    throw ShapeError("SparseLinear::from_dense: mask is " + shape(mask.rows, mask.cols) +
                     ", weights " + shape(dense.rows, dense.cols));
  }
  std::vector<std::int64_t> offsets{0};
  std::vector<std::uint32_t> columns;
  std::vector<float> values;
  for (std::int64_t r = 0; r < dense.rows; ++r) {
    for (std::int64_t c = 0; c < dense.cols; ++c) {
      if (std::isnan(mask(r, c))) {
        throw FormatError("SparseLinear::from_dense: mask" + position(r, c) +
                          " is NaN, neither zero (pruned) nor non-zero (kept)");
      }
      if (mask(r, c) == 0.0F) continue;
      columns.push_back(static_cast<std::uint32_t>(c));
      values.push_back(dense(r, c));
    }
    offsets.push_back(static_cast<std::int64_t>(columns.size()));
  }
  CsrMatrix w(dense.rows, dense.cols, std::move(offsets), std::move(columns), std::move(values));
  return {std::move(memory), std::move(w), std::move(bias)};
}

SparseLinear SparseLinear::from_file(std::shared_ptr<ModelMemory> memory,
                                     const std::filesystem::path& path, std::uint64_t seed,
                                     std::vector<float> bias) {
  return {std::move(memory), read_matrix(path, seed), std::move(bias)};
}

SparseLinear SparseLinear::pruned(std::shared_ptr<ModelMemory> memory, ConstMatrixView dense,
                                  double sparsity, std::vector<float> bias) {
  if (!(sparsity >= 0.0 && sparsity < 1.0)) {
    throw ArgumentError("SparseLinear::pruned: sparsity " + std::to_string(sparsity) +
                        " is not in [0, 1)");
  }
  const std::int64_t total = dense.rows * dense.cols;
  auto keep =
      static_cast<std::int64_t>(std::llround((1.0 - sparsity) * static_cast<double>(total)));
  keep = std::clamp<std::int64_t>(keep, total > 0 ? 1 : 0, total);
  // A NaN has no magnitude to rank (and breaks nth_element's ordering).
  for (std::int64_t r = 0; r < dense.rows; ++r) {
    for (std::int64_t c = 0; c < dense.cols; ++c) {
      if (!std::isfinite(dense(r, c))) {
        throw FormatError("SparseLinear::pruned: weight" + position(r, c) +
                          " is not finite: magnitude pruning ranks finite weights");
      }
    }
  }
  // Rank positions by magnitude, ties by position, and mark the first `keep`.
  std::vector<std::int64_t> order(static_cast<std::size_t>(total));
  std::iota(order.begin(), order.end(), 0);
  auto at = [&](std::int64_t k) { return std::fabs(dense(k / dense.cols, k % dense.cols)); };
  std::nth_element(order.begin(), order.begin() + keep, order.end(),
                   [&](std::int64_t a, std::int64_t b) {
                     const float fa = at(a), fb = at(b);
                     return fa > fb || (fa == fb && a < b);
                   });
  DenseMatrix mask(dense.rows, dense.cols);
  for (std::int64_t k = 0; k < keep; ++k) {
    const std::int64_t p = order[static_cast<std::size_t>(k)];
    mask(p / dense.cols, p % dense.cols) = 1.0F;
  }
  return from_dense(std::move(memory), dense, mask.view(), std::move(bias));
}

std::int64_t SparseLinear::in_features() const {
  return weights().cols();
}
std::int64_t SparseLinear::out_features() const {
  return weights().rows();
}
std::int64_t SparseLinear::nnz() const {
  return weights().nnz();
}
const CsrMatrix& SparseLinear::weights() const {
  return memory_->weights(layer_);
}
const std::vector<float>& SparseLinear::bias() const {
  return memory_->bias(layer_);
}

const Placement& SparseLinear::placement_for(const Engine& engine, std::int64_t tokens,
                                             Precision precision) const {
  const CsrMatrix& w = weights();
  const Geometry g = engine.geometry_for(w.rows(), w.cols(), tokens, precision,
                                         static_cast<std::uint64_t>(w.nnz()));
  const std::int32_t lanes = std::max(1, g.lanes);
  std::lock_guard lock(cache_->mutex);
  auto it = cache_->placements.find(lanes);
  if (it == cache_->placements.end()) {
    // One lane owns everything: no need to count columns.
    Placement p =
        lanes == 1 ? Placement::single_lane(w.cols(), w.nnz()) : round_robin_placement(w, lanes);
    it = cache_->placements.emplace(lanes, std::move(p)).first;
  }
  return it->second;
}

WeightStream SparseLinear::stream(StreamKind kind, StreamOrder order,
                                  const ProductOptions& options) const {
  if (options.values.empty() || kind == StreamKind::mask) {
    return memory_->stream(layer_, kind, options.precision, order);
  }
  const CsrMatrix& w = weights();
  if (static_cast<std::int64_t>(options.values.size()) != w.nnz()) {
    throw ShapeError("SparseLinear: " + std::to_string(options.values.size()) +
                     " values for a layer of " + std::to_string(w.nnz()) + " non-zeros");
  }
  const TransposedPattern* runs = nullptr;
  if (order == StreamOrder::by_input) {
    runs = &memory_->transposed(layer_);
  } else {
    std::call_once(cache_->by_output_once, [&] {
      TransposedPattern& p = cache_->by_output;
      p.rows = w.rows();
      p.cols = w.cols();
      p.row_offsets = w.row_offsets();
      p.col_indices = w.col_indices();
      p.source.resize(static_cast<std::size_t>(w.nnz()));
      std::iota(p.source.begin(), p.source.end(), 0U);
    });
    runs = &cache_->by_output;
  }
  WeightStream s;
  s.header = stream_header_for(w, kind, options.precision, order);
  std::int64_t first = 0;
  do {
    const std::int64_t last = chunk_end(*runs, first, kDefaultChunkPackets);
    s.chunks.push_back(encode_chunk(*runs, options.values, kind, first, last, options.precision));
    first = last;
  } while (first < runs->rows);
  return s;
}

void SparseLinear::forward(Engine& engine, ConstMatrixView x, MutableMatrixView y,
                           const ProductOptions& options) const {
  const std::int64_t tokens = extent(x, options.layout).tokens;
  check_activation(x, options.layout, in_features(), -1, "X");
  check_activation(y, options.layout, out_features(), tokens, "Y");
  std::span<const float> bias =
      options.values.empty() ? std::span<const float>(this->bias()) : options.bias;
  if (!bias.empty() && static_cast<std::int64_t>(bias.size()) != out_features()) {
    throw ShapeError("SparseLinear: bias of " + std::to_string(bias.size()) + " for " +
                     std::to_string(out_features()) + " outputs");
  }
  DenseMatrix x_scratch, y_scratch;
  const ConstMatrixView xf = features_of(x, options.layout, x_scratch);
  const MutableMatrixView yf = target_of(y, options.layout, y_scratch);
  const WeightStream w = stream(StreamKind::weights, StreamOrder::by_output, options);
  engine.forward(w, placement_for(engine, tokens, options.precision), xf, yf);
  add_bias(yf, bias);
  deliver(y_scratch, y, options.layout);
}

StreamOrder SparseLinear::data_order(Precision precision) const {
  // By input where the layer can be streamed so (as the executor decides): the engine then
  // gathers dY once for dX and the weight gradient alike.
  return streams_by_input(out_features(), nnz(), precision) ? StreamOrder::by_input
                                                            : StreamOrder::by_output;
}

WeightStream SparseLinear::run_backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                                        MutableMatrixView* dx, const ProductOptions& options,
                                        std::vector<float>& bias_gradient) const {
  const std::int64_t tokens = extent(x, options.layout).tokens;
  check_activation(x, options.layout, in_features(), -1, "X");
  check_activation(dy, options.layout, out_features(), tokens, "dY");
  if (dx != nullptr) check_activation(*dx, options.layout, in_features(), tokens, "dX");
  DenseMatrix x_scratch, dy_scratch, dx_scratch;
  const ConstMatrixView xf = features_of(x, options.layout, x_scratch);
  const ConstMatrixView dyf = features_of(dy, options.layout, dy_scratch);
  MutableMatrixView dxf;
  if (dx != nullptr) dxf = target_of(*dx, options.layout, dx_scratch);
  const WeightStream s = dx != nullptr
                             ? stream(StreamKind::weights, data_order(options.precision), options)
                             : stream(StreamKind::mask, StreamOrder::by_output, options);
  WeightStream gradient = engine.backward(s, placement_for(engine, tokens, options.precision), xf,
                                          dyf, dx != nullptr ? &dxf : nullptr);
  const bool has_bias = options.values.empty() ? !bias().empty() : !options.bias.empty();
  bias_gradient = has_bias ? row_sums(dyf) : std::vector<float>{};
  if (dx != nullptr) deliver(dx_scratch, *dx, options.layout);
  return gradient;
}

SparseLinearGradient SparseLinear::backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                                            MutableMatrixView* dx,
                                            const ProductOptions& options) const {
  SparseLinearGradient g;
  const WeightStream gradient = run_backward(engine, x, dy, dx, options, g.bias);
  const bool by_input = gradient.header.order == StreamOrder::by_input;
  g.weights = values_of(gradient, by_input ? &memory_->transposed(layer_) : nullptr);
  return g;
}

void SparseLinear::backward_data(Engine& engine, ConstMatrixView dy, MutableMatrixView dx,
                                 const ProductOptions& options) const {
  const std::int64_t tokens = extent(dy, options.layout).tokens;
  check_activation(dy, options.layout, out_features(), -1, "dY");
  check_activation(dx, options.layout, in_features(), tokens, "dX");
  DenseMatrix dy_scratch, dx_scratch;
  const ConstMatrixView dyf = features_of(dy, options.layout, dy_scratch);
  const MutableMatrixView dxf = target_of(dx, options.layout, dx_scratch);
  const WeightStream s = stream(StreamKind::weights, data_order(options.precision), options);
  engine.backward_data(s, placement_for(engine, tokens, options.precision), dyf, dxf);
  deliver(dx_scratch, dx, options.layout);
}

void SparseLinear::hand_in_backward(bool add, Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                                    MutableMatrixView* dx, const ProductOptions& options) const {
  if (!options.values.empty()) {
    throw ShapeError(std::string("SparseLinear::") +
                     (add ? "accumulate_backward" : "submit_backward") +
                     ": the gradient of values held outside the ModelMemory is returned "
                     "(backward), not submitted");
  }
  std::vector<float> bias_gradient;
  const WeightStream gradient = run_backward(engine, x, dy, dx, options, bias_gradient);
  if (add) {
    memory_->accumulate_gradient(layer_, gradient, bias_gradient);
  } else {
    memory_->submit_gradient(layer_, gradient, bias_gradient);
  }
}

void SparseLinear::submit_backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                                   MutableMatrixView* dx, const ProductOptions& options) const {
  hand_in_backward(false, engine, x, dy, dx, options);
}

void SparseLinear::accumulate_backward(Engine& engine, ConstMatrixView x, ConstMatrixView dy,
                                       MutableMatrixView* dx, const ProductOptions& options) const {
  hand_in_backward(true, engine, x, dy, dx, options);
}

StepReport SparseLinear::step() {
  return memory_->commit_step();
}

void SparseLinear::discard_gradient() {
  memory_->discard_gradient(layer_);
}

}  // namespace sluice
