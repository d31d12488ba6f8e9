// GptModel: a GPT's forward and backward over a Fabric, as a sequence of block operations
// (sluice/block_store.hpp) that every engine runs on the whole sequences it holds. The
// projections' weights stream out of ModelMemory to every engine (one broadcast per
// projection and pass), the dense parameters the same way, and the summed gradient streams
// come back to ModelMemory; the driver holds no activations, so the same calls run over
// a LocalFabric and over MPI.
#include <chrono>
#include <map>
#include <string>

#include "gpt/gpt_mask_updates.hpp"
#include "sluice/error.hpp"
#include "sluice/gpt.hpp"
#include "sluice/stream_packets.hpp"

namespace sluice {
namespace {

using Clock = std::chrono::steady_clock;
using Op = BlockOp;

}  // namespace

struct GptModel::Impl {
  using Sink = std::function<void(std::int32_t, WeightStream&&, std::vector<float>&&)>;

  ModelMemory& memory;
  Fabric& fabric;
  GptConfig config;
  GptLayers layers;
  std::int32_t engines = 1;
  Precision projections = Precision::fp32;
  std::vector<std::int64_t> shard_tokens;  // each engine's tokens of the loaded batch
  std::int64_t total_tokens = 0;
  std::map<std::pair<std::int32_t, std::int32_t>, Placement> placements;
  std::uint64_t mask_generation = 0;
  StepMetrics totals;
  StepMetrics metrics;  // of the current call
  detail::GptMaskUpdates mask_updates;

  Impl(ModelMemory& m, Fabric& f, GptConfig c, const DynamicSparsity& dynamic,
       Precision projections)
      : memory(m),
        fabric(f),
        config(c),
        layers(c),
        engines(f.engine_count()),
        projections(projections),
        mask_updates(m, f, layers, dynamic) {
    const GptConfig held = gpt_config_of(memory);
    if (held.describe() != config.describe()) {
      throw ShapeError("GptModel: the ModelMemory holds " + held.describe() + ", not " +
                       config.describe());
    }
    config.sparsity = held.sparsity;
    mask_generation = memory.mask_generation();
  }

  // --- the batch ---------------------------------------------------------------------------

  void load(const TextBatch& batch, bool training) {
    if (batch.context != config.context) {
      throw ShapeError("GptModel: a batch of context " + std::to_string(batch.context) +
                       " for a model of context " + std::to_string(config.context));
    }
    if (batch.sequences < engines) {
      throw ShapeError("GptModel: " + std::to_string(batch.sequences) + " sequences for " +
                       std::to_string(engines) + " engines (each takes whole sequences)");
    }
    const auto expected = static_cast<std::size_t>(batch.sequences * batch.context);
    if (batch.inputs.size() != expected || batch.targets.size() != expected) {
      throw ShapeError("GptModel: the batch holds " + std::to_string(batch.inputs.size()) +
                       " inputs and " + std::to_string(batch.targets.size()) + " targets for " +
                       std::to_string(expected) + " tokens");
    }
    for (const std::int32_t* list : {batch.inputs.data(), batch.targets.data()}) {
      for (std::size_t t = 0; t < expected; ++t) {
        if (list[t] < 0 || list[t] >= config.vocab) {
          throw ArgumentError("GptModel: token " + std::to_string(list[t]) + " at " +
                              std::to_string(t) + " is outside the vocabulary of " +
                              std::to_string(config.vocab));
        }
      }
    }
    total_tokens = static_cast<std::int64_t>(expected);
    shard_tokens.clear();
    for (std::int32_t k = 0; k < engines; ++k) {
      shard_tokens.push_back(Fabric::shard_of(k, engines, batch.sequences).count * config.context);
    }
    const BlockShape shape{config.vocab, config.context, config.d_model,
                           config.heads, config.blocks,  training};
    fabric.load_tokens(shape, batch.inputs, batch.targets);
  }

  // --- streaming ---------------------------------------------------------------------------

  /// The precision `layer` streams in: the projections' where a bf16 stream's tags address
  /// the layer both ways (the forward's inputs, the backward's outputs), else fp32.
  Precision precision_of(std::int32_t layer) const {
    const LayerShape w = memory.layer_shape(layer);
    const auto most = static_cast<std::int64_t>(kMaxBf16Inputs);
    return w.rows <= most && w.cols <= most ? projections : Precision::fp32;
  }

  const Placement* placement(std::int32_t layer, std::int32_t k) {
    if (memory.mask_generation() != mask_generation) {
      placements.clear();
      mask_generation = memory.mask_generation();
    }
    const LayerShape w = memory.layer_shape(layer);
    const Geometry g =
        fabric.engine(k).geometry_for(w.rows, w.cols, shard_tokens[static_cast<std::size_t>(k)],
                                      precision_of(layer), static_cast<std::uint64_t>(w.nnz));
    const auto key = std::make_pair(layer, std::max(1, g.lanes));
    auto it = placements.find(key);
    if (it == placements.end()) {
      it = placements.emplace(key, memory.placement(layer, key.second)).first;
    }
    return &it->second;
  }

  /// Runs `op` (of block `block`) on every engine with layer `layer`'s stream when it
  /// takes one: by input for a projection's backward, else by output; a projection's bias
  /// and a LayerNorm's go with the forward. A gradient that comes back goes to the sink.
  BlockResult run(Op op, std::int32_t block = 0, std::int32_t layer = -1,
                  const Sink* sink = nullptr, BlockCall call = {}) {
    call.op = op;
    call.block = block;
    if (!takes_stream(op)) return fabric.run_block(call, nullptr, {}, {});
    const bool backward = op >= Op::head_back;
    const bool by_input = backward && is_projection(op);
    const Precision precision = is_projection(op) ? precision_of(layer) : Precision::fp32;
    const WeightStream w = memory.stream(layer, StreamKind::weights, precision,
                                         by_input ? StreamOrder::by_input : StreamOrder::by_output);
    metrics.stream_packets += w.packet_count();
    metrics.stream_bytes += w.byte_size();
    MemoryStreamSource source(w);
    std::vector<const Placement*> where;
    if (is_projection(op)) {
      for (std::int32_t k = 0; k < engines; ++k) where.push_back(placement(layer, k));
    }
    const bool with_bias = !backward && op != Op::set_table && op != Op::set_positions;
    const std::vector<float> none;
    BlockResult r = fabric.run_block(call, &source, where, with_bias ? memory.bias(layer) : none);
    // RigL: scored while the engines still hold this projection's X and dY (the next
    // operations reuse the deltas).
    if (backward && is_projection(op) && mask_updates.scores(layer)) {
      mask_updates.score(layer, call, metrics);
    }
    if (returns_gradient(op)) {
      (*sink)(layer, std::move(r.gradient.weights), std::move(r.gradient.bias));
    }
    return r;
  }

  // --- forward -----------------------------------------------------------------------------

  void forward() {
    run(Op::set_table, 0, layers.table);
    run(Op::set_positions, 0, layers.positions);
    for (std::int32_t b = 0; b < config.blocks; ++b) {
      const GptLayers::Block& l = layers.blocks[static_cast<std::size_t>(b)];
      run(Op::set_norm1, b, l.norm1);
      run(Op::set_norm2, b, l.norm2);
    }
    run(Op::set_final_norm, 0, layers.final_norm);
    run(Op::embed);
    for (std::int32_t b = 0; b < config.blocks; ++b) {
      const GptLayers::Block& l = layers.blocks[static_cast<std::size_t>(b)];
      run(Op::norm1, b);
      run(Op::q, b, l.q);
      run(Op::k, b, l.k);
      run(Op::v, b, l.v);
      run(Op::attention, b);
      run(Op::o, b, l.o);
      run(Op::norm2, b);
      run(Op::up, b, l.up);
      run(Op::gelu, b);
      run(Op::down, b, l.down);
    }
    run(Op::final_norm);
    run(Op::head, 0, layers.head);
  }

  /// The batch's loss summed over its tokens (engines in order); with `want_delta`, each
  /// engine's d_logits of the mean loss.
  double loss_sum(bool want_delta) {
    BlockCall call;
    call.want_delta = want_delta;
    call.total_tokens = total_tokens;
    return run(Op::loss, 0, -1, nullptr, call).loss.loss;
  }

  // --- backward ----------------------------------------------------------------------------

  /// The backward of the forward just run, from the engines' d_logits; every layer's
  /// gradient, summed over the engines, to the sink.
  void backward(const Sink& sink) {
    run(Op::head_back, 0, layers.head, &sink);
    run(Op::final_norm_back, 0, layers.final_norm, &sink);
    for (std::int32_t b = config.blocks; b-- > 0;) {
      const GptLayers::Block& l = layers.blocks[static_cast<std::size_t>(b)];
      run(Op::down_back, b, l.down, &sink);
      run(Op::gelu_back, b);
      run(Op::up_back, b, l.up, &sink);
      run(Op::norm2_back, b, l.norm2, &sink);
      run(Op::o_back, b, l.o, &sink);
      run(Op::attention_back, b);
      // d(n1) sums the three projections' dX.
      run(Op::q_back, b, l.q, &sink);
      run(Op::k_back, b, l.k, &sink);
      run(Op::v_back, b, l.v, &sink);
      run(Op::norm1_back, b, l.norm1, &sink);
    }
    run(Op::table_back, 0, layers.table, &sink);
    run(Op::positions_back, 0, layers.positions, &sink);
  }
};

GptModel::GptModel(ModelMemory& memory, Fabric& fabric, GptConfig config, DynamicSparsity dynamic,
                   Precision projections)
    : impl_(std::make_unique<Impl>(memory, fabric, config, dynamic, projections)) {}

GptModel::~GptModel() = default;

const GptConfig& GptModel::config() const {
  return impl_->config;
}

const StepMetrics& GptModel::totals() const {
  return impl_->totals;
}

GptStep GptModel::train_step(const TextBatch& batch) {
  Impl& m = *impl_;
  m.metrics = {};
  std::vector<EngineCounters> before;
  double threads = 0;
  for (std::int32_t k = 0; k < m.engines; ++k) {
    before.push_back(m.fabric.engine(k).counters());
    threads += m.fabric.engine(k).threads();
  }
  const auto t0 = Clock::now();
  GptStep r;
  m.load(batch, true);
  m.mask_updates.begin_step(m.memory.step() + 1);
  try {
    m.forward();
    r.loss = m.loss_sum(true) / static_cast<double>(m.total_tokens);
    m.backward([&](std::int32_t layer, WeightStream&& g, std::vector<float>&& bias) {
      m.memory.submit_gradient(layer, g, bias);
    });
  } catch (...) {
    m.memory.discard_step();
    m.mask_updates.end_step(StepReport{}, m.metrics);
    throw;
  }
  r.report = m.memory.commit_step();
  m.mask_updates.end_step(r.report, m.metrics);
  StepMetrics& mt = m.metrics;
  mt.wall_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  mt.optimizer_seconds = r.report.seconds;
  mt.tokens = m.total_tokens;
  mt.steps = 1;
  mt.engine_thread_seconds = mt.wall_seconds * threads;
  for (std::int32_t k = 0; k < m.engines; ++k) {
    const EngineCounters& now = m.fabric.engine(k).counters();
    mt.engine_busy_seconds += now.busy_seconds - before[static_cast<std::size_t>(k)].busy_seconds;
  }
  r.metrics = mt;
  m.totals += mt;
  return r;
}

std::vector<LayerGradient> GptModel::gradients(const TextBatch& batch, double* loss) {
  Impl& m = *impl_;
  m.load(batch, true);
  m.forward();
  const double mean = m.loss_sum(true) / static_cast<double>(m.total_tokens);
  if (loss != nullptr) *loss = mean;
  std::vector<LayerGradient> out(static_cast<std::size_t>(m.layers.count));
  m.backward([&](std::int32_t layer, WeightStream&& g, std::vector<float>&& bias) {
    out[static_cast<std::size_t>(layer)] = {decode_stream(g), std::move(bias)};
  });
  return out;
}

double GptModel::loss(const TextBatch& batch) {
  Impl& m = *impl_;
  m.load(batch, false);
  m.forward();
  return m.loss_sum(false) / static_cast<double>(m.total_tokens);
}

std::vector<float> GptModel::next_logits(std::span<const std::int32_t> tokens) {
  Impl& m = *impl_;
  if (tokens.empty()) throw ArgumentError("GptModel::next_logits: no tokens");
  const std::int64_t context = m.config.context;
  const auto used = std::min<std::int64_t>(context, static_cast<std::int64_t>(tokens.size()));
  // One window per engine (each takes whole sequences); causal attention lets the padding
  // after the last token change nothing before it.
  TextBatch batch;
  batch.sequences = m.engines;
  batch.context = context;
  std::vector<std::int32_t> window(static_cast<std::size_t>(context), 0);
  std::copy(tokens.end() - used, tokens.end(), window.begin());
  for (std::int32_t k = 0; k < m.engines; ++k) {
    batch.inputs.insert(batch.inputs.end(), window.begin(), window.end());
  }
  batch.targets.assign(batch.inputs.size(), 0);
  m.load(batch, false);
  m.forward();
  return m.fabric.block_logits(used - 1);
}

}  // namespace sluice
