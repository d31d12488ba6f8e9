// GptModel: a GPT's forward and backward over a Fabric. The projections' weights stream out of
// ModelMemory to every engine (one broadcast per projection and pass), each engine multiplies
// its own sequences, and the summed gradient streams go back to ModelMemory. The dense
// parameters stream out the same way and their gradients go back as gradient streams of
// their full masks. Between the projections, the weightless blocks run on each engine's
// shard of activations.
#include <chrono>
#include <map>
#include <string>

#include "sluice/blocks.hpp"
#include "sluice/error.hpp"
#include "sluice/gpt.hpp"

namespace sluice {
namespace {

using Clock = std::chrono::steady_clock;

/// What one block of one engine's shard keeps from the forward for the backward.
struct BlockState {
  DenseMatrix x;  // the block's input: the residual stream
  DenseMatrix n1, q, k, v, att, mid, n2, u, h;
  std::vector<float> mean1, inv1, mean2, inv2, probabilities;
};

/// One engine's shard of a batch: whole sequences, and everything the backward needs.
struct Shard {
  std::int64_t tokens = 0;
  std::vector<std::int32_t> inputs, targets;
  std::vector<BlockState> blocks;
  DenseMatrix x;  // the last block's output
  DenseMatrix nf, logits, d_logits;
  std::vector<float> mean_f, inv_f;
};

/// A LayerNorm's parameters as streamed out of ModelMemory.
struct NormParameters {
  std::vector<float> gain, bias;
};

struct DenseParameters {
  DenseMatrix table, positions;
  std::vector<NormParameters> norm1, norm2;
  NormParameters final_norm;
};

/// Gradients of the dense parameters, summed over the engines in engine order.
struct NormGradient {
  std::vector<float> gain, bias;
  explicit NormGradient(std::int64_t d)
      : gain(static_cast<std::size_t>(d)), bias(static_cast<std::size_t>(d)) {}
};

std::vector<float> column(const DenseMatrix& m) {
  std::vector<float> out(static_cast<std::size_t>(m.rows()));
  for (std::int64_t r = 0; r < m.rows(); ++r) out[static_cast<std::size_t>(r)] = m(r, 0);
  return out;
}

void add_bias(MutableMatrixView y, const std::vector<float>& bias) {
  for (std::int64_t r = 0; r < y.rows; ++r) {
    const float b = bias[static_cast<std::size_t>(r)];
    float* row = y.row(r);
    for (std::int64_t t = 0; t < y.cols; ++t) row[t] += b;
  }
}

/// A gradient stream of a dense parameter layer (its mask full) from its dense gradient.
WeightStream dense_gradient_stream(ConstMatrixView g) {
  CsrMatrix m = CsrMatrix::random(g.rows, g.cols, 0.0, 1);
  std::size_t i = 0;
  for (std::int64_t r = 0; r < g.rows; ++r)
    for (std::int64_t c = 0; c < g.cols; ++c) m.values()[i++] = g(r, c);
  // Encoded as the weights of that pattern would be; the values are the gradient.
  WeightStream s = encode_stream(m, StreamKind::weights);
  s.header.kind = StreamKind::gradient;
  return s;
}

}  // namespace

struct GptModel::Impl {
  using Sink = std::function<void(std::int32_t, WeightStream&&, std::vector<float>&&)>;

  ModelMemory& memory;
  Fabric& fabric;
  GptConfig config;
  GptLayers layers;
  std::int32_t engines = 1;
  std::vector<Shard> shards;
  std::int64_t total_tokens = 0;
  std::map<std::pair<std::int32_t, std::int32_t>, Placement> placements;
  std::uint64_t mask_generation = 0;
  StepMetrics totals;
  StepMetrics metrics;  // of the current call

  Impl(ModelMemory& m, Fabric& f, GptConfig c)
      : memory(m), fabric(f), config(c), layers(c), engines(f.engine_count()) {
    const GptConfig held = gpt_config_of(memory);
    if (held.describe() != config.describe()) {
      throw ShapeError("GptModel: the ModelMemory holds " + held.describe() + ", not " +
                       config.describe());
    }
    config.sparsity = held.sparsity;
    mask_generation = memory.mask_generation();
  }

  std::int64_t d() const { return config.d_model; }
  AttentionShape attention() const { return {config.context, config.heads}; }

  // --- the batch's shards ------------------------------------------------------------------

  void load(const TextBatch& batch) {
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
    shards.resize(static_cast<std::size_t>(engines));
    total_tokens = static_cast<std::int64_t>(expected);
    for (std::int32_t k = 0; k < engines; ++k) {
      const Fabric::TokenRange r = Fabric::shard_of(k, engines, batch.sequences);
      Shard& s = shards[static_cast<std::size_t>(k)];
      const std::int64_t first = r.first * config.context;
      s.tokens = r.count * config.context;
      s.inputs.assign(batch.inputs.begin() + first, batch.inputs.begin() + first + s.tokens);
      s.targets.assign(batch.targets.begin() + first, batch.targets.begin() + first + s.tokens);
      allocate(s);
    }
  }

  void allocate(Shard& s) const {
    const std::int64_t t = s.tokens;
    if (s.x.cols() == t && !s.blocks.empty()) return;  // the previous batch's buffers fit
    s.blocks.clear();
    s.blocks.resize(static_cast<std::size_t>(config.blocks));
    const auto tokens = static_cast<std::size_t>(t);
    for (BlockState& b : s.blocks) {
      for (DenseMatrix* m : {&b.x, &b.n1, &b.q, &b.k, &b.v, &b.att, &b.mid, &b.n2}) {
        *m = DenseMatrix(d(), t);
      }
      b.u = DenseMatrix(4 * d(), t);
      b.h = DenseMatrix(4 * d(), t);
      for (auto* v : {&b.mean1, &b.inv1, &b.mean2, &b.inv2}) v->assign(tokens, 0.0F);
      b.probabilities.assign(static_cast<std::size_t>(attention_probabilities_size(t, attention())),
                             0.0F);
    }
    s.x = DenseMatrix(d(), t);
    s.nf = DenseMatrix(d(), t);
    s.logits = DenseMatrix(config.vocab, t);
    s.d_logits = DenseMatrix(config.vocab, t);
    s.mean_f.assign(tokens, 0.0F);
    s.inv_f.assign(tokens, 0.0F);
  }

  // --- streaming ---------------------------------------------------------------------------

  const Placement* placement(std::int32_t layer, std::int32_t k) {
    if (memory.mask_generation() != mask_generation) {
      placements.clear();
      mask_generation = memory.mask_generation();
    }
    const LayerShape w = memory.layer_shape(layer);
    const Geometry g =
        fabric.engine(k).geometry_for(w.rows, w.cols, shards[static_cast<std::size_t>(k)].tokens,
                                      Precision::fp32, static_cast<std::uint64_t>(w.nnz));
    const auto key = std::make_pair(layer, std::max(1, g.lanes));
    auto it = placements.find(key);
    if (it == placements.end()) {
      it = placements.emplace(key, memory.placement(layer, key.second)).first;
    }
    return &it->second;
  }

  std::vector<const Placement*> placements_of(std::int32_t layer) {
    std::vector<const Placement*> out;
    for (std::int32_t k = 0; k < engines; ++k) out.push_back(placement(layer, k));
    return out;
  }

  void account(const WeightStream& w) {
    metrics.stream_packets += w.packet_count();
    metrics.stream_bytes += w.byte_size();
  }

  /// A dense parameter layer as streamed out of ModelMemory.
  DenseMatrix dense_parameter(std::int32_t layer) {
    const WeightStream w = memory.stream(layer);
    account(w);
    return decode_stream(w).to_dense();
  }

  NormParameters norm_parameters(std::int32_t layer) {
    return {column(dense_parameter(layer)), memory.bias(layer)};
  }

  DenseParameters dense_parameters() {
    DenseParameters p;
    p.table = dense_parameter(layers.table);
    p.positions = dense_parameter(layers.positions);
    for (const GptLayers::Block& b : layers.blocks) {
      p.norm1.push_back(norm_parameters(b.norm1));
      p.norm2.push_back(norm_parameters(b.norm2));
    }
    p.final_norm = norm_parameters(layers.final_norm);
    return p;
  }

  /// ys[k] = W xs[k] + b on every engine from one broadcast of the layer's stream.
  template <typename In, typename Out>
  void project(std::int32_t layer, In in, Out out) {
    std::vector<ConstMatrixView> xs;
    std::vector<MutableMatrixView> ys;
    for (Shard& s : shards) {
      xs.push_back(in(s));
      ys.push_back(out(s));
    }
    const WeightStream w = memory.stream(layer);
    account(w);
    MemoryStreamSource source(w);
    fabric.forward(source, placements_of(layer), xs, ys);
    const std::vector<float>& bias = memory.bias(layer);
    for (const MutableMatrixView& y : ys) add_bias(y, bias);
  }

  /// The backward of project(): dxs[k] = W^T dys[k] (overwritten), and the layer's gradient,
  /// summed over the engines, to the sink.
  void project_back(std::int32_t layer, std::span<const ConstMatrixView> xs,
                    std::span<const ConstMatrixView> dys, std::vector<DenseMatrix>& dxs,
                    const Sink& sink) {
    // By input: the engines gather dY once for both dX and the weight gradient.
    const WeightStream w =
        memory.stream(layer, StreamKind::weights, Precision::fp32, StreamOrder::by_input);
    account(w);
    MemoryStreamSource source(w);
    std::vector<MutableMatrixView> views;
    for (DenseMatrix& m : dxs) views.push_back(m.view());
    std::vector<MutableMatrixView*> pointers;
    for (MutableMatrixView& v : views) pointers.push_back(&v);
    ReducedGradient g = fabric.backward(source, placements_of(layer), xs, dys, pointers, true);
    sink(layer, std::move(g.weights), std::move(g.bias));
  }

  // --- forward -----------------------------------------------------------------------------

  DenseMatrix& block_output(Shard& s, std::size_t b) {
    return b + 1 < s.blocks.size() ? s.blocks[b + 1].x : s.x;
  }

  void forward_block(std::size_t b, const DenseParameters& p) {
    const GptLayers::Block& l = layers.blocks[b];
    auto block = [b](Shard& s) -> BlockState& { return s.blocks[b]; };
    for (Shard& s : shards) {
      BlockState& st = block(s);
      layer_norm_forward(st.x, p.norm1[b].gain, p.norm1[b].bias, st.n1, {st.mean1, st.inv1});
    }
    auto n1 = [&](Shard& s) { return ConstMatrixView(block(s).n1); };
    project(l.q, n1, [&](Shard& s) { return block(s).q.view(); });
    project(l.k, n1, [&](Shard& s) { return block(s).k.view(); });
    project(l.v, n1, [&](Shard& s) { return block(s).v.view(); });
    for (Shard& s : shards) {
      BlockState& st = block(s);
      causal_attention_forward(st.q, st.k, st.v, attention(), st.att, st.probabilities);
    }
    project(
        l.o, [&](Shard& s) { return ConstMatrixView(block(s).att); },
        [&](Shard& s) { return block(s).mid.view(); });
    for (Shard& s : shards) {
      BlockState& st = block(s);
      residual_add(st.mid, st.x);
      layer_norm_forward(st.mid, p.norm2[b].gain, p.norm2[b].bias, st.n2, {st.mean2, st.inv2});
    }
    project(
        l.up, [&](Shard& s) { return ConstMatrixView(block(s).n2); },
        [&](Shard& s) { return block(s).u.view(); });
    for (Shard& s : shards) gelu_forward(block(s).u, block(s).h);
    project(
        l.down, [&](Shard& s) { return ConstMatrixView(block(s).h); },
        [&](Shard& s) { return block_output(s, b).view(); });
    for (Shard& s : shards) residual_add(block_output(s, b), block(s).mid);
  }

  /// The forward of the loaded shards; returns the dense parameters it streamed.
  DenseParameters forward() {
    DenseParameters p = dense_parameters();
    for (Shard& s : shards) embedding_forward(s.inputs, p.table, p.positions, s.blocks[0].x);
    for (std::size_t b = 0; b < shards[0].blocks.size(); ++b) forward_block(b, p);
    for (Shard& s : shards) {
      layer_norm_forward(s.x, p.final_norm.gain, p.final_norm.bias, s.nf, {s.mean_f, s.inv_f});
    }
    project(
        layers.head, [](Shard& s) { return ConstMatrixView(s.nf); },
        [](Shard& s) { return s.logits.view(); });
    return p;
  }

  /// The batch's loss summed over its tokens (engines in order); with `want_delta`, each
  /// shard's d_logits of the mean loss.
  double loss_sum(bool want_delta) {
    double sum = 0;
    const float scale = 1.0F / static_cast<float>(total_tokens);
    for (Shard& s : shards) {
      sum += softmax_cross_entropy(s.logits, s.targets,
                                   want_delta ? s.d_logits.view() : MutableMatrixView{}, scale);
    }
    return sum;
  }

  // --- backward ----------------------------------------------------------------------------

  std::vector<DenseMatrix> buffers(std::int64_t rows) const {
    std::vector<DenseMatrix> out;
    for (const Shard& s : shards) out.emplace_back(rows, s.tokens);
    return out;
  }

  template <typename Fn>
  std::vector<ConstMatrixView> views(Fn fn) {
    std::vector<ConstMatrixView> out;
    for (std::size_t k = 0; k < shards.size(); ++k) out.push_back(fn(k));
    return out;
  }

  static std::vector<ConstMatrixView> views_of(const std::vector<DenseMatrix>& ms) {
    std::vector<ConstMatrixView> out;
    for (const DenseMatrix& m : ms) out.push_back(m.view());
    return out;
  }

  void submit_norm(std::int32_t layer, NormGradient& g, const Sink& sink) {
    const ConstMatrixView gain{g.gain.data(), d(), 1, 1};
    sink(layer, dense_gradient_stream(gain), std::move(g.bias));
  }

  /// Block b's backward: `dx` holds d(block output) and becomes d(block input).
  void backward_block(std::size_t b, const DenseParameters& p, std::vector<DenseMatrix>& dx,
                      const Sink& sink) {
    const GptLayers::Block& l = layers.blocks[b];
    auto st = [&](std::size_t k) -> BlockState& { return shards[k].blocks[b]; };
    std::vector<DenseMatrix> dh = buffers(4 * d()), du = buffers(4 * d());
    project_back(l.down, views([&](std::size_t k) { return ConstMatrixView(st(k).h); }),
                 views_of(dx), dh, sink);
    for (std::size_t k = 0; k < shards.size(); ++k) gelu_backward(st(k).u, dh[k], du[k]);
    std::vector<DenseMatrix> dn = buffers(d()), dmid = buffers(d());
    project_back(l.up, views([&](std::size_t k) { return ConstMatrixView(st(k).n2); }),
                 views_of(du), dn, sink);
    NormGradient g2(d()), g1(d());
    for (std::size_t k = 0; k < shards.size(); ++k) {
      layer_norm_backward(st(k).mid, p.norm2[b].gain, st(k).mean2, st(k).inv2, dn[k], dmid[k],
                          g2.gain, g2.bias);
      residual_add(dmid[k], dx[k]);
    }
    submit_norm(l.norm2, g2, sink);
    std::vector<DenseMatrix> datt = buffers(d());
    project_back(l.o, views([&](std::size_t k) { return ConstMatrixView(st(k).att); }),
                 views_of(dmid), datt, sink);
    std::vector<DenseMatrix> dq = buffers(d()), dk = buffers(d()), dv = buffers(d());
    for (std::size_t k = 0; k < shards.size(); ++k) {
      causal_attention_backward(st(k).q, st(k).k, st(k).v, st(k).probabilities, attention(),
                                datt[k], dq[k], dk[k], dv[k]);
    }
    const std::vector<ConstMatrixView> n1 =
        views([&](std::size_t k) { return ConstMatrixView(st(k).n1); });
    // d(n1) sums the three projections' dX; datt is free again and takes the second.
    project_back(l.q, n1, views_of(dq), dn, sink);
    for (const auto& [layer, grad] : {std::pair{l.k, &dk}, std::pair{l.v, &dv}}) {
      project_back(layer, n1, views_of(*grad), datt, sink);
      for (std::size_t k = 0; k < shards.size(); ++k) residual_add(dn[k], datt[k]);
    }
    for (std::size_t k = 0; k < shards.size(); ++k) {
      layer_norm_backward(st(k).x, p.norm1[b].gain, st(k).mean1, st(k).inv1, dn[k], dx[k], g1.gain,
                          g1.bias);
      residual_add(dx[k], dmid[k]);
    }
    submit_norm(l.norm1, g1, sink);
  }

  /// The backward of the forward just run, from the shards' d_logits.
  void backward(const DenseParameters& p, const Sink& sink) {
    std::vector<DenseMatrix> dnf = buffers(d()), dx = buffers(d());
    project_back(layers.head, views([&](std::size_t k) { return ConstMatrixView(shards[k].nf); }),
                 views([&](std::size_t k) { return ConstMatrixView(shards[k].d_logits); }), dnf,
                 sink);
    NormGradient gf(d());
    for (std::size_t k = 0; k < shards.size(); ++k) {
      const Shard& s = shards[k];
      layer_norm_backward(s.x, p.final_norm.gain, s.mean_f, s.inv_f, dnf[k], dx[k], gf.gain,
                          gf.bias);
    }
    submit_norm(layers.final_norm, gf, sink);
    for (std::size_t b = shards[0].blocks.size(); b-- > 0;) backward_block(b, p, dx, sink);
    DenseMatrix d_table(config.vocab, d()), d_positions(config.context, d());
    for (std::size_t k = 0; k < shards.size(); ++k) {
      embedding_backward(shards[k].inputs, dx[k], d_table, d_positions);
    }
    sink(layers.table, dense_gradient_stream(d_table), {});
    sink(layers.positions, dense_gradient_stream(d_positions), {});
  }
};

GptModel::GptModel(ModelMemory& memory, Fabric& fabric, GptConfig config)
    : impl_(std::make_unique<Impl>(memory, fabric, config)) {}

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
  m.load(batch);
  try {
    const DenseParameters p = m.forward();
    r.loss = m.loss_sum(true) / static_cast<double>(m.total_tokens);
    m.backward(p, [&](std::int32_t layer, WeightStream&& g, std::vector<float>&& bias) {
      m.memory.submit_gradient(layer, g, bias);
    });
  } catch (...) {
    m.memory.discard_step();
    throw;
  }
  r.report = m.memory.commit_step();
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
  m.load(batch);
  const DenseParameters p = m.forward();
  const double mean = m.loss_sum(true) / static_cast<double>(m.total_tokens);
  if (loss != nullptr) *loss = mean;
  std::vector<LayerGradient> out(static_cast<std::size_t>(m.layers.count));
  m.backward(p, [&](std::int32_t layer, WeightStream&& g, std::vector<float>&& bias) {
    out[static_cast<std::size_t>(layer)] = {decode_stream(g), std::move(bias)};
  });
  return out;
}

double GptModel::loss(const TextBatch& batch) {
  Impl& m = *impl_;
  m.load(batch);
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
  m.load(batch);
  m.forward();
  std::vector<float> logits(static_cast<std::size_t>(m.config.vocab));
  for (std::int64_t o = 0; o < m.config.vocab; ++o) {
    logits[static_cast<std::size_t>(o)] = m.shards[0].logits(o, used - 1);
  }
  return logits;
}

}  // namespace sluice
