// The LayerStreamingExecutor: forward and backward of a sparse MLP over a Fabric, with
// weights streamed out of ModelMemory layer by layer and gradients streamed back.
#include "sluice/executor.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "engine_worker.hpp"
#include "gradient_top_k.hpp"
#include "parallel.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

double gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x)));
}
double gelu_slope(double x) {
  const double th = std::tanh(kGeluC * (x + kGeluA * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kGeluC * (1.0 + 3.0 * kGeluA * x * x);
}

// Row by row, with the activation chosen outside the loops so each one vectorises (a
// switch per element made the executor's own passes a visible part of a wide layer's
// training step).

/// out = act(z + bias) over a row of n tokens; z gets the bias added in place.
void add_bias_and_activate(Activation a, float bias, float* z, float* out, std::int64_t n) {
  if (bias != 0.0F) {
    for (std::int64_t t = 0; t < n; ++t) z[t] += bias;
  }
  switch (a) {
    case Activation::relu:  // NaN passes on: a NaN input must not become a finite output
      for (std::int64_t t = 0; t < n; ++t) out[t] = z[t] <= 0 ? 0.0F : z[t];
      return;
    case Activation::gelu:
      for (std::int64_t t = 0; t < n; ++t) out[t] = static_cast<float>(gelu(z[t]));
      return;
    case Activation::none:
      return;
  }
}

/// fn(row) for every row of a rows x cols pass, on every core when it is large enough to
/// pay for waking them (a small layer's whole pass takes microseconds).
template <typename Fn>
void for_each_row(std::int64_t rows, std::int64_t cols, Fn&& fn) {
  constexpr std::int64_t kParallelElements = std::int64_t{1} << 16;
  if (rows * cols < kParallelElements) {
    for (std::int64_t r = 0; r < rows; ++r) fn(r);
  } else {
    detail::parallel_for(std::int64_t{0}, rows, fn);
  }
}

/// d *= act'(z) over a row of n tokens.
void scale_by_slope(Activation a, const float* z, float* d, std::int64_t n) {
  switch (a) {
    case Activation::relu:
      for (std::int64_t t = 0; t < n; ++t) {
        const float slope = z[t] > 0 ? 1.0F : 0.0F;  // (GCC 12 vectorises this form only)
        d[t] = d[t] * slope;
      }
      return;
    case Activation::gelu:
      for (std::int64_t t = 0; t < n; ++t) d[t] *= static_cast<float>(gelu_slope(z[t]));
      return;
    case Activation::none:
      return;
  }
}

std::int64_t padded(std::int64_t cols) {
  return (cols + 15) / 16 * 16;
}

MutableMatrixView rows_of(DenseMatrix& m, std::int64_t rows, std::int64_t cols) {
  return {m.data(), rows, cols, m.stride()};
}

/// Counts what the engines pull from ModelMemory and how long they wait for it.
class MeteredSource final : public StreamSource {
 public:
  explicit MeteredSource(StreamSource& inner) : inner_(&inner) {}
  const StreamHeader& header() const override { return inner_->header(); }
  ChunkPtr next() override {
    const auto t0 = Clock::now();
    ChunkPtr chunk = inner_->next();
    wait_seconds += since(t0);
    if (chunk) {
      packets += chunk->size();
      bytes += chunk->byte_size();
    }
    return chunk;
  }
  double wait_seconds = 0;
  std::uint64_t packets = 0, bytes = 0;

 private:
  StreamSource* inner_;
};

/// Persistent threads for the layers' stream producers, lent to one stream at a time: a
/// thread started and joined per layer, twice per layer and step, costs more than a small
/// layer's product.
using Producers = std::vector<std::unique_ptr<detail::EngineWorker>>;

/// One layer's stream on its way out of ModelMemory: a producer thread fills a bounded
/// channel. The destructor drains what the consumer left (after an error), waits for the
/// producer and gives its thread back.
struct LayerStream {
  LayerStream(const ModelMemory& memory, std::int32_t layer, StreamKind kind, std::size_t depth,
              std::size_t chunk_packets, Precision precision, StreamOrder order, Producers& idle)
      : channel(depth),
        source(memory.stream_header(layer, kind, precision, order), channel),
        metered(source),
        idle_(idle) {
    if (idle_.empty()) {
      idle_.reserve(idle_.capacity() + 1);  // room to give it back: the destructor cannot throw
      producer_ = std::make_unique<detail::EngineWorker>();
    } else {
      producer_ = std::move(idle_.back());
      idle_.pop_back();
    }
    produced_ = producer_->post([&memory, this, layer, kind, chunk_packets, precision, order] {
      memory.stream_to(layer, kind, channel, chunk_packets, precision, order);
    });
  }
  LayerStream(const LayerStream&) = delete;
  LayerStream& operator=(const LayerStream&) = delete;
  ~LayerStream() {
    try {
      while (channel.pop() != nullptr) {
      }
    } catch (...) {  // the producer's error was seen (or not needed) by the consumer
    }
    produced_.wait();
    idle_.push_back(std::move(producer_));
  }
  StreamChannel channel;
  ChannelStreamSource source;
  MeteredSource metered;

 private:
  Producers& idle_;
  std::unique_ptr<detail::EngineWorker> producer_;
  std::future<void> produced_;
};

}  // namespace

const char* to_string(Activation activation) {
  switch (activation) {
    case Activation::none:
      return "none";
    case Activation::relu:
      return "relu";
    case Activation::gelu:
      return "gelu";
  }
  return "?";
}

StepMetrics& StepMetrics::operator+=(const StepMetrics& o) {
  wall_seconds += o.wall_seconds;
  engine_busy_seconds += o.engine_busy_seconds;
  engine_thread_seconds += o.engine_thread_seconds;
  stream_wait_seconds += o.stream_wait_seconds;
  optimizer_seconds += o.optimizer_seconds;
  stream_packets += o.stream_packets;
  stream_bytes += o.stream_bytes;
  tokens += o.tokens;
  mask_updates += o.mask_updates;
  mask_update_seconds += o.mask_update_seconds;
  mask_score_seconds += o.mask_score_seconds;
  return *this;
}

struct LayerStreamingExecutor::Impl {
  ModelMemory& memory;
  Fabric& fabric;
  ExecutorOptions options;
  std::vector<std::int64_t> sizes;  // sizes[0] inputs, sizes[l+1] outputs of layer l
  std::int32_t engines = 1;

  struct EngineState {
    std::int64_t begin = 0, tokens = 0;
    std::vector<DenseMatrix> z, a;  // a[l] empty when layer l has no activation (A = Z)
    DenseMatrix grad, grad_next;    // dZ of the current layer, dX into the layer below
    ConstMatrixView input;
    ConstMatrixView out(std::size_t l) const { return a[l].rows() > 0 ? a[l].view() : z[l].view(); }
    ConstMatrixView in(std::size_t l) const { return l == 0 ? input : out(l - 1); }
  };
  std::vector<EngineState> state;
  std::int64_t allocated_tokens = -1;
  bool allocated_training = false;
  std::map<std::pair<std::int32_t, std::int32_t>, Placement> placements;
  std::uint64_t mask_generation = 0;  // ModelMemory's, when `placements` were copied
  // RigL: on an update step, each layer's growth (positions, increasing) for that step.
  std::vector<std::vector<std::int64_t>>* growth = nullptr;
  std::int64_t growth_step = 0;
  StepMetrics metrics;  // of the current call
  Producers producers;  // idle stream producers (a stream and its prefetched successor)
  // Hands each layer's reduced gradient to its sink while the engines go on (made on the
  // first backward; a persistent thread for the reason Producers gives).
  std::unique_ptr<detail::EngineWorker> submitter;

  Impl(ModelMemory& m, Fabric& f, ExecutorOptions o)
      : memory(m), fabric(f), options(std::move(o)) {}

  std::int32_t layers() const { return static_cast<std::int32_t>(sizes.size()) - 1; }

  std::int64_t bytes_for(std::int64_t tokens, bool training) const {
    std::int64_t total = 0;
    for (std::int32_t k = 0; k < engines; ++k) {
      const std::int64_t t = (k + 1) * tokens / engines - k * tokens / engines;
      const std::int64_t stride = padded(t);
      std::int64_t widest = 0;
      for (std::int32_t l = 0; l < layers(); ++l) {
        const std::int64_t rows = sizes[static_cast<std::size_t>(l) + 1];
        const bool has_a = options.activations[static_cast<std::size_t>(l)] != Activation::none;
        total += rows * stride * (has_a ? 2 : 1);
        widest = std::max(widest, rows);
      }
      if (training) total += 2 * widest * stride;
    }
    return total * static_cast<std::int64_t>(sizeof(float));
  }

  /// The layers' shapes were read once, when the executor was built; a ModelMemory that
  /// gained a layer or loaded another model since would be run with the old plan.
  void check_model_unchanged() const {
    bool same = memory.layer_count() == layers();
    for (std::int32_t l = 0; same && l < layers(); ++l) {
      const LayerShape w = memory.layer_shape(l);
      same = w.cols == sizes[static_cast<std::size_t>(l)] &&
             w.rows == sizes[static_cast<std::size_t>(l) + 1];
    }
    if (!same) {
      throw ShapeError(
          "executor: the ModelMemory's layers changed since this executor was "
          "built for " +
          std::to_string(layers()) + " layers; build a new executor");
    }
  }

  void prepare(ConstMatrixView features, bool training) {
    check_model_unchanged();
    if (features.rows != sizes.front()) {
      throw ShapeError("executor: the model takes " + std::to_string(sizes.front()) +
                       " features but the batch has " + std::to_string(features.rows));
    }
    const std::int64_t tokens = features.cols;
    if (tokens < engines) {
      throw ShapeError("executor: a batch of " + std::to_string(tokens) +
                       " tokens cannot be split over " + std::to_string(engines) + " engines");
    }
    if (tokens != allocated_tokens || (training && !allocated_training)) {
      const std::int64_t need = bytes_for(tokens, training);
      if (options.memory_budget_bytes > 0 && need > options.memory_budget_bytes) {
        throw ResourceError("executor: activations for a batch of " + std::to_string(tokens) +
                            " tokens on " + std::to_string(engines) + " engines need " +
                            std::to_string(need) + " bytes, over the memory budget of " +
                            std::to_string(options.memory_budget_bytes) +
                            " bytes; use a smaller batch or raise the budget");
      }
      state.clear();
      state.resize(static_cast<std::size_t>(engines));
      for (std::int32_t k = 0; k < engines; ++k) {
        auto& s = state[static_cast<std::size_t>(k)];
        s.begin = k * tokens / engines;
        s.tokens = (k + 1) * tokens / engines - s.begin;
        std::int64_t widest = 0;
        for (std::int32_t l = 0; l < layers(); ++l) {
          const std::int64_t rows = sizes[static_cast<std::size_t>(l) + 1];
          s.z.emplace_back(rows, s.tokens);
          const bool has_a = options.activations[static_cast<std::size_t>(l)] != Activation::none;
          s.a.emplace_back(has_a ? DenseMatrix(rows, s.tokens) : DenseMatrix());
          widest = std::max(widest, rows);
        }
        if (training) {
          s.grad = DenseMatrix(widest, s.tokens);
          s.grad_next = DenseMatrix(widest, s.tokens);
        }
      }
      allocated_tokens = tokens;
      allocated_training = training;
    }
    for (auto& s : state) {
      s.input = {features.data + s.begin, features.rows, s.tokens, features.stride};
    }
    if (memory.mask_generation() != mask_generation) {  // copies of old masks' placements
      placements.clear();
      mask_generation = memory.mask_generation();
    }
  }

  const Placement* placement(std::int32_t layer, std::int32_t k) {
    const auto& s = state[static_cast<std::size_t>(k)];
    const Geometry g = fabric.engine(k).geometry_for(
        sizes[static_cast<std::size_t>(layer) + 1], sizes[static_cast<std::size_t>(layer)],
        s.tokens, options.precisions[static_cast<std::size_t>(layer)]);
    const std::int32_t lanes = std::max(1, g.lanes);
    auto key = std::make_pair(layer, lanes);
    auto it = placements.find(key);
    if (it == placements.end()) it = placements.emplace(key, memory.placement(layer, lanes)).first;
    return &it->second;
  }

  std::unique_ptr<LayerStream> open(std::int32_t layer, StreamKind kind,
                                    StreamOrder order = StreamOrder::by_output) {
    return std::make_unique<LayerStream>(
        memory, layer, kind, options.prefetch_depth, options.chunk_packets,
        options.precisions[static_cast<std::size_t>(layer)], order, producers);
  }

  // A layer's backward stream. The first layer's dX is not wanted: its mask alone, by
  // output. The others by input, where the engines gather dY once for both gradients
  // instead of scattering into dX and then passing over the stream again for dW, unless
  // the layer cannot be streamed so (bf16 tags hold 65535 outputs at most; transposed
  // positions are 32-bit).
  std::unique_ptr<LayerStream> open_backward(std::int32_t layer) {
    if (layer == 0) return open(layer, StreamKind::mask);
    const LayerShape w = memory.layer_shape(layer);
    const bool by_input =
        static_cast<std::uint64_t>(w.nnz) <= std::numeric_limits<std::uint32_t>::max() &&
        (options.precisions[static_cast<std::size_t>(layer)] == Precision::fp32 ||
         w.rows <= static_cast<std::int64_t>(kMaxBf16Inputs));
    return open(layer, StreamKind::weights,
                by_input ? StreamOrder::by_input : StreamOrder::by_output);
  }

  void account(const LayerStream& s) {
    metrics.stream_wait_seconds += s.metered.wait_seconds;
    metrics.stream_packets += s.metered.packets;
    metrics.stream_bytes += s.metered.bytes;
  }

  void forward() {
    std::unique_ptr<LayerStream> next = open(0, StreamKind::weights);
    for (std::int32_t l = 0; l < layers(); ++l) {
      std::unique_ptr<LayerStream> current = std::move(next);
      if (l + 1 < layers()) next = open(l + 1, StreamKind::weights);  // prefetch
      std::vector<const Placement*> ps;
      std::vector<ConstMatrixView> xs;
      std::vector<MutableMatrixView> ys;
      const auto li = static_cast<std::size_t>(l);
      for (std::int32_t k = 0; k < engines; ++k) {
        auto& s = state[static_cast<std::size_t>(k)];
        ps.push_back(placement(l, k));
        xs.push_back(s.in(li));
        ys.push_back(s.z[li].view());
      }
      fabric.forward(current->metered, ps, xs, ys);
      account(*current);
      const std::vector<float>& bias = memory.bias(l);
      const Activation act = options.activations[li];
      for (auto& s : state) {
        DenseMatrix& z = s.z[li];
        for_each_row(z.rows(), z.cols(), [&](std::int64_t o) {
          const float b = bias.empty() ? 0.0F : bias[static_cast<std::size_t>(o)];
          float* out = act != Activation::none ? s.a[li].row(o) : nullptr;
          add_bias_and_activate(act, b, z.row(o), out, z.cols());
        });
      }
    }
  }

  // Loss of engine k's tokens (summed, not averaged), dA of the output into grad, scaled
  // by 1 / total tokens; counts correct argmax predictions.
  double loss_and_delta(const Batch& batch, std::int64_t total_tokens, bool want_delta,
                        std::int64_t* correct) {
    const std::int64_t outputs = sizes.back();
    const auto last = static_cast<std::size_t>(layers() - 1);
    double loss = 0;
    const double scale = 1.0 / static_cast<double>(total_tokens);
    for (auto& s : state) {
      const ConstMatrixView y = s.out(last);
      MutableMatrixView d{};
      if (want_delta) d = rows_of(s.grad, outputs, s.tokens);
      for (std::int64_t t = 0; t < s.tokens; ++t) {
        const std::int64_t token = s.begin + t;
        if (options.loss == Loss::softmax_cross_entropy) {
          const int label = batch.labels[static_cast<std::size_t>(token)];
          double peak = y(0, t);
          std::int64_t best = 0;
          for (std::int64_t o = 1; o < outputs; ++o) {
            if (y(o, t) > peak) {
              peak = y(o, t);
              best = o;
            }
          }
          if (correct != nullptr && best == label) ++*correct;
          double sum = 0;
          for (std::int64_t o = 0; o < outputs; ++o) sum += std::exp(y(o, t) - peak);
          const double log_sum = std::log(sum) + peak;
          loss += log_sum - y(label, t);
          if (want_delta) {
            for (std::int64_t o = 0; o < outputs; ++o) {
              const double p = std::exp(y(o, t) - log_sum);
              d(o, t) = static_cast<float>((p - (o == label ? 1.0 : 0.0)) * scale);
            }
          }
        } else {
          const ConstMatrixView& target = *batch.targets;
          for (std::int64_t o = 0; o < outputs; ++o) {
            const double diff = static_cast<double>(y(o, t)) - target(o, token);
            loss += 0.5 * diff * diff;
            if (want_delta) d(o, t) = static_cast<float>(diff * scale);
          }
        }
      }
    }
    return loss;
  }

  void check_batch(const Batch& batch) {
    const std::int64_t tokens = batch.features.cols;
    if (options.loss == Loss::softmax_cross_entropy) {
      if (static_cast<std::int64_t>(batch.labels.size()) != tokens) {
        throw ShapeError("executor: " + std::to_string(batch.labels.size()) + " labels for " +
                         std::to_string(tokens) + " tokens");
      }
      for (std::size_t t = 0; t < batch.labels.size(); ++t) {
        if (batch.labels[t] < 0 || batch.labels[t] >= sizes.back()) {
          throw ShapeError("executor: label " + std::to_string(batch.labels[t]) + " of token " +
                           std::to_string(t) + " is not in [0, " + std::to_string(sizes.back()) +
                           ")");
        }
      }
    } else if (!batch.targets || batch.targets->rows != sizes.back() ||
               batch.targets->cols != tokens) {
      throw ShapeError("executor: MSE needs targets of " + std::to_string(sizes.back()) + "x" +
                       std::to_string(tokens));
    }
  }

  // RigL's growth for layer l: the inactive positions with the largest |dY X^T| over
  // every engine's tokens, the dense gradient never held (see gradient_top_k.hpp).
  void score_growth(std::int32_t l, std::span<const ConstMatrixView> xs,
                    std::span<const ConstMatrixView> dys) {
    const auto t0 = Clock::now();
    const CsrMatrix& w = memory.weights(l);
    const std::int64_t k = options.dynamic.swap_count(growth_step, w.nnz(), w.rows() * w.cols());
    (*growth)[static_cast<std::size_t>(l)] = detail::dense_gradient_top_k(w, xs, dys, k);
    const double seconds = since(t0);
    metrics.mask_update_seconds += seconds;
    metrics.mask_score_seconds += seconds;
  }

  // After update step `step`'s commit: every layer drops its smallest weights and grows
  // as many (SET: seeded random positions; RigL: `growth`).
  void update_masks(std::int64_t step, const std::vector<std::vector<std::int64_t>>& grown) {
    const auto t0 = Clock::now();
    const DynamicSparsity& d = options.dynamic;
    for (std::int32_t l = 0; l < layers(); ++l) {
      const CsrMatrix& w = memory.weights(l);
      if (d.rule == MaskUpdateRule::rigl) {
        memory.regrow(l, grown[static_cast<std::size_t>(l)]);
      } else {
        const std::int64_t k = d.swap_count(step, w.nnz(), w.rows() * w.cols());
        memory.regrow(l, random_inactive_positions(w, k, mask_update_seed(d.seed, step, l)));
      }
    }
    metrics.mask_updates += 1;
    metrics.mask_update_seconds += since(t0);
  }

  using Sink = std::function<void(std::int32_t layer, ReducedGradient&& gradient)>;

  // Forward, loss, backward; each layer's reduced gradient goes to `sink` on a task of
  // its own while the engines go on with the layer below. Returns the mean loss.
  double forward_backward(const Batch& batch, const Sink& sink, std::int64_t* correct) {
    check_batch(batch);
    prepare(batch.features, true);
    forward();
    const std::int64_t total = batch.features.cols;
    const double loss = loss_and_delta(batch, total, true, correct) / static_cast<double>(total);

    std::vector<std::future<void>> submits;
    auto finish = [&] {
      for (auto& f : submits) {
        if (f.valid()) f.wait();
      }
      for (auto& f : submits) f.get();
    };
    try {
      std::unique_ptr<LayerStream> next = open_backward(layers() - 1);
      for (std::int32_t l = layers() - 1; l >= 0; --l) {
        const auto li = static_cast<std::size_t>(l);
        // dZ = dA * act'(Z), in place in grad.
        for (auto& s : state) {
          const Activation act = options.activations[li];
          if (act == Activation::none) continue;
          MutableMatrixView d = rows_of(s.grad, sizes[li + 1], s.tokens);
          for_each_row(d.rows, d.cols, [&](std::int64_t o) {
            scale_by_slope(act, s.z[li].row(o), d.row(o), d.cols);
          });
        }
        std::unique_ptr<LayerStream> current = std::move(next);
        if (l > 0) next = open_backward(l - 1);
        std::vector<const Placement*> ps;
        std::vector<ConstMatrixView> xs, dys;
        std::vector<MutableMatrixView> dx_views(static_cast<std::size_t>(engines));
        std::vector<MutableMatrixView*> dxs;
        for (std::int32_t k = 0; k < engines; ++k) {
          auto& s = state[static_cast<std::size_t>(k)];
          ps.push_back(placement(l, k));
          xs.push_back(s.in(li));
          dys.push_back(rows_of(s.grad, sizes[li + 1], s.tokens));
          if (l > 0) {
            dx_views[static_cast<std::size_t>(k)] = rows_of(s.grad_next, sizes[li], s.tokens);
            dxs.push_back(&dx_views[static_cast<std::size_t>(k)]);
          }
        }
        const bool with_bias = !memory.bias(l).empty();
        ReducedGradient g = fabric.backward(current->metered, ps, xs, dys, dxs, with_bias);
        account(*current);
        if (growth != nullptr) score_growth(l, xs, dys);
        if (!submitter) submitter = std::make_unique<detail::EngineWorker>();
        submits.push_back(submitter->post(
            [&sink, l, gradient = std::move(g)]() mutable { sink(l, std::move(gradient)); }));
        for (auto& s : state) std::swap(s.grad, s.grad_next);
      }
    } catch (...) {
      for (auto& f : submits) {
        if (f.valid()) f.wait();
      }
      throw;
    }
    finish();
    return loss;
  }
};

LayerStreamingExecutor::LayerStreamingExecutor(ModelMemory& memory, Fabric& fabric,
                                               ExecutorOptions options)
    : impl_(std::make_unique<Impl>(memory, fabric, std::move(options))) {
  Impl& m = *impl_;
  const std::int32_t layers = memory.layer_count();
  try {
    m.sizes = mlp_sizes(memory);
  } catch (const ShapeError& e) {
    throw ShapeError(std::string("executor: ") + e.what());
  }
  if (m.options.activations.empty()) {
    m.options.activations.assign(static_cast<std::size_t>(layers), Activation::relu);
    m.options.activations.back() = Activation::none;
  }
  if (static_cast<std::int32_t>(m.options.activations.size()) != layers) {
    throw ShapeError("executor: " + std::to_string(m.options.activations.size()) +
                     " activations for " + std::to_string(layers) + " layers");
  }
  for (const Activation a : m.options.activations) {
    if (a != Activation::none && a != Activation::relu && a != Activation::gelu) {
      throw ShapeError("executor: unknown activation " + std::to_string(static_cast<int>(a)));
    }
  }
  if (m.options.loss != Loss::softmax_cross_entropy && m.options.loss != Loss::mse) {
    throw ShapeError("executor: unknown loss " + std::to_string(static_cast<int>(m.options.loss)));
  }
  if (m.options.precisions.empty()) {
    m.options.precisions.assign(static_cast<std::size_t>(layers), Precision::fp32);
  }
  if (static_cast<std::int32_t>(m.options.precisions.size()) != layers) {
    throw ShapeError("executor: " + std::to_string(m.options.precisions.size()) +
                     " precisions for " + std::to_string(layers) + " layers");
  }
  for (std::int32_t l = 0; l < layers; ++l) {
    try {
      const LayerShape w = memory.layer_shape(l);
      stream_header_for(w.rows, w.cols, w.nnz, StreamKind::weights,
                        m.options.precisions[static_cast<std::size_t>(l)]);
    } catch (const ShapeError& e) {
      throw ShapeError("executor: layer " + std::to_string(l) + ": " + e.what());
    }
  }
  if (m.options.prefetch_depth < 1) throw ShapeError("executor: prefetch depth must be >= 1");
  if (m.options.chunk_packets < 1) throw ShapeError("executor: chunk_packets must be >= 1");
  if (m.options.memory_budget_bytes < 0) throw ShapeError("executor: negative memory budget");
  m.options.dynamic.validate();
  m.engines = fabric.engine_count();
}

LayerStreamingExecutor::~LayerStreamingExecutor() = default;

std::int32_t LayerStreamingExecutor::layer_count() const {
  return impl_->layers();
}
std::int64_t LayerStreamingExecutor::input_features() const {
  return impl_->sizes.front();
}
std::int64_t LayerStreamingExecutor::output_features() const {
  return impl_->sizes.back();
}

std::int64_t LayerStreamingExecutor::activation_bytes(std::int64_t tokens, bool training) const {
  return impl_->bytes_for(tokens, training);
}

StepResult LayerStreamingExecutor::train_step(const Batch& batch) {
  Impl& m = *impl_;
  m.metrics = {};
  std::vector<EngineCounters> before;
  double threads = 0;
  for (std::int32_t k = 0; k < m.engines; ++k) {
    before.push_back(m.fabric.engine(k).counters());
    threads += m.fabric.engine(k).threads();
  }
  const auto t0 = Clock::now();
  std::int64_t correct = 0;
  StepResult r;
  // A mask update after this step: RigL scores the layers during its backward pass.
  const std::int64_t step = m.memory.step() + 1;
  const bool mask_step = m.options.dynamic.is_update_step(step);
  std::vector<std::vector<std::int64_t>> growth(static_cast<std::size_t>(m.layers()));
  if (mask_step && m.options.dynamic.rule == MaskUpdateRule::rigl) {
    m.growth = &growth;
    m.growth_step = step;
  }
  struct NoGrowth {  // the pointer never outlives this call
    Impl& m;
    ~NoGrowth() { m.growth = nullptr; }
  } no_growth{m};
  try {
    r.loss = m.forward_backward(
        batch,
        [&](std::int32_t layer, ReducedGradient&& g) {
          m.memory.submit_gradient(layer, g.weights, g.bias);
        },
        &correct);
  } catch (...) {
    // Layers submitted before the failure would otherwise wait for a commit, and the
    // next step would find them there (and could only commit a mix of two steps).
    m.memory.discard_step();
    throw;
  }
  r.report = m.memory.commit_step();
  if (mask_step && r.report.applied && r.report.step == step) m.update_masks(step, growth);
  StepMetrics& mt = m.metrics;
  mt.wall_seconds = since(t0);
  for (std::int32_t k = 0; k < m.engines; ++k) {
    mt.engine_busy_seconds += m.fabric.engine(k).counters().busy_seconds -
                              before[static_cast<std::size_t>(k)].busy_seconds;
  }
  mt.engine_thread_seconds = mt.wall_seconds * threads;
  mt.optimizer_seconds = r.report.seconds;
  mt.tokens = batch.features.cols;
  r.accuracy = static_cast<double>(correct) / static_cast<double>(batch.features.cols);
  r.metrics = mt;
  totals_ += mt;
  return r;
}

std::vector<LayerGradient> LayerStreamingExecutor::gradients(const Batch& batch, double* loss) {
  Impl& m = *impl_;
  m.metrics = {};
  std::vector<LayerGradient> out(static_cast<std::size_t>(m.layers()));
  const double l = m.forward_backward(
      batch,
      [&](std::int32_t layer, ReducedGradient&& g) {
        auto& slot = out[static_cast<std::size_t>(layer)];
        g.weights.header.kind = StreamKind::weights;  // decode wants values, not a gradient tag
        slot.weights = decode_stream(g.weights);
        slot.bias = std::move(g.bias);
      },
      nullptr);
  if (loss != nullptr) *loss = l;
  return out;
}

DenseMatrix LayerStreamingExecutor::infer(ConstMatrixView features) {
  Impl& m = *impl_;
  m.metrics = {};
  m.prepare(features, false);
  m.forward();
  DenseMatrix y(m.sizes.back(), features.cols);
  const auto last = static_cast<std::size_t>(m.layers() - 1);
  for (const auto& s : m.state) {
    const ConstMatrixView out = s.out(last);
    for (std::int64_t o = 0; o < out.rows; ++o) {
      std::copy(out.row(o), out.row(o) + out.cols, y.row(o) + s.begin);
    }
  }
  return y;
}

Evaluation LayerStreamingExecutor::evaluate(const Batch& data, std::int64_t batch_tokens) {
  Impl& m = *impl_;
  m.check_batch(data);
  if (batch_tokens < 1) {
    throw ShapeError("evaluate: batch_tokens must be at least 1, got " +
                     std::to_string(batch_tokens));
  }
  const std::int64_t total = data.features.cols;
  batch_tokens = std::max<std::int64_t>(batch_tokens, m.engines);
  Evaluation e;
  double loss = 0;
  std::int64_t correct = 0;
  for (std::int64_t begin = 0; begin < total;) {
    std::int64_t end = std::min(total, begin + batch_tokens);
    const std::int64_t rest = total - end;
    if (rest > 0 && rest < m.engines) {
      // A remainder too small to give every engine a token: the last two batches share
      // what is left evenly, so neither exceeds batch_tokens (nor the memory budget that
      // allows it); only where that cannot give both a token an engine does it join this one.
      const std::int64_t left = total - begin;
      end = left >= 2 * m.engines ? begin + (left + 1) / 2 : total;
    }
    Batch part;
    part.features = {data.features.data + begin, data.features.rows, end - begin,
                     data.features.stride};
    if (m.options.loss == Loss::softmax_cross_entropy) {
      part.labels.assign(data.labels.begin() + begin, data.labels.begin() + end);
    } else {
      const ConstMatrixView& t = *data.targets;
      part.targets = ConstMatrixView{t.data + begin, t.rows, end - begin, t.stride};
    }
    m.prepare(part.features, m.allocated_training);
    m.forward();
    loss += m.loss_and_delta(part, end - begin, false, &correct);
    begin = end;
  }
  e.tokens = total;
  e.loss = total > 0 ? loss / static_cast<double>(total) : 0;
  e.accuracy = total > 0 ? static_cast<double>(correct) / static_cast<double>(total) : 0;
  return e;
}

std::vector<std::int64_t> mlp_sizes(const ModelMemory& memory) {
  const std::int32_t layers = memory.layer_count();
  if (layers < 1) throw ShapeError("the ModelMemory holds no layers");
  std::vector<std::int64_t> sizes{memory.layer_shape(0).cols};
  for (std::int32_t l = 0; l < layers; ++l) {
    const LayerShape w = memory.layer_shape(l);
    if (w.cols != sizes.back()) {
      throw ShapeError("layer " + std::to_string(l) + " takes " + std::to_string(w.cols) +
                       " inputs but the layer below gives " + std::to_string(sizes.back()));
    }
    sizes.push_back(w.rows);
  }
  return sizes;
}

void build_sparse_mlp(ModelMemory& memory, const std::vector<std::int64_t>& sizes, double sparsity,
                      std::uint64_t seed) {
  if (sizes.size() < 2) throw ShapeError("build_sparse_mlp: needs at least two sizes");
  for (std::size_t l = 0; l < sizes.size(); ++l) {
    // A layer of width 0 would pass nothing on: the net's output would not depend on X.
    if (sizes[l] < 1) {
      throw ShapeError("build_sparse_mlp: size " + std::to_string(l) + " is " +
                       std::to_string(sizes[l]) + "; every layer needs at least one feature");
    }
  }
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    CsrMatrix w = CsrMatrix::random(sizes[l + 1], sizes[l], sparsity, seed + 7919 * (l + 1));
    const double fan_in = std::max(1.0, (1.0 - sparsity) * static_cast<double>(sizes[l]));
    w.fill_values(seed + 104729 * (l + 1), static_cast<float>(std::sqrt(6.0 / fan_in)));
    memory.add_layer(std::move(w),
                     std::vector<float>(static_cast<std::size_t>(sizes[l + 1]), 0.0F));
  }
}

}  // namespace sluice
