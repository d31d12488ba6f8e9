#pragma once
// The gradient sum over MPI. Only the weight packets' values travel (rank 0 sent the tags
// and control packets, so it lays them out itself): the engines sum theirs along the
// fabrics' fixed pairwise tree (src/gradient_tree.hpp: engine k absorbs k + 1, k + 2,
// k + 4, ..., so the float additions are LocalFabric's, bit for bit), pipelined in
// segments, and engine 0 hands the sum to rank 0 — through a shared-memory window when
// they share a node, by message otherwise. Each engine's tag checksum, and the counts and
// headers in its reply, are checked against the stream rank 0 sent, once, on rank 0.
// Internal.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kernels/gradient_layout.hpp"
#include "fabric/mpi/frame_channel.hpp"
#include "fabric/mpi/link.hpp"
#include "fabric/mpi/wire.hpp"
#include "stream/chunk_pool.hpp"

namespace sluice::mpi {

class GradientTree {
 public:
  /// `pair`: ranks 0 and 1 when they share a node (and shared memory is allowed), for the
  /// window; MPI_COMM_NULL: the last hop is a message.
  GradientTree(Link& link, MPI_Comm pair);
  ~GradientTree();
  GradientTree(const GradientTree&) = delete;
  GradientTree& operator=(const GradientTree&) = delete;

  /// Engine ranks: this engine's part of the sum (its children's values added to its own,
  /// passed up). Returns the checksum of the stream's tags.
  std::uint32_t send(const WeightStream& gradient);
  /// Rank 0, after the engines' replies: the summed gradient stream, laid out chunk by
  /// chunk as its values arrive, and checked.
  WeightStream collect(const SentStream& sent, const std::vector<Reply>& replies);
  /// Collective on the pair; before the communicators go.
  void free_window();
  /// Rank 0: seconds the last collect took from the engines' replies to the checked sum.
  double last_seconds() const { return last_seconds_; }

 private:
  void ensure_window(std::uint64_t needed);
  void check_replies(const SentStream& sent, const std::vector<Reply>& replies) const;
  void check_checksums(const SentStream& sent);

  Link* link_;
  MPI_Comm pair_;
  // Ranks 0 and 1: a window of rank 0's into which engine 0 packs and sums its values
  // directly, so rank 0 lays out values no one copied.
  MPI_Win window_ = MPI_WIN_NULL;
  float* window_values_ = nullptr;
  std::uint64_t window_capacity_ = 0;
  bool window_failed_ = false;
  // Rank 0's sum as it arrives; an engine's own values, to which it adds its children's
  // (one buffer per child). Reused from call to call.
  std::vector<float> values_;
  std::vector<std::vector<float>> child_values_;
  // Rank 0: the chunks of the gradient streams handed out, reused once released, and how
  // each chunk is laid out (this CPU's best way).
  std::shared_ptr<detail::ChunkPool> result_pool_ = std::make_shared<detail::ChunkPool>();
  const detail::GradientLayout* layout_;
  double last_seconds_ = 0;
};

}  // namespace sluice::mpi
