#include "engine/plan.hpp"

namespace sluice::detail {
namespace {

// The steps a plan can pick, one per kernel format. fp32: fp32 packets, fp32 activations.
// bf16 held: bf16 packets, activations held in bf16. bf16 packets: bf16 packets read as
// they are, activations in fp32.

void forward_fp32(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane,
                  std::uint32_t first, std::uint32_t count, const HeldTile& x, MutableTile y,
                  std::int64_t width) {
  k.fp32.forward(chunk.runs<Packet>(lane, first, count), x.fp32, y, width);
}
void forward_bf16_held(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane,
                       std::uint32_t first, std::uint32_t count, const HeldTile& x, MutableTile y,
                       std::int64_t width) {
  k.bf16.forward(chunk.runs<Bf16Packet>(lane, first, count), x.bf16, y, width);
}
void forward_bf16_packets(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane,
                          std::uint32_t first, std::uint32_t count, const HeldTile& x,
                          MutableTile y, std::int64_t width) {
  k.fp32.forward_bf16_packets(chunk.runs<Bf16Packet>(lane, first, count), x.fp32, y, width);
}

void data_fp32(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane, Tile dy,
               MutableTile dx, std::int64_t width) {
  k.fp32.backward_data(chunk.runs<Packet>(lane), dy, dx, width);
}
void data_bf16(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane, Tile dy,
               MutableTile dx, std::int64_t width) {
  k.bf16.backward_data(chunk.runs<Bf16Packet>(lane), dy, dx, width);
}

void weight_fp32(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane, Tile dy,
                 const HeldTile& x, const GradientSums& sums, std::int64_t width) {
  k.fp32.backward_weight(chunk.runs<Packet>(lane), dy, x.fp32, sums, width);
}
void weight_bf16_held(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane, Tile dy,
                      const HeldTile& x, const GradientSums& sums, std::int64_t width) {
  k.bf16.backward_weight(chunk.runs<Bf16Packet>(lane), dy, x.bf16, sums, width);
}
void weight_bf16_packets(const KernelTables& k, const TakenChunk& chunk, std::int32_t lane, Tile dy,
                         const HeldTile& x, const GradientSums& sums, std::int64_t width) {
  k.fp32.backward_weight_bf16_packets(chunk.runs<Bf16Packet>(lane), dy, x.fp32, sums, width);
}

void by_input_fp32(const KernelTables& k, const TakenChunk& chunk, const HeldTile& dy, Tile x,
                   MutableTile dx, const GradientSums& sums, std::int64_t width) {
  k.by_input.fp32(chunk.runs<Packet>(0), dy.fp32, x, dx, sums, width);
}
void by_input_bf16_held(const KernelTables& k, const TakenChunk& chunk, const HeldTile& dy, Tile x,
                        MutableTile dx, const GradientSums& sums, std::int64_t width) {
  k.by_input.bf16_held(chunk.runs<Bf16Packet>(0), dy.bf16, x, dx, sums, width);
}
void by_input_bf16_packets(const KernelTables& k, const TakenChunk& chunk, const HeldTile& dy,
                           Tile x, MutableTile dx, const GradientSums& sums, std::int64_t width) {
  k.by_input.bf16(chunk.runs<Bf16Packet>(0), dy.fp32, x, dx, sums, width);
}

// Plain loops over plain pointers, so they vectorise.
void copy_tags_fp32(const StreamChunk& chunk, Packet* to, std::uint32_t k, std::uint32_t end) {
  const Packet* from = chunk.packets.data();
  for (; k < end; ++k) to[k] = {from[k].tag, 0.0F};
}
void copy_tags_bf16(const StreamChunk& chunk, Packet* to, std::uint32_t k, std::uint32_t end) {
  const Bf16Packet* from = chunk.packets_bf16.data();
  for (; k < end; ++k) to[k] = {tag_of(from[k]), 0.0F};
}

/// One of three, as the holding says: fp32 packets, bf16 held, bf16 packets read as such.
template <typename Step>
Step pick(const Holding& h, Step fp32, Step bf16_held, Step bf16_packets) {
  return !h.bf16_stream ? fp32 : h.bf16 ? bf16_held : bf16_packets;
}

}  // namespace

ForwardPlan plan_forward(const TilingPolicy& policy, const StreamHeader& header, std::int32_t lanes,
                         std::int64_t tokens, std::int64_t outputs, Intake& intake) {
  ForwardPlan plan;
  plan.holding = holding_for(lanes, header, tokens);
  plan.tiling =
      make_tiling(tokens, policy.resolve(tokens, lanes, plan.holding.precision(), header.nnz));
  plan.schedule = lanes > 1 ? ForwardSchedule::lanes_in_ring
                  : outputs > 0 && policy.takes_in_as_it_goes(plan.tiling, intake)
                      ? ForwardSchedule::taken_as_computed
                      : ForwardSchedule::one_lane_pieces;
  plan.step = pick(plan.holding, &forward_fp32, &forward_bf16_held, &forward_bf16_packets);
  return plan;
}

BackwardPlan plan_backward(const TilingPolicy& policy, const StreamHeader& header,
                           std::int32_t lanes, std::int64_t tokens) {
  // By output, the lanes hold rows of dX or X, the stream's tags; by input, one lane holds
  // all of dY, the stream's tags again, and walks the input features as the runs. A bf16
  // layer holds what it packs in bf16: X by output, dY by input (halving the bytes each
  // weight gathers; dX, X and every sum stay fp32).
  BackwardPlan plan{};
  plan.by_input = header.by_input();
  plan.holding = holding_for(lanes, header, tokens);
  plan.data_tiling =
      make_tiling(tokens, policy.resolve(tokens, lanes, Precision::fp32, header.nnz));
  plan.weight_tiling =
      make_tiling(tokens, policy.resolve(tokens, lanes, plan.holding.precision(), header.nnz));
  plan.data_step = plan.holding.bf16_stream ? &data_bf16 : &data_fp32;
  plan.weight_step = pick(plan.holding, &weight_fp32, &weight_bf16_held, &weight_bf16_packets);
  plan.by_input_step =
      pick(plan.holding, &by_input_fp32, &by_input_bf16_held, &by_input_bf16_packets);
  plan.copy_tags = plan.holding.bf16_stream ? &copy_tags_bf16 : &copy_tags_fp32;
  return plan;
}

void complete_backward_plan(BackwardPlan& plan, const TilingPolicy& policy, std::int32_t lanes,
                            bool want_grad, Intake& intake) {
  // By input each run's dX row has one writer either way; shares give each weight one too.
  if (want_grad || plan.by_input) policy.prefer_shares(plan.weight_tiling, lanes, intake);
  plan.taken_as_computed = plan.by_input && policy.takes_in_as_it_goes(plan.weight_tiling, intake);
  plan.direct = lanes == 1 && plan.weight_tiling.blocks == 1;
}

}  // namespace sluice::detail
