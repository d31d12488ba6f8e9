// The Engine's block operations: a GPT's step (sluice/gpt.hpp) on the shard the engine keeps
// in its BlockStore. The projections are the engine's product calls; the weightless blocks
// (sluice/blocks.hpp) run on the engine's own threads; the dense parameters arrive as weight
// streams and their gradients leave as gradient streams in those streams' order.
#include <cmath>
#include <string>

#include "sluice/blocks.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"
#include "sluice/stream_codec.hpp"

namespace sluice {
namespace {

using Op = BlockOp;

std::string named(const BlockCall& call) {
  return std::string("engine block op ") + to_string(call.op) + " (block " +
         std::to_string(call.block) + ")";
}

/// The whole stream in memory (its chunks shared, not copied).
WeightStream take_all(StreamSource& source) {
  WeightStream s;
  s.header = source.header();
  while (ChunkPtr c = source.next()) s.chunks.push_back(std::move(c));
  return s;
}

/// A dense parameter's values from its stream: rows x cols, every position present.
DenseMatrix dense_of(const WeightStream& s, std::int64_t rows, std::int64_t cols,
                     const std::string& what) {
  if (s.header.kind != StreamKind::weights || s.header.order != StreamOrder::by_output ||
      s.header.outputs != rows || s.header.inputs != cols) {
    throw ShapeError(what + ": needs a weights stream by output of " + std::to_string(rows) + "x" +
                     std::to_string(cols) + ", got " + to_string(s.header.kind) + " " +
                     std::to_string(s.header.outputs) + "x" + std::to_string(s.header.inputs) +
                     " " + to_string(s.header.order));
  }
  return decode_stream(s).to_dense();
}

/// The gradient `g` of a dense parameter as a gradient stream with the tags, control
/// packets and chunks of the parameter's own stream `s` (fp32, by output): what the
/// fabric's reduction and ModelMemory's submit_gradient expect of any layer's gradient.
WeightStream gradient_like(const WeightStream& s, ConstMatrixView g, const std::string& what) {
  if (s.header.precision != Precision::fp32 || s.header.order != StreamOrder::by_output ||
      s.header.outputs != g.rows || s.header.inputs != g.cols) {
    throw ShapeError(what + ": the parameter's stream is not an fp32 stream by output of " +
                     std::to_string(g.rows) + "x" + std::to_string(g.cols));
  }
  s.validate();
  WeightStream out;
  out.header = s.header;
  out.header.kind = StreamKind::gradient;
  for (const ChunkPtr& chunk : s.chunks) {
    auto c = std::make_shared<StreamChunk>();
    c->first_output = chunk->first_output;
    c->outputs = chunk->outputs;
    c->packets = chunk->packets;
    std::int64_t o = chunk->first_output;
    for (Packet& p : c->packets) {
      if (!is_control(p)) {
        p.value = g(o, p.tag);
      } else if (p.tag == kCarriageReturn) {
        ++o;
      }
    }
    out.chunks.push_back(std::move(c));
  }
  return out;
}

void add_bias(MutableMatrixView y, std::span<const float> bias) {
  for (std::int64_t r = 0; r < y.rows; ++r) {
    const float b = bias[static_cast<std::size_t>(r)];
    float* row = y.row(r);
    for (std::int64_t t = 0; t < y.cols; ++t) row[t] += b;
  }
}

/// A projection's input and output (forward) or input X, dY and dX (backward) in a store.
struct ProjectionSlots {
  ConstMatrixView x;
  MutableMatrixView y;  ///< forward: Y; backward: dY
  MutableMatrixView dx;
};

ProjectionSlots slots_of(BlockStore& s, const BlockCall& call) {
  if (call.op == Op::head) return {s.nf, s.logits, {}};
  if (call.op == Op::head_back) return {s.nf, s.d_logits, s.dnf};
  BlockStore::Block& b = s.blocks[static_cast<std::size_t>(call.block)];
  switch (call.op) {
    case Op::q:
      return {b.n1, b.q, {}};
    case Op::k:
      return {b.n1, b.k, {}};
    case Op::v:
      return {b.n1, b.v, {}};
    case Op::o:
      return {b.att, b.mid, {}};
    case Op::up:
      return {b.n2, b.u, {}};
    case Op::down:
      return {b.h, s.block_output(static_cast<std::size_t>(call.block)), {}};
    case Op::down_back:
      return {b.h, s.dx, s.dh};
    case Op::up_back:
      return {b.n2, s.du, s.dn};
    case Op::o_back:
      return {b.att, s.dmid, s.datt};
    case Op::q_back:
      return {b.n1, s.dq, s.dn};
    case Op::k_back:  // into datt (free again), then added to dn
      return {b.n1, s.dk, s.datt};
    case Op::v_back:
      return {b.n1, s.dv, s.datt};
    default:
      throw ArgumentError(std::string("engine: ") + to_string(call.op) + " is no projection");
  }
}

void check_call(const BlockStore& s, const BlockCall& call, StreamSource* weights,
                const Placement* placement) {
  if (!s.loaded()) throw ArgumentError(named(call) + ": no batch shard loaded");
  const auto op = static_cast<std::int32_t>(call.op);
  if (op < kFirstBlockOp || op > kLastBlockOp) {
    throw ArgumentError("engine block op: unknown operation " + std::to_string(op));
  }
  if (call.block < 0 || call.block >= s.shape().blocks) {
    throw ArgumentError(named(call) + ": the model has " + std::to_string(s.shape().blocks) +
                        " blocks");
  }
  if (takes_stream(call.op) != (weights != nullptr)) {
    throw ArgumentError(named(call) + (weights ? ": takes no stream" : ": needs a stream"));
  }
  if (is_projection(call.op) && placement == nullptr) {
    throw ArgumentError(named(call) + ": a projection needs a placement");
  }
  if (call.op >= Op::head_back && !s.shape().training) {
    throw ArgumentError(named(call) + ": the shard was loaded for inference");
  }
}

}  // namespace

void Engine::load_tokens(const BlockShape& shape, std::span<const std::int32_t> inputs,
                         std::span<const std::int32_t> targets) {
  blocks_.load(shape, inputs, targets);
}

BlockReply Engine::run_block(const BlockCall& call, StreamSource* weights,
                             const Placement* placement, std::span<const float> bias) {
  BlockStore& s = blocks_;
  check_call(s, call, weights, placement);
  BlockReply reply;
  if (is_projection(call.op)) {
    const ProjectionSlots p = slots_of(s, call);
    if (call.op < Op::loss) {
      if (static_cast<std::int64_t>(bias.size()) != p.y.rows) {
        throw ShapeError(named(call) + ": " + std::to_string(bias.size()) + " biases for " +
                         std::to_string(p.y.rows) + " outputs");
      }
      forward(*weights, *placement, p.x, p.y);
      on_engine_threads([&] {
        add_bias(p.y, bias);
        if (call.op == Op::down)
          residual_add(p.y, s.blocks[static_cast<std::size_t>(call.block)].mid);
      });
    } else {
      MutableMatrixView dx = p.dx;
      reply.gradient = backward(*weights, *placement, p.x, p.y, &dx);
      reply.bias_gradient = bias_gradient(p.y);
      if (call.op == Op::k_back || call.op == Op::v_back) {
        on_engine_threads([&] { residual_add(s.dn, s.datt); });
      }
    }
    return reply;
  }
  if (call.op <= Op::set_final_norm) {
    set_parameter(call, take_all(*weights), bias);
    return reply;
  }
  if (returns_gradient(call.op)) {
    const WeightStream parameter = take_all(*weights);
    on_engine_threads([&] { reply = parameter_backward(call, parameter); });
    return reply;
  }
  on_engine_threads([&] { reply = weightless_block(call); });
  return reply;
}

void Engine::set_parameter(const BlockCall& call, const WeightStream& stream,
                           std::span<const float> bias) {
  BlockStore& s = blocks_;
  const BlockShape& shape = s.shape();
  const std::string what = named(call);
  if (call.op == Op::set_table) {
    s.table = dense_of(stream, shape.vocab, shape.d_model, what);
    return;
  }
  if (call.op == Op::set_positions) {
    s.positions = dense_of(stream, shape.context, shape.d_model, what);
    return;
  }
  if (static_cast<std::int64_t>(bias.size()) != shape.d_model) {
    throw ShapeError(what + ": " + std::to_string(bias.size()) + " biases for d_model " +
                     std::to_string(shape.d_model));
  }
  const DenseMatrix gain = dense_of(stream, shape.d_model, 1, what);
  BlockStore::Norm norm;
  for (std::int64_t r = 0; r < gain.rows(); ++r) norm.gain.push_back(gain(r, 0));
  norm.bias.assign(bias.begin(), bias.end());
  const auto b = static_cast<std::size_t>(call.block);
  const auto blocks = static_cast<std::size_t>(shape.blocks);
  if (call.op == Op::set_final_norm) {
    s.final = std::move(norm);
    return;
  }
  std::vector<BlockStore::Norm>& norms = call.op == Op::set_norm1 ? s.norm1 : s.norm2;
  norms.resize(blocks);
  norms[b] = std::move(norm);
}

BlockReply Engine::parameter_backward(const BlockCall& call, const WeightStream& parameter) {
  BlockStore& s = blocks_;
  const std::string what = named(call);
  const std::int64_t d = s.shape().d_model;
  BlockReply reply;
  if (call.op == Op::table_back) {
    s.d_table = DenseMatrix(s.shape().vocab, d);
    s.d_positions = DenseMatrix(s.shape().context, d);
    embedding_backward(s.inputs, s.dx, s.d_table, s.d_positions);
    reply.gradient = gradient_like(parameter, s.d_table, what);
    return reply;
  }
  if (call.op == Op::positions_back) {
    if (s.d_positions.rows() == 0) throw ArgumentError(what + ": comes after table_back");
    reply.gradient = gradient_like(parameter, s.d_positions, what);
    s.d_positions = DenseMatrix();
    return reply;
  }
  std::vector<float> gain(static_cast<std::size_t>(d)), bias(static_cast<std::size_t>(d));
  const auto bi = static_cast<std::size_t>(call.block);
  BlockStore::Block& b = s.blocks[bi];
  if (call.op == Op::final_norm_back) {
    layer_norm_backward(s.x_out, s.final.gain, s.mean_f, s.inv_f, s.dnf, s.dx, gain, bias);
  } else if (call.op == Op::norm2_back) {
    layer_norm_backward(b.mid, s.norm2.at(bi).gain, b.mean2, b.inv2, s.dn, s.dmid, gain, bias);
    residual_add(s.dmid, s.dx);
  } else {  // norm1_back
    layer_norm_backward(b.x, s.norm1.at(bi).gain, b.mean1, b.inv1, s.dn, s.dx, gain, bias);
    residual_add(s.dx, s.dmid);
  }
  reply.gradient = gradient_like(parameter, ConstMatrixView{gain.data(), d, 1, 1}, what);
  reply.bias_gradient = std::move(bias);
  return reply;
}

BlockReply Engine::weightless_block(const BlockCall& call) {
  BlockStore& s = blocks_;
  const std::string what = named(call);
  const auto bi = static_cast<std::size_t>(call.block);
  BlockStore::Block& b = s.blocks[bi];
  auto norm = [&](const std::vector<BlockStore::Norm>& norms) -> const BlockStore::Norm& {
    if (norms.size() <= bi) throw ArgumentError(what + ": its LayerNorm was not set");
    return norms[bi];
  };
  BlockReply reply;
  switch (call.op) {
    case Op::embed:
      if (s.table.rows() == 0 || s.positions.rows() == 0) {
        throw ArgumentError(what + ": the embedding tables were not set");
      }
      embedding_forward(s.inputs, s.table, s.positions, s.blocks[0].x);
      break;
    case Op::norm1: {
      const BlockStore::Norm& n = norm(s.norm1);
      layer_norm_forward(b.x, n.gain, n.bias, b.n1, {b.mean1, b.inv1});
      break;
    }
    case Op::attention:
      causal_attention_forward(b.q, b.k, b.v, s.attention(), b.att, b.probabilities);
      break;
    case Op::norm2: {
      const BlockStore::Norm& n = norm(s.norm2);
      residual_add(b.mid, b.x);
      layer_norm_forward(b.mid, n.gain, n.bias, b.n2, {b.mean2, b.inv2});
      break;
    }
    case Op::gelu:
      gelu_forward(b.u, b.h);
      break;
    case Op::final_norm:
      if (s.final.gain.empty()) throw ArgumentError(what + ": the final LayerNorm was not set");
      layer_norm_forward(s.x_out, s.final.gain, s.final.bias, s.nf, {s.mean_f, s.inv_f});
      break;
    case Op::loss: {
      if (s.targets.size() != s.inputs.size()) {
        throw ArgumentError(what + ": the shard was loaded without targets");
      }
      if (call.want_delta && (call.total_tokens < 1 || !s.shape().training)) {
        throw ArgumentError(what + ": a delta needs a training shard and the batch's tokens");
      }
      const float scale = call.want_delta ? 1.0F / static_cast<float>(call.total_tokens) : 1.0F;
      const double sum = softmax_cross_entropy(
          s.logits, s.targets, call.want_delta ? s.d_logits.view() : MutableMatrixView{}, scale);
      reply.loss = {sum, 0, s.tokens(), !std::isfinite(sum)};
      break;
    }
    case Op::gelu_back:
      gelu_backward(b.u, s.dh, s.du);
      break;
    case Op::attention_back:
      causal_attention_backward(b.q, b.k, b.v, b.probabilities, s.attention(), s.datt, s.dq, s.dk,
                                s.dv);
      break;
    default:
      throw ArgumentError(what + ": not a weightless block");
  }
  return reply;
}

std::pair<ConstMatrixView, ConstMatrixView> Engine::growth_activations(
    const GrowthSource& source) const {
  if (!source.block) {
    const std::int32_t l = source.layer;
    if (!store_.loaded() || l < 0 || l >= store_.layers()) {
      throw ArgumentError("engine growth activations: no layer " + std::to_string(l) +
                          " in the engine's store");
    }
    return {store_.in(l), store_.last_delta(store_.spec().sizes[static_cast<std::size_t>(l) + 1])};
  }
  const BlockCall& call = *source.block;
  if (!blocks_.loaded() || call.op < Op::head_back || !is_projection(call.op) || call.block < 0 ||
      call.block >= blocks_.shape().blocks) {
    throw ArgumentError("engine growth activations: " + named(call) +
                        " is no projection backward of the block store's model");
  }
  // slots_of hands out the slots it would write; here they are only read.
  const ProjectionSlots p = slots_of(const_cast<BlockStore&>(blocks_), call);
  return {p.x, ConstMatrixView(p.y)};
}

}  // namespace sluice
