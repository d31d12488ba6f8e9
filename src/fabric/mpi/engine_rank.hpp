#pragma once
// An engine rank's side of MpiFabric: one CpuEngine, served until rank 0 says stop. The
// main thread takes commands, receives each weight stream's frames and passes them to the
// engine on its worker thread; the engine's activations stay here for the whole step.
// Internal.
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/engine_worker.hpp"
#include "fabric/mpi/frame_channel.hpp"
#include "fabric/mpi/gradient_tree.hpp"
#include "fabric/mpi/link.hpp"
#include "fabric/mpi/wire.hpp"
#include "sluice/dataset.hpp"
#include "sluice/engine.hpp"

namespace sluice::mpi {

class EngineRank {
 public:
  EngineRank(Link& link, FrameOptions frames, std::int64_t driver_pid, GradientTree& tree,
             std::unique_ptr<CpuEngine> engine);

  CpuEngine& engine() { return *engine_; }
  /// Serves commands until stop; `dataset` (may be null) is what load_samples reads.
  void serve(const Dataset* dataset);

 private:
  void serve_one(const Command& cmd);
  void serve_layer_op(const Command& cmd);
  void serve_load(const Command& cmd);
  void serve_samples(const Command& cmd);
  void serve_layer(const Command& cmd);
  void serve_load_tokens(const Command& cmd);
  void serve_block(const Command& cmd);
  void serve_block_logits(const Command& cmd);
  void serve_growth(const Command& cmd);
  Job receive_job(std::uint32_t inputs, Placement& placement);
  DenseMatrix receive_matrix(std::int64_t rows, std::int64_t cols);
  void send_matrix(const DenseMatrix* m);
  PassSpec receive_spec(const Command& cmd);
  template <typename Fn>
  void run_on_stream(const Command& cmd, const StreamHeader& header, Fn&& fn);
  /// Runs fn() on the engine's thread while this one waits (and answers peer pings).
  template <typename Fn>
  void run_on_engine(Fn&& fn);
  void reply(const EngineCounters& before, const WeightStream* gradient);

  Link* link_;
  FrameReceiver frames_;
  std::size_t channel_chunks_;
  GradientTree* tree_;
  std::unique_ptr<CpuEngine> engine_;
  detail::EngineWorker worker_;
  const Dataset* dataset_ = nullptr;
};

}  // namespace sluice::mpi
