// The block model's activation store: one engine's shard of a GPT's batch, its buffers
// sized from the shape.
#include "sluice/block_store.hpp"

#include <string>

#include "core/enum_names.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

using Op = BlockOp;

constexpr detail::EnumName<BlockOp> kBlockOpNames[] = {
    {Op::set_table, "set_table"},
    {Op::set_positions, "set_positions"},
    {Op::set_norm1, "set_norm1"},
    {Op::set_norm2, "set_norm2"},
    {Op::set_final_norm, "set_final_norm"},
    {Op::embed, "embed"},
    {Op::norm1, "norm1"},
    {Op::q, "q"},
    {Op::k, "k"},
    {Op::v, "v"},
    {Op::attention, "attention"},
    {Op::o, "o"},
    {Op::norm2, "norm2"},
    {Op::up, "up"},
    {Op::gelu, "gelu"},
    {Op::down, "down"},
    {Op::final_norm, "final_norm"},
    {Op::head, "head"},
    {Op::loss, "loss"},
    {Op::head_back, "head_back"},
    {Op::final_norm_back, "final_norm_back"},
    {Op::down_back, "down_back"},
    {Op::gelu_back, "gelu_back"},
    {Op::up_back, "up_back"},
    {Op::norm2_back, "norm2_back"},
    {Op::o_back, "o_back"},
    {Op::attention_back, "attention_back"},
    {Op::q_back, "q_back"},
    {Op::k_back, "k_back"},
    {Op::v_back, "v_back"},
    {Op::norm1_back, "norm1_back"},
    {Op::table_back, "table_back"},
    {Op::positions_back, "positions_back"},
};

void check_positive(std::int64_t value, const char* what) {
  if (value < 1) {
    throw ShapeError(std::string("block store: ") + what + " " + std::to_string(value) +
                     " (must be at least 1)");
  }
}

}  // namespace

SLUICE_ENUM_TO_STRING(BlockOp, kBlockOpNames)

bool is_projection(BlockOp op) {
  switch (op) {
    case Op::q:
    case Op::k:
    case Op::v:
    case Op::o:
    case Op::up:
    case Op::down:
    case Op::head:
    case Op::head_back:
    case Op::down_back:
    case Op::up_back:
    case Op::o_back:
    case Op::q_back:
    case Op::k_back:
    case Op::v_back:
      return true;
    default:
      return false;
  }
}

bool returns_gradient(BlockOp op) {
  const bool backward = op >= Op::head_back;
  const bool weightless = op == Op::gelu_back || op == Op::attention_back;
  return backward && !weightless;
}

bool has_bias_gradient(BlockOp op) {
  return returns_gradient(op) && op != Op::table_back && op != Op::positions_back;
}

bool takes_stream(BlockOp op) {
  return op <= Op::set_final_norm || is_projection(op) || returns_gradient(op);
}

void BlockStore::load(const BlockShape& shape, std::span<const std::int32_t> in,
                      std::span<const std::int32_t> out) {
  check_positive(shape.vocab, "vocabulary");
  check_positive(shape.context, "context");
  check_positive(shape.d_model, "d_model");
  check_positive(shape.heads, "heads");
  check_positive(shape.blocks, "blocks");
  if (shape.d_model % shape.heads != 0) {
    throw ShapeError("block store: d_model " + std::to_string(shape.d_model) +
                     " is not a multiple of " + std::to_string(shape.heads) + " heads");
  }
  const auto t = static_cast<std::int64_t>(in.size());
  if (t < 1 || t % shape.context != 0 || (!out.empty() && out.size() != in.size())) {
    throw ShapeError("block store: " + std::to_string(in.size()) + " inputs and " +
                     std::to_string(out.size()) + " targets are not whole sequences of " +
                     std::to_string(shape.context));
  }
  for (const std::span<const std::int32_t> list : {in, out}) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (list[i] < 0 || list[i] >= shape.vocab) {
        throw ArgumentError("block store: token " + std::to_string(list[i]) + " at " +
                            std::to_string(i) + " is outside the vocabulary of " +
                            std::to_string(shape.vocab));
      }
    }
  }
  inputs.assign(in.begin(), in.end());
  targets.assign(out.begin(), out.end());
  const bool fits = tokens_ == t && shape_.vocab == shape.vocab &&
                    shape_.d_model == shape.d_model && shape_.heads == shape.heads &&
                    shape_.context == shape.context && shape_.blocks == shape.blocks &&
                    (training_buffers_ || !shape.training);
  shape_ = shape;
  tokens_ = t;
  if (fits) return;  // the previous batch's buffers
  // Another shape: zeros of it, in the memory the buffers have where it holds them (an
  // evaluation's shorter last batch, and the training batch after it, touch none anew).
  training_buffers_ = shape.training;
  const std::int64_t d = shape.d_model;
  blocks.resize(static_cast<std::size_t>(shape.blocks));
  const auto tokens = static_cast<std::size_t>(t);
  for (Block& b : blocks) {
    for (DenseMatrix* m : {&b.x, &b.n1, &b.q, &b.k, &b.v, &b.att, &b.mid, &b.n2}) {
      m->resize(d, t);
    }
    b.u.resize(4 * d, t);
    b.h.resize(4 * d, t);
    for (auto* v : {&b.mean1, &b.inv1, &b.mean2, &b.inv2}) v->assign(tokens, 0.0F);
    b.probabilities.assign(static_cast<std::size_t>(attention_probabilities_size(t, attention())),
                           0.0F);
  }
  x_out.resize(d, t);
  nf.resize(d, t);
  logits.resize(shape.vocab, t);
  mean_f.assign(tokens, 0.0F);
  inv_f.assign(tokens, 0.0F);
  d_logits.resize(shape.training ? shape.vocab : 0, shape.training ? t : 0);
  const std::int64_t bt = shape.training ? t : 0;
  for (DenseMatrix* m : {&dnf, &dx, &dn, &dmid, &datt, &dq, &dk, &dv}) m->resize(d, bt);
  dh.resize(4 * d, bt);
  du.resize(4 * d, bt);
}

}  // namespace sluice
