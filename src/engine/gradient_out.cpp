#include "engine/gradient_out.hpp"

#include "core/huge_pages.hpp"
#include "core/parallel.hpp"
#include "sluice/error.hpp"
#include "stream/stream_check.hpp"

namespace sluice::detail {

GradientOut::GradientOut(EngineState& engine, const BackwardPlan& plan, std::int32_t lanes,
                         const std::vector<TakenChunk>& chunks, const StreamHeader& header)
    : engine_(engine),
      plan_(plan),
      lanes_(lanes),
      blocks_(plan.weight_tiling.blocks),
      chunks_(chunks),
      most_chunks_(chunks.capacity()),
      block_packets_(header.nnz + header.outputs + 1),
      gradient_(most_chunks_),
      partials_(static_cast<std::size_t>(blocks_), std::vector<float*>(most_chunks_)) {
  const std::size_t wanted = static_cast<std::size_t>(blocks_) * block_packets_;
  if (engine.gradient_scratch.size() < wanted)
    resize_for_overwrite(engine.gradient_scratch, wanted);
}

void GradientOut::add(std::size_t c) {
  const StreamChunk& chunk = *chunks_[c].chunk;
  if (added_packets_ + chunk.size() > block_packets_) {
    throw FormatError(describe_chunk(chunk, c) + ": the stream carries more packets than its " +
                      "header's weights, a carriage return per output and an end");
  }
  gradient_[c] = engine_.gradient_chunks->take(c + 1);  // (the pool keeps a stream's worth)
  gradient_[c]->first_output = chunk.first_output;
  gradient_[c]->outputs = chunk.outputs;
  gradient_[c]->packets.resize(chunk.size());
  for (std::int32_t q = 0; q < blocks_; ++q) {
    partials_[static_cast<std::size_t>(q)][c] = engine_.gradient_scratch.data() +
                                                static_cast<std::size_t>(q) * block_packets_ +
                                                added_packets_;
  }
  added_packets_ += chunk.size();
}

void GradientOut::write_controls(std::size_t c) const {
  const LaneShare& runs = chunks_[c].lanes[0];
  const StreamChunk& chunk = *chunks_[c].chunk;
  Packet* to = gradient_[c]->packets.data();
  std::uint32_t k = 0;
  for (std::uint32_t r = 0; r < chunk.outputs; ++r) {
    plan_.copy_tags(chunk, to, k, runs.begin[r]);
    k = runs.end[r];
  }
  plan_.copy_tags(chunk, to, k, static_cast<std::uint32_t>(chunk.size()));
}

void GradientOut::lay_out(std::int64_t tokens) {
  if (plan_.direct && tokens > 0) return;  // the pass wrote every packet
  engine_.arena.execute([&] {
    parallel_for(std::size_t{0}, chunks_.size(), [&](std::size_t c) {
      Packet* to = gradient_[c]->packets.data();
      const auto n = static_cast<std::uint32_t>(gradient_[c]->packets.size());
      plan_.copy_tags(*chunks_[c].chunk, to, 0, n);
      const std::int32_t blocks = tokens > 0 ? blocks_ : 0;  // (direct here: no tokens)
      for (std::int32_t q = 0; q < blocks; ++q) {
        const float* part = partials_[q][c];
        if (lanes_ == 1) {  // in place: block q's k-th sum is packet k's (none for controls)
          for (std::uint32_t k = 0; k < n; ++k) to[k].value += is_control(to[k]) ? 0.0F : part[k];
          continue;
        }
        // routed: each lane's values go back to their packets' positions
        std::size_t off = 0;
        for (std::int32_t l = 0; l < lanes_; ++l) {
          const auto& origin = chunks_[c].lanes[l].origin;
          for (std::size_t k = 0; k < origin.size(); ++k) to[origin[k]].value += part[off + k];
          off += origin.size();
        }
      }
    });
  });
}

WeightStream GradientOut::stream(const StreamHeader& weights) const {
  WeightStream out;
  out.header = weights;
  out.header.kind = StreamKind::gradient;
  out.header.precision = Precision::fp32;
  out.chunks.assign(gradient_.begin(),
                    gradient_.begin() + static_cast<std::ptrdiff_t>(chunks_.size()));
  return out;
}

}  // namespace sluice::detail
