#pragma once
// The distributed fabric over MPI. Rank 0 of the communicator hosts ModelMemory and the
// executor; ranks 1..N-1 host one CpuEngine each (engine k lives on rank k + 1) and run
// serve() until rank 0 stops them.
//
// Every fabric operation starts with a small command broadcast from rank 0. Then rank 0
// scatters each engine's token slice of X (and of dY in backward) and its placement, and
// sends the weight stream in frames of whole chunks, several frames in flight (each frame's
// broadcast carries the next one's sizes, so engines post ahead); a bf16 stream's chunks
// travel as their 4-byte packets, half the bytes of fp32 ones. Between nodes a frame is one
// MPI_Ibcast over the chunks' own buffers. When every rank shares rank 0's node (and
// shared_memory, and the OS lets a process read another's memory, checked at
// construction), engines instead read each frame straight out of rank 0's memory
// (process_vm_readv: one copy, by the engine, as Open MPI does for a contiguous message;
// it pins every page it reads, which chunks in huge pages make cheap, see ChunkAllocator)
// and tell rank 0 when they have; only sizes and addresses are broadcast. Open MPI moves a
// frame of several buffers through bounce buffers (rank 0 copies in, the engine copies
// out, every 32 KB), which needs both ranks running at once and collapses whenever
// the engine's threads or anything else take a core. Engine ranks receive on their main thread and
// hand whole frames to their engine (on a worker thread) through a bounded channel, so transfer and
// compute overlap. Results come back to rank 0: Y and dX by MPI_Gatherv. Gradient streams come back
// as values only (4 bytes per weight): rank 0 sent the tags and control packets, so it lays them
// out itself. The engines sum their values along reduce_gradients' fixed pairwise tree (engine k
// absorbs k + 1, k + 2, k + 4, ...), segment by segment and pipelined, and engine 0 passes the sum
// to rank 0 (through a shared-memory window when they share a node, see MpiFabricOptions); each
// engine also sends a checksum (CRC-32C) of its gradient stream's tags and control packets, which
// rank 0 compares with that of the stream it sent (FormatError naming the rank if they differ).
// Bias gradients are summed in the same tree order. So N - 1 MPI engines compute bit for bit what a
// LocalFabric of N - 1 engines with the same engine options computes, and every run the same.
//
// A failure in the middle of an operation cannot be reported to the other ranks without
// leaving them blocked in a collective, so it prints "sluice[rank r]: <what>" to stderr
// and calls MPI_Abort (see abort_all_ranks).
#include <mpi.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <span>

#include "sluice/engine.hpp"
#include "sluice/fabric.hpp"

namespace sluice {

struct MpiFabricOptions {
  /// All ranks of this communicator take part: rank 0 drives, the others are engines.
  MPI_Comm comm = MPI_COMM_WORLD;
  /// Options of every engine (taken from rank 0); threads 0 = the cores of the engine's
  /// node divided by the number of ranks on that node.
  EngineOptions engine;
  /// Stream frames rank 0 keeps in flight (and engine ranks keep posted).
  std::size_t window = 4;
  /// Chunks are grouped into frames of about this many bytes (at most 64 chunks), one
  /// Ibcast each: fewer, larger messages than one per chunk. An operation's first frames
  /// are smaller (256 KB, doubling), so that the engines start sooner.
  std::size_t frame_bytes = std::size_t{4} << 20;
  /// When engine 0 shares rank 0's node, the summed gradient's last hop is a shared-memory
  /// window (engine 0 writes the sum where rank 0 reads it, nothing is copied), and when
  /// all ranks share it, engines may read the stream from rank 0's memory (see above);
  /// false: both by messages, as between nodes. Taken from rank 0.
  bool shared_memory = true;
  /// Seconds a rank waits on the others without any progress before it calls the roll:
  /// it asks every other rank whether it is there (they answer from inside their own
  /// waits), and if one does not answer within a few seconds, prints "sluice[rank r]:
  /// MpiFabric: peer timeout: rank s ... has not answered" and ends the job (MPI_Abort,
  /// exit code 1) instead of hanging. If every rank answers, the job is slow, not
  /// stalled, and the wait goes on. A rank busy outside the fabric (its own work between
  /// operations) for longer than this counts as silent. 0: wait forever.
  double peer_timeout_seconds = 60;
};

/// Collective over options.comm: every rank constructs one, with the same options.
/// Needs MPI initialised with at least MPI_THREAD_FUNNELED on engine ranks and
/// MPI_THREAD_SERIALIZED on rank 0 (the executor may call from another thread), and at
/// least two ranks (UnsupportedError without the thread support, else ArgumentError).
class MpiFabric final : public Fabric {
 public:
  explicit MpiFabric(MpiFabricOptions options = {});
  /// On rank 0: stops the engine ranks (as stop() does) if that was not done yet.
  ~MpiFabric() override;
  MpiFabric(const MpiFabric&) = delete;
  MpiFabric& operator=(const MpiFabric&) = delete;

  int rank() const;
  bool is_driver() const { return rank() == 0; }

  /// Engine ranks: runs the engine until rank 0 calls stop(). Errors abort every rank.
  void serve();
  /// Rank 0: tells the engine ranks to return from serve(). Idempotent.
  void stop();

  /// Rank 0, for benchmarks and link checks: broadcasts `stream` to every engine rank as
  /// forward() does, but the ranks take it in without an engine. With `echo`, each rank
  /// returns the stream's values (in fp32) as its gradient and rank 0 sums them as
  /// backward() does (weights only); without, the result is empty.
  ReducedGradient probe(StreamSource& stream, bool echo);

  /// Rank 0, for benchmarks: seconds the last backward() or echo probe() took to return
  /// the gradients, from the moment every engine had its gradient stream to the summed,
  /// checked stream on rank 0.
  double last_gradient_seconds() const;

 protected:
  std::int32_t engine_count_impl() const override;
  Engine& engine_impl(std::int32_t k) override;
  void forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                    std::span<const ConstMatrixView> xs,
                    std::span<const MutableMatrixView> ys) override;
  ReducedGradient backward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                                std::span<const ConstMatrixView> xs,
                                std::span<const ConstMatrixView> dys,
                                std::span<MutableMatrixView* const> dxs, bool with_bias) override;
  void load_batch_impl(const PassSpec& spec, const ShardData& batch) override;
  void load_samples_impl(const PassSpec& spec, std::span<const std::int64_t> indices) override;
  void forward_layer_impl(StreamSource& weights, std::span<const Placement* const> placements,
                          std::int32_t layer, std::span<const float> bias) override;
  std::vector<LossSums> loss_impl(bool want_delta, std::int64_t total_tokens) override;
  ReducedGradient backward_layer_impl(StreamSource& weights,
                                      std::span<const Placement* const> placements,
                                      std::int32_t layer, bool want_dx, bool with_bias) override;
  DenseMatrix gather_output_impl() override;
  void layer_activations_impl(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                              std::vector<ConstMatrixView>& dzs) override;
  std::vector<std::int64_t> growth_top_k_impl(const GrowthSource& source, const CsrMatrix& mask,
                                              std::int64_t k) override;
  void load_tokens_impl(const BlockShape& shape, std::span<const std::int32_t> inputs,
                        std::span<const std::int32_t> targets) override;
  BlockResult run_block_impl(const BlockCall& call, StreamSource* weights,
                             std::span<const Placement* const> placements,
                             std::span<const float> bias) override;
  std::vector<float> block_logits_impl(std::int64_t token) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Prints "sluice[rank r]: <what>" to stderr and ends every rank of MPI_COMM_WORLD with
/// MPI_Abort(MPI_COMM_WORLD, 1). For a rank's top-level catch, so no rank hangs waiting
/// for one that has failed.
[[noreturn]] void abort_all_ranks(const char* what);
[[noreturn]] void abort_all_ranks(const std::exception& error);

}  // namespace sluice
