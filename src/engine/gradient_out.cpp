#include "engine/gradient_out.hpp"

#include "core/parallel.hpp"

namespace sluice::detail {

GradientOut::GradientOut(EngineState& engine, const BackwardPlan& plan, std::int32_t lanes,
                         const std::vector<TakenChunk>& chunks)
    : engine_(engine),
      plan_(plan),
      lanes_(lanes),
      blocks_(plan.weight_tiling.blocks),
      chunks_(chunks),
      gradient_(chunks.size()),
      partials_(static_cast<std::size_t>(blocks_)) {
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    gradient_[c] = engine.gradient_chunks->take(chunks.size());
    gradient_[c]->first_output = chunks[c].chunk->first_output;
    gradient_[c]->outputs = chunks[c].chunk->outputs;
    gradient_[c]->packets.resize(chunks[c].chunk->size());
  }
  std::size_t packets = 0;
  for (const auto& c : chunks) packets += c.chunk->size();
  const std::size_t wanted = static_cast<std::size_t>(blocks_) * packets;
  if (engine.gradient_scratch.size() < wanted) engine.gradient_scratch.resize(wanted);
  float* next = engine.gradient_scratch.data();
  for (auto& per_chunk : partials_) {
    for (const auto& c : chunks) {
      per_chunk.push_back(next);
      next += c.chunk->size();
    }
  }
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
  out.chunks.assign(gradient_.begin(), gradient_.end());
  return out;
}

}  // namespace sluice::detail
