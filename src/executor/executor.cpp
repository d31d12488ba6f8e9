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

#include "core/background_work.hpp"
#include "engine/clock.hpp"
#include "executor/layer_stream.hpp"
#include "executor/ram_beside_memory.hpp"
#include "model_memory/mask_update.hpp"
#include "sluice/error.hpp"
#include "sluice/stream_codec.hpp"

namespace sluice {
namespace {

using detail::Clock;
using detail::LayerStream;
using detail::Producers;
using detail::seconds_since;
using detail::StreamQueue;

}  // namespace

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
  steps += o.steps;
  driver_bytes_sent += o.driver_bytes_sent;
  driver_bytes_received += o.driver_bytes_received;
  stream_arrival_seconds += o.stream_arrival_seconds;
  overlapped_seconds += o.overlapped_seconds;
  pass_seconds += o.pass_seconds;
  return *this;
}

struct LayerStreamingExecutor::Impl {
  ModelMemory& memory;
  Fabric& fabric;
  ExecutorOptions options;
  std::vector<std::int64_t> sizes;  // sizes[0] inputs, sizes[l+1] outputs of layer l
  std::int32_t engines = 1;
  std::int64_t tokens = 0;  // of the batch the engines hold
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

  PassSpec spec(bool training) const {
    return {sizes, options.activations, options.loss, training};
  }

  std::int64_t bytes_for(std::int64_t batch_tokens, bool training) const {
    std::int64_t total = 0;
    const PassSpec s = spec(training);
    for (std::int32_t k = 0; k < engines; ++k) {
      total += ActivationStore::bytes_for(s, Fabric::shard_of(k, engines, batch_tokens).count);
    }
    return total;
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
      throw ArgumentError(
          "executor: the ModelMemory's layers changed since this executor was "
          "built for " +
          std::to_string(layers()) + " layers; build a new executor");
    }
  }

  void check_budget(std::int64_t n, bool training) const {
    const std::int64_t need = bytes_for(n, training);
    if (options.memory_budget_bytes > 0 && need > options.memory_budget_bytes) {
      throw ResourceError("executor: activations for a batch of " + std::to_string(n) +
                          " tokens on " + std::to_string(engines) + " engines need " +
                          std::to_string(need) + " bytes, over the memory budget of " +
                          std::to_string(options.memory_budget_bytes) +
                          " bytes; use a smaller batch or raise the budget");
    }
  }

  // The placements copied for masks that changed since (dynamic sparsity) are dropped.
  void refresh_placements() {
    if (memory.mask_generation() != mask_generation) {
      placements.clear();
      mask_generation = memory.mask_generation();
    }
  }

  // Checks the batch against the model and the memory budget, then every engine loads
  // its shard into its store: the batch's only trip across the fabric.
  void load(const Batch& batch, bool training, bool with_answers) {
    check_model_unchanged();
    const ConstMatrixView& features = batch.features;
    if (features.rows != sizes.front()) {
      throw ShapeError("executor: the model takes " + std::to_string(sizes.front()) +
                       " features but the batch has " + std::to_string(features.rows));
    }
    const std::int64_t n = features.cols;
    if (n < engines) {
      throw ShapeError("executor: a batch of " + std::to_string(n) +
                       " tokens cannot be split over " + std::to_string(engines) + " engines");
    }
    check_budget(n, training);
    ShardData data;
    data.features = features;
    if (with_answers) {
      if (options.loss == Loss::softmax_cross_entropy) {
        data.labels = batch.labels;
      } else {
        data.targets = batch.targets;
      }
    }
    fabric.load_batch(spec(training), data);
    tokens = n;
    refresh_placements();
  }

  const Placement* placement(std::int32_t layer, std::int32_t k) {
    const Geometry g = fabric.engine(k).geometry_for(
        sizes[static_cast<std::size_t>(layer) + 1], sizes[static_cast<std::size_t>(layer)],
        Fabric::shard_of(k, engines, tokens).count,
        options.precisions[static_cast<std::size_t>(layer)]);
    const std::int32_t lanes = std::max(1, g.lanes);
    auto key = std::make_pair(layer, lanes);
    auto it = placements.find(key);
    if (it == placements.end()) it = placements.emplace(key, memory.placement(layer, lanes)).first;
    return &it->second;
  }

  std::vector<const Placement*> placements_of(std::int32_t layer) {
    std::vector<const Placement*> ps;
    for (std::int32_t k = 0; k < engines; ++k) ps.push_back(placement(layer, k));
    return ps;
  }

  std::size_t channel_chunks(std::int32_t layer) const {
    return detail::channel_chunks_of(memory.layer_shape(layer),
                                     options.precisions[static_cast<std::size_t>(layer)], options,
                                     memory.ram_budget_bytes());
  }

  std::unique_ptr<LayerStream> open(std::int32_t layer, StreamKind kind,
                                    StreamOrder order = StreamOrder::by_output) {
    return std::make_unique<LayerStream>(
        memory, layer, kind, channel_chunks(layer), options.chunk_packets,
        options.precisions[static_cast<std::size_t>(layer)], order, producers);
  }

  // The order of a layer's backward stream (see ExecutorOptions::backward_order). By
  // input, where the layer can: bf16 tags hold 65535 outputs at most, transposed
  // positions are 32-bit.
  StreamOrder backward_order(std::int32_t layer) const {
    if (layer == 0) return StreamOrder::by_output;
    const StreamOrder wanted = options.backward_order.value_or(
        memory.by_input_from_ram() ? StreamOrder::by_input : StreamOrder::by_output);
    const LayerShape w = memory.layer_shape(layer);
    const Precision precision = options.precisions[static_cast<std::size_t>(layer)];
    return streams_by_input(w.rows, w.nnz, precision) ? wanted : StreamOrder::by_output;
  }

  // A layer's backward stream. The first layer's dX is not wanted: its mask alone, by
  // output. The others in backward_order.
  std::unique_ptr<LayerStream> open_backward(std::int32_t layer) {
    if (layer == 0) return open(layer, StreamKind::mask);
    return open(layer, StreamKind::weights, backward_order(layer));
  }

  // What the step holds beside a bounded ModelMemory, reserved out of its budget; a budget
  // without room for it is refused, naming the least that has.
  void reserve_beside_memory() {
    std::vector<LayerShape> shapes;
    for (std::int32_t l = 0; l < layers(); ++l) shapes.push_back(memory.layer_shape(l));
    const std::int64_t budget = memory.ram_budget_bytes();
    const std::int64_t beside = executor_ram_beside_memory(shapes, options, engines, budget);
    const std::int64_t room = memory.reservable_ram_bytes();
    if (beside > room) {
      const std::int64_t least = executor_least_ram_budget(shapes, options, engines, budget - room);
      throw ResourceError("executor: the ModelMemory's budget of " + std::to_string(budget) +
                          " bytes leaves " + std::to_string(room) +
                          " beside its largest layer's working set, not the " +
                          std::to_string(beside) +
                          " the step holds there (the largest layer's stream and its "
                          "gradients); it needs a budget of at least " +
                          std::to_string(least));
    }
    memory.reserve_ram_bytes(beside);
  }

  void account(const LayerStream& s) {
    metrics.stream_wait_seconds += s.metered.wait_seconds;
    metrics.stream_packets += s.metered.packets;
    metrics.stream_bytes += s.metered.bytes;
  }

  // The streams of a call: every layer's forward stream, then (training) every layer's
  // backward stream, last layer first. Opened a largest layer ahead; over a ModelMemory in
  // bounded RAM one stream ahead, as executor_ram_beside_memory counts.
  StreamQueue streams(bool training) {
    std::vector<std::int64_t> packets;
    for (std::int32_t l = 0; l < layers(); ++l) {
      const LayerShape w = memory.layer_shape(l);
      packets.push_back(w.nnz + w.rows + w.cols);
    }
    if (training) packets.insert(packets.end(), packets.rbegin(), packets.rend());
    const std::int64_t ahead =
        memory.ram_budget_bytes() > 0 ? 0 : *std::max_element(packets.begin(), packets.end());
    const auto n = static_cast<std::size_t>(layers());
    return StreamQueue(std::move(packets), ahead, [this, n](std::size_t i) {
      return i < n ? open(static_cast<std::int32_t>(i), StreamKind::weights)
                   : open_backward(static_cast<std::int32_t>(2 * n - 1 - i));
    });
  }

  void forward(StreamQueue& queue) {
    for (std::int32_t l = 0; l < layers(); ++l) {
      std::unique_ptr<LayerStream> current = queue.take();
      const std::vector<const Placement*> placements = placements_of(l);
      const auto t0 = Clock::now();
      fabric.forward_layer(current->metered, placements, l, memory.bias(l));
      metrics.pass_seconds += seconds_since(t0);
      account(*current);
    }
  }

  void forward() {
    StreamQueue queue = streams(false);
    forward(queue);
  }

  void check_batch(const Batch& batch) {
    const std::int64_t n = batch.features.cols;
    if (options.loss == Loss::softmax_cross_entropy) {
      if (static_cast<std::int64_t>(batch.labels.size()) != n) {
        throw ShapeError("executor: " + std::to_string(batch.labels.size()) + " labels for " +
                         std::to_string(n) + " tokens");
      }
      for (std::size_t t = 0; t < batch.labels.size(); ++t) {
        if (batch.labels[t] < 0 || batch.labels[t] >= sizes.back()) {
          throw ArgumentError("executor: label " + std::to_string(batch.labels[t]) + " of token " +
                              std::to_string(t) + " is not in [0, " + std::to_string(sizes.back()) +
                              ")");
        }
      }
    } else if (!batch.targets || batch.targets->rows != sizes.back() || batch.targets->cols != n) {
      throw ShapeError("executor: MSE needs targets of " + std::to_string(sizes.back()) + "x" +
                       std::to_string(n));
    }
  }

  // RigL's growth for layer l: the inactive positions with the largest |dY X^T| over
  // every engine's tokens, the dense gradient never held (see gradient_top_k.hpp),
  // computed by the fabric where the layer's X and dZ are (over MPI on the engine ranks:
  // only the candidates come back).
  void score_growth(std::int32_t l) {
    const auto t0 = Clock::now();
    CsrMatrix copy;
    const CsrMatrix& w = detail::layer_mask(memory, l, copy);
    const std::int64_t k = options.dynamic.swap_count(growth_step, w.nnz(), w.rows() * w.cols());
    GrowthSource source;
    source.layer = l;
    (*growth)[static_cast<std::size_t>(l)] = fabric.growth_top_k(source, w, k);
    const double seconds = seconds_since(t0);
    metrics.mask_update_seconds += seconds;
    metrics.mask_score_seconds += seconds;
  }

  // After update step `step`'s commit: every layer drops its smallest weights and grows
  // as many (SET: seeded random positions; RigL: `growth`).
  void update_masks(std::int64_t step, const std::vector<std::vector<std::int64_t>>& grown) {
    const auto t0 = Clock::now();
    const DynamicSparsity& d = options.dynamic;
    for (std::int32_t l = 0; l < layers(); ++l) {
      detail::update_layer_mask(memory, d, step, l, grown[static_cast<std::size_t>(l)]);
    }
    metrics.mask_updates += 1;
    metrics.mask_update_seconds += seconds_since(t0);
  }

  using Sink = std::function<void(std::int32_t layer, ReducedGradient&& gradient)>;

  // Forward, loss, backward; each layer's reduced gradient goes to `sink` on a task of
  // its own while the engines go on with the layer below. Returns the loss's sums.
  LossSums forward_backward(const Batch& batch, const Sink& sink) {
    check_batch(batch);
    load(batch, true, true);
    return forward_backward_loaded(sink);
  }

  // Checks samples of the fabric's data set against the model, then every engine takes
  // its shard of them from its own copy of the set.
  void load_samples(std::span<const std::int64_t> samples) {
    check_model_unchanged();
    const Dataset* data = fabric.dataset();
    if (data == nullptr) throw ArgumentError("executor: the fabric has no data set attached");
    if (options.loss != Loss::softmax_cross_entropy) {
      throw ArgumentError("executor: a data set's samples have labels, not MSE targets");
    }
    if (data->features.rows() != sizes.front()) {
      throw ShapeError("executor: the model takes " + std::to_string(sizes.front()) +
                       " features but the data set has " + std::to_string(data->features.rows()));
    }
    const auto n = static_cast<std::int64_t>(samples.size());
    for (const std::int64_t s : samples) {
      if (s >= 0 && s < data->samples()) {
        const int label = data->labels[static_cast<std::size_t>(s)];
        if (label >= 0 && label < sizes.back()) continue;
        throw ArgumentError("executor: label " + std::to_string(label) + " of sample " +
                            std::to_string(s) + " is not in [0, " + std::to_string(sizes.back()) +
                            ")");
      }
    }
    check_budget(std::max<std::int64_t>(n, engines), true);
    fabric.load_samples(spec(true), samples);  // checks the count and the indices
    tokens = n;
    refresh_placements();
  }

  // Forward, loss, backward of the batch the engines hold.
  LossSums forward_backward_loaded(const Sink& sink) {
    StreamQueue queue = streams(true);
    forward(queue);
    const LossSums loss = fabric.loss(true, tokens);

    // A ModelMemory in bounded RAM: each layer's gradient stream (8 bytes per non-zero)
    // waits for the one before it to be submitted, else a submit_gradient slower than the
    // engines (an optimizer on disk) queues every layer's gradient. The wait comes after
    // the layer's backward and before the next stream opens, when no stream of this loop
    // holds a layer in the ModelMemory's cache: the submission can always get its room.
    const bool bounded = memory.ram_budget_bytes() > 0;
    std::vector<std::future<void>> submits;
    try {
      for (std::int32_t l = layers() - 1; l >= 0; --l) {
        std::unique_ptr<LayerStream> current = queue.take(!bounded);
        const bool with_bias = !memory.bias(l).empty();
        const std::vector<const Placement*> placements = placements_of(l);
        const auto t0 = Clock::now();
        ReducedGradient g =
            fabric.backward_layer(current->metered, placements, l, l > 0, with_bias);
        metrics.pass_seconds += seconds_since(t0);
        account(*current);
        current.reset();
        if (growth != nullptr) score_growth(l);
        if (!submitter) submitter = std::make_unique<detail::EngineWorker>();
        if (bounded && !submits.empty()) submits.back().wait();
        // The job's lambda lives in the future's shared state until `submits` goes: the
        // gradient is moved out of it so that it is freed when its submission returns.
        submits.push_back(submitter->post([&sink, l, gradient = std::move(g)]() mutable {
          const detail::BackgroundWork counted;
          ReducedGradient taken = std::move(gradient);
          sink(l, std::move(taken));
        }));
        if (bounded) queue.fill();
      }
    } catch (...) {
      for (auto& f : submits) {
        if (f.valid()) f.wait();
      }
      throw;
    }
    for (auto& f : submits) {
      if (f.valid()) f.wait();
    }
    for (auto& f : submits) f.get();
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
  } catch (const ArgumentError& e) {
    throw ArgumentError(std::string("executor: ") + e.what());
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
      throw ArgumentError("executor: unknown activation " + std::to_string(static_cast<int>(a)));
    }
  }
  if (m.options.loss != Loss::softmax_cross_entropy && m.options.loss != Loss::mse) {
    throw ArgumentError("executor: unknown loss " +
                        std::to_string(static_cast<int>(m.options.loss)));
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
    } catch (const ArgumentError& e) {
      throw ArgumentError("executor: layer " + std::to_string(l) + ": " + e.what());
    } catch (const UnsupportedError& e) {
      throw UnsupportedError("executor: layer " + std::to_string(l) + ": " + e.what());
    }
  }
  if (m.options.prefetch_bytes < 0) throw ArgumentError("executor: negative prefetch budget");
  m.options.dynamic.validate();
  if (m.options.backward_order && *m.options.backward_order != StreamOrder::by_input &&
      *m.options.backward_order != StreamOrder::by_output) {
    throw ArgumentError("executor: unknown backward order " +
                        std::to_string(static_cast<int>(*m.options.backward_order)));
  }
  if (m.options.chunk_packets < 1) throw ArgumentError("executor: chunk_packets must be >= 1");
  if (m.options.memory_budget_bytes < 0) throw ArgumentError("executor: negative memory budget");
  m.engines = fabric.engine_count();
  if (memory.ram_budget_bytes() > 0) m.reserve_beside_memory();
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

StreamOrder LayerStreamingExecutor::backward_order(std::int32_t layer) const {
  if (layer < 0 || layer >= impl_->layers()) {
    throw ArgumentError("backward_order: layer " + std::to_string(layer) + " is not in [0, " +
                        std::to_string(impl_->layers()) + ")");
  }
  return impl_->backward_order(layer);
}

std::int64_t LayerStreamingExecutor::activation_bytes(std::int64_t tokens, bool training) const {
  return impl_->bytes_for(tokens, training);
}

namespace {

/// Engine counters and fabric counters before a call, to take a call's share of them.
struct CounterMark {
  std::vector<EngineCounters> engines;
  FabricCounters fabric;
  double threads = 0;
  explicit CounterMark(Fabric& f) : fabric(f.counters()) {
    for (std::int32_t k = 0; k < f.engine_count(); ++k) {
      engines.push_back(f.engine(k).counters());
      threads += f.engine(k).threads();
    }
  }
  void since(Fabric& f, StepMetrics& mt) const {
    for (std::int32_t k = 0; k < f.engine_count(); ++k) {
      const EngineCounters& now = f.engine(k).counters();
      const EngineCounters& then = engines[static_cast<std::size_t>(k)];
      mt.engine_busy_seconds += now.busy_seconds - then.busy_seconds;
      mt.stream_arrival_seconds += now.stream_arrival_seconds - then.stream_arrival_seconds;
      mt.overlapped_seconds += now.overlapped_seconds - then.overlapped_seconds;
    }
    mt.driver_bytes_sent += f.counters().driver_bytes_sent - fabric.driver_bytes_sent;
    mt.driver_bytes_received += f.counters().driver_bytes_received - fabric.driver_bytes_received;
  }
};

}  // namespace

StepResult LayerStreamingExecutor::train_step(const Batch& batch) {
  return train(batch.features.cols,
               [&](const Impl::Sink& sink) { return impl_->forward_backward(batch, sink); });
}

StepResult LayerStreamingExecutor::train_step_samples(std::span<const std::int64_t> samples) {
  return train(static_cast<std::int64_t>(samples.size()), [&](const Impl::Sink& sink) {
    impl_->load_samples(samples);
    return impl_->forward_backward_loaded(sink);
  });
}

StepResult LayerStreamingExecutor::train(std::int64_t tokens, const StepRunner& run) {
  Impl& m = *impl_;
  m.metrics = {};
  const CounterMark before(m.fabric);
  const auto t0 = Clock::now();
  StepResult r;
  LossSums loss;
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
    loss = run([&](std::int32_t layer, ReducedGradient&& g) {
      m.memory.submit_gradient(layer, g.weights, g.bias);
    });
  } catch (...) {
    // Layers submitted before the failure would otherwise wait for a commit, and the
    // next step would find them there (and could only commit a mix of two steps).
    m.memory.discard_step();
    throw;
  }
  r.report = m.memory.commit_step();
  if (mask_step && r.report.applied && r.report.step == step) m.update_masks(step, growth);
  StepMetrics& mt = m.metrics;
  mt.wall_seconds = seconds_since(t0);
  before.since(m.fabric, mt);
  mt.engine_thread_seconds = mt.wall_seconds * before.threads;
  mt.optimizer_seconds = r.report.seconds;
  mt.tokens = tokens;
  mt.steps = 1;
  const auto n = static_cast<double>(tokens);
  r.loss = loss.loss / n;
  r.accuracy = static_cast<double>(loss.correct) / n;
  r.metrics = mt;
  totals_ += mt;
  return r;
}

std::vector<LayerGradient> LayerStreamingExecutor::gradients(const Batch& batch, double* loss) {
  Impl& m = *impl_;
  m.metrics = {};
  std::vector<LayerGradient> out(static_cast<std::size_t>(m.layers()));
  const LossSums sums = m.forward_backward(batch, [&](std::int32_t layer, ReducedGradient&& g) {
    auto& slot = out[static_cast<std::size_t>(layer)];
    g.weights.header.kind = StreamKind::weights;  // decode wants values, not a gradient tag
    slot.weights = decode_stream(g.weights);
    slot.bias = std::move(g.bias);
  });
  if (loss != nullptr) *loss = sums.loss / static_cast<double>(batch.features.cols);
  return out;
}

DenseMatrix LayerStreamingExecutor::infer(ConstMatrixView features) {
  Impl& m = *impl_;
  m.metrics = {};
  Batch batch;
  batch.features = features;
  m.load(batch, false, false);
  m.forward();
  return m.fabric.gather_output();
}

Evaluation LayerStreamingExecutor::evaluate(const Batch& data, std::int64_t batch_tokens) {
  Impl& m = *impl_;
  m.check_batch(data);
  if (batch_tokens < 1) {
    throw ArgumentError("evaluate: batch_tokens must be at least 1, got " +
                        std::to_string(batch_tokens));
  }
  const std::int64_t total = data.features.cols;
  batch_tokens = std::max<std::int64_t>(batch_tokens, m.engines);
  Evaluation e;
  LossSums sums;
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
    m.load(part, false, true);
    m.forward();
    sums += m.fabric.loss(false, end - begin);
    begin = end;
  }
  e.tokens = total;
  e.loss = total > 0 ? sums.loss / static_cast<double>(total) : 0;
  e.accuracy = total > 0 ? static_cast<double>(sums.correct) / static_cast<double>(total) : 0;
  return e;
}

}  // namespace sluice
