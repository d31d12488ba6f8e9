#pragma once
// Rank 0's side of MpiFabric: the driver, beside ModelMemory and the executor. Every
// operation starts with a command broadcast; from then on every rank is inside it, so a
// failure can only end the job (abort_all_ranks), never return to the caller with the
// others waiting for the rest of the protocol. Internal.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "fabric/mpi/frame_channel.hpp"
#include "fabric/mpi/gradient_tree.hpp"
#include "fabric/mpi/link.hpp"
#include "fabric/mpi/wire.hpp"
#include "sluice/engine.hpp"
#include "sluice/fabric.hpp"

namespace sluice::mpi {

class DriverRank {
 public:
  /// `twins`: an engine like each engine rank's, for placements and counters.
  DriverRank(Link& link, FrameOptions frames, GradientTree& tree,
             std::vector<std::unique_ptr<CpuEngine>> twins, FabricCounters& counters);

  Engine& twin(std::int32_t k) { return *twins_[static_cast<std::size_t>(k)]; }

  // Fabric's operations; MpiFabric has checked the arguments common to every fabric.
  void forward(StreamSource& weights, std::span<const Placement* const> placements,
               std::span<const ConstMatrixView> xs, std::span<const MutableMatrixView> ys);
  ReducedGradient backward(StreamSource& weights, std::span<const Placement* const> placements,
                           std::span<const ConstMatrixView> xs,
                           std::span<const ConstMatrixView> dys,
                           std::span<MutableMatrixView* const> dxs, bool with_bias);
  ReducedGradient probe(StreamSource& stream, bool echo);
  void load_batch(const PassSpec& spec, const ShardData& batch);
  void load_samples(const PassSpec& spec, std::span<const std::int64_t> indices);
  void forward_layer(StreamSource& weights, std::span<const Placement* const> placements,
                     std::int32_t layer, std::span<const float> bias);
  std::vector<LossSums> loss(bool want_delta, std::int64_t total_tokens);
  ReducedGradient backward_layer(StreamSource& weights,
                                 std::span<const Placement* const> placements, std::int32_t layer,
                                 bool want_dx, bool with_bias);
  DenseMatrix gather_output();
  void layer_activations(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                         std::vector<ConstMatrixView>& dzs);
  void load_tokens(const BlockShape& shape, std::span<const std::int32_t> inputs,
                   std::span<const std::int32_t> targets);
  BlockResult run_block(const BlockCall& call, StreamSource* weights,
                        std::span<const Placement* const> placements, std::span<const float> bias);
  std::vector<float> block_logits(std::int64_t token);
  /// Fabric::growth_top_k: the mask to the last engine, its candidates back.
  std::vector<std::int64_t> growth_top_k(const GrowthSource& source, const CsrMatrix& mask,
                                         std::int64_t k);
  void stop();

 private:
  std::size_t engines() const { return static_cast<std::size_t>(link_->engines()); }
  void send_command(Command& c);
  void send_stream_command(Op op, const StreamHeader& h, bool want_dx, const Frame& first,
                           Command c = {});
  void scatter_jobs(std::span<const Placement* const> placements, std::vector<Job> jobs);
  void scatter_matrices(std::span<const ConstMatrixView> ms);
  void gather_matrices(const std::vector<MutableMatrixView*>& ms);
  std::vector<Reply> gather_replies();
  /// The replies to a forward layer operation, gathered without waiting for them: the
  /// engines send them when they finish the layer, and by then the next layer's command
  /// and stream are on their way (the next command is sent without waiting for the
  /// replies, so an engine goes from one layer to the next without a round trip to rank
  /// 0). Every other command waits for them first (finish_replies), so the counters have
  /// them before any other operation.
  void start_replies();
  void finish_replies();
  void add_replies(const std::vector<Reply>& replies);
  void send_spec(const PassSpec& spec);
  void send_pass(Op op, const PassSpec& spec, std::int64_t tokens, std::int32_t flags);
  void set_shards(std::int64_t tokens, const PassSpec& spec, std::vector<int>& counts,
                  std::vector<int>& displs);
  std::vector<float> gather_bias_gradients(std::size_t outputs);
  void count_protocol();
  /// A layer operation counts its protocol bytes from zero.
  void start_layer_counts() { bytes_sent_ = bytes_received_ = 0; }

  Link* link_;
  FrameSender frames_;
  GradientTree* tree_;
  std::vector<std::unique_ptr<CpuEngine>> twins_;
  FabricCounters* counters_;
  // What the protocol itself moved (commands, placements, replies) in the current layer
  // operation, for the fabric's counters.
  std::uint64_t bytes_sent_ = 0, bytes_received_ = 0;
  // Each engine's tokens and the outputs of the batch the engines hold.
  std::vector<std::int64_t> shard_tokens_;
  std::vector<std::int64_t> sizes_;  // of the model the engines hold a batch for
  std::int64_t outputs_ = 0;
  // Each engine's tokens of the block model's batch the engines hold, and its shape.
  std::vector<std::int64_t> block_tokens_;
  BlockShape block_shape_;
  // Activations gathered for with_layer_activations, until the next call.
  std::vector<DenseMatrix> lent_;
  // The replies being gathered (start_replies), and rank 0's own (unused) entry.
  std::vector<Reply> started_replies_;
  Reply started_mine_;
  MPI_Request started_ = MPI_REQUEST_NULL;
};

}  // namespace sluice::mpi
