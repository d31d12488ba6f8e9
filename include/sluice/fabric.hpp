#pragma once
// The Fabric (Cerebras: SwarmX) joins one ModelMemory to N engines, data parallel:
// each engine holds different tokens. Weight streams go out by broadcast (every engine
// sees the same chunks, shared, never copied); gradient streams come back by a
// sum-reduction over the engines, done as a pairwise tree in a fixed order so the
// result does not depend on which engine finished first.
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <span>
#include <vector>

#include "sluice/dense.hpp"
#include "sluice/engine.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice {
namespace detail {
class EngineWorker;
}  // namespace detail

/// One layer's gradient, summed over every engine: the weight-gradient stream (in the
/// weight stream's order) and the bias gradient (row sums of dY; empty if not asked for).
struct ReducedGradient {
  WeightStream weights;
  std::vector<float> bias;
};

/// Sums gradient streams and bias gradients as a tree: level by level, (0,1), (2,3), ...
/// so the order of additions is fixed. Every stream must have the same header and the
/// same tags in the same order (FormatError otherwise); bias vectors must agree in size.
ReducedGradient reduce_gradients(std::vector<WeightStream> streams,
                                 std::vector<std::vector<float>> biases);

/// One engine's bias gradient: the row sums of its dY, accumulated in double.
std::vector<float> bias_gradient(ConstMatrixView dy);

/// A non-blocking fabric operation. get() waits and returns (or rethrows); the destructor
/// waits too, so views handed to the operation stay in use until it has finished.
template <typename T>
class FabricRequest {
 public:
  FabricRequest() = default;
  explicit FabricRequest(std::future<T> future) : future_(std::move(future)) {}
  FabricRequest(FabricRequest&&) noexcept = default;
  FabricRequest& operator=(FabricRequest&& other) noexcept {
    if (this != &other) {
      wait();
      future_ = std::move(other.future_);
    }
    return *this;
  }
  ~FabricRequest() { wait(); }

  bool valid() const { return future_.valid(); }
  bool ready() const {
    return !future_.valid() ||
           future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  void wait() const {
    if (future_.valid()) future_.wait();
  }
  T get() { return future_.get(); }

 private:
  std::future<T> future_;
};

class Fabric {
 public:
  Fabric();
  virtual ~Fabric();

  std::int32_t engine_count() const { return engine_count_impl(); }
  Engine& engine(std::int32_t k);

  /// Broadcast forward: every engine k computes ys[k] = W xs[k] from the same stream,
  /// concurrently. `placements[k]` is engine k's placement of the layer's inputs.
  void forward(StreamSource& weights, std::span<const Placement* const> placements,
               std::span<const ConstMatrixView> xs, std::span<const MutableMatrixView> ys);
  /// The same, returning at once. Async operations run one after another, in the order
  /// issued, on a thread the fabric keeps. The engines take one operation at a time: issue
  /// them from one thread, get() a request before a blocking operation, and let every
  /// request finish before the fabric is destroyed.
  FabricRequest<void> forward_async(StreamSource& weights, std::vector<const Placement*> placements,
                                    std::vector<ConstMatrixView> xs,
                                    std::vector<MutableMatrixView> ys);

  /// Broadcast backward, then reduction: every engine k computes its weight gradient
  /// from xs[k] and dys[k] (and dX into *dxs[k] when dxs is not empty and dxs[k] is not
  /// null; a `mask` stream suffices when no dX is wanted); the fabric sums the gradient
  /// streams, and the row sums of dY when `with_bias`, into one.
  ReducedGradient backward(StreamSource& weights, std::span<const Placement* const> placements,
                           std::span<const ConstMatrixView> xs,
                           std::span<const ConstMatrixView> dys,
                           std::span<MutableMatrixView* const> dxs, bool with_bias);
  FabricRequest<ReducedGradient> backward_async(StreamSource& weights,
                                                std::vector<const Placement*> placements,
                                                std::vector<ConstMatrixView> xs,
                                                std::vector<ConstMatrixView> dys,
                                                std::vector<MutableMatrixView*> dxs,
                                                bool with_bias);

 protected:
  virtual std::int32_t engine_count_impl() const = 0;
  virtual Engine& engine_impl(std::int32_t k) = 0;
  virtual void forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                            std::span<const ConstMatrixView> xs,
                            std::span<const MutableMatrixView> ys) = 0;
  virtual ReducedGradient backward_impl(StreamSource& weights,
                                        std::span<const Placement* const> placements,
                                        std::span<const ConstMatrixView> xs,
                                        std::span<const ConstMatrixView> dys,
                                        std::span<MutableMatrixView* const> dxs,
                                        bool with_bias) = 0;

 private:
  /// Runs the async operations (made by the first; one thread for all of them, since
  /// starting a thread per operation costs more than a small layer's product).
  detail::EngineWorker& async_worker();
  std::unique_ptr<detail::EngineWorker> async_worker_;
};

struct LocalFabricOptions {
  std::int32_t engines = 1;
  /// Options of every engine; threads 0 = max(1, cores / engines), so N engines share the
  /// machine's cores instead of oversubscribing them.
  EngineOptions engine;
  /// Chunks each engine's broadcast channel may hold ahead of it.
  std::size_t channel_capacity = 4;
};

/// N CpuEngines in this process. The broadcast hands each engine the same chunk pointers
/// through its own bounded channel; engines run on their own threads.
class LocalFabric final : public Fabric {
 public:
  explicit LocalFabric(LocalFabricOptions options = {});
  ~LocalFabric() override;

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

 private:
  LocalFabricOptions options_;
  std::vector<std::unique_ptr<CpuEngine>> engines_;
  // Persistent threads that drive the engines (declared last: they stop first).
  std::vector<std::unique_ptr<detail::EngineWorker>> workers_;
};

}  // namespace sluice
