// What the executor holds of the gradients beside the ModelMemory: each layer's gradient
// stream is released once its submit_gradient returns, and over a ModelMemory in bounded
// RAM (ram_budget_bytes > 0) the backward opens a layer's stream only once the gradient
// two layers up is submitted, so at most one gradient waits while the next is computed.
// Checked on the order of events a ModelMemory sees, never on timings or RSS.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/optimizer.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

/// A HostModelMemory behind the public interface, with a RAM budget of its choice, that
/// logs backward streams and submissions and keeps a weak reference to every gradient.
class LoggingMemory final : public ModelMemory {
 public:
  explicit LoggingMemory(std::int64_t ram_budget) : ram_budget_(ram_budget) {}

  struct Event {
    enum Kind { backward_stream, submit_begin, submit_end } kind;
    std::int32_t layer;
  };
  std::vector<Event> events() const {
    const std::lock_guard lock(mutex_);
    return events_;
  }
  /// Gradients submitted before another one began whose chunks were still alive then.
  int gradients_alive_at_a_later_submit() const { return alive_; }
  HostModelMemory& inner() { return inner_; }

 protected:
  std::int32_t add_layer_impl(CsrMatrix weights, std::vector<float> bias) override {
    return inner_.add_layer(std::move(weights), std::move(bias));
  }
  std::int32_t layer_count_impl() const override { return inner_.layer_count(); }
  LayerShape layer_shape_impl(std::int32_t layer) const override {
    return inner_.layer_shape(layer);
  }
  const CsrMatrix& weights_impl(std::int32_t layer) const override { return inner_.weights(layer); }
  const std::vector<float>& bias_impl(std::int32_t layer) const override {
    return inner_.bias(layer);
  }
  const Placement& placement_impl(std::int32_t layer, std::int32_t lanes) override {
    return inner_.placement(layer, lanes);
  }
  const TransposedPattern& transposed_impl(std::int32_t layer) const override {
    return inner_.transposed(layer);
  }
  void stream_to_impl(std::int32_t layer, StreamKind kind, StreamChannel& channel,
                      std::size_t chunk_packets, Precision precision,
                      StreamOrder order) const override {
    if (kind == StreamKind::mask || order == StreamOrder::by_input) {
      log({Event::backward_stream, layer});
    }
    inner_.stream_to(layer, kind, channel, chunk_packets, precision, order);
  }
  void submit_gradient_impl(std::int32_t layer, const WeightStream& gradient,
                            std::span<const float> bias_gradient) override {
    log({Event::submit_begin, layer});
    {
      const std::lock_guard lock(mutex_);
      for (const auto& g : submitted_) alive_ += g.expired() ? 0 : 1;
      submitted_.push_back(gradient.chunks.front());
    }
    inner_.submit_gradient(layer, gradient, bias_gradient);
    log({Event::submit_end, layer});
  }
  StepReport commit_step_impl() override {
    submitted_.clear();
    return inner_.commit_step();
  }
  void discard_step_impl() override { inner_.discard_step(); }
  void discard_gradient_impl(std::int32_t layer) override { inner_.discard_gradient(layer); }
  void set_optimizer_impl(const OptimizerConfig& config) override { inner_.set_optimizer(config); }
  const OptimizerConfig& optimizer_impl() const override { return inner_.optimizer(); }
  void set_non_finite_policy_impl(NonFinitePolicy policy) override {
    inner_.set_non_finite_policy(policy);
  }
  std::int64_t step_impl() const override { return inner_.step(); }
  void save_impl(const std::filesystem::path& path) const override { inner_.save(path); }
  void load_impl(const std::filesystem::path& path) override { inner_.load(path); }
  std::int64_t ram_budget_bytes_impl() const override { return ram_budget_; }
  void reserve_ram_bytes_impl(std::int64_t bytes) override { reserved = bytes; }
  std::int64_t reservable_ram_bytes_impl() const override {
    return reservable >= 0 ? reservable : ram_budget_;
  }

 public:
  std::int64_t reserved = -1;    ///< what the executor reserved, -1 if it did not
  std::int64_t reservable = -1;  ///< what it may reserve, -1: the whole budget

 private:
  void log(Event e) const {
    const std::lock_guard lock(mutex_);
    events_.push_back(e);
  }
  HostModelMemory inner_;
  std::int64_t ram_budget_;
  mutable std::mutex mutex_;
  mutable std::vector<Event> events_;
  std::vector<std::weak_ptr<const StreamChunk>> submitted_;
  int alive_ = 0;
};

const std::vector<std::int64_t> kSizes = {9, 21, 17, 19, 13, 7};

// Trains `memory` a few steps on seeded data and returns its layers' values.
std::vector<std::vector<float>> train(ModelMemory& memory, HostModelMemory& weights) {
  build_sparse_mlp(memory, kSizes, 0.4, 11);
  OptimizerConfig adam;
  adam.kind = OptimizerKind::adam;
  adam.learning_rate = 0.01;
  memory.set_optimizer(adam);
  LocalFabric fabric(LocalFabricOptions{});
  ExecutorOptions options;
  options.chunk_packets = 16;  // several chunks per layer
  LayerStreamingExecutor exec(memory, fabric, options);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (int step = 0; step < 3; ++step) {
    DenseMatrix x(kSizes.front(), 10);
    std::vector<int> labels;
    for (std::int64_t t = 0; t < 10; ++t) {
      for (std::int64_t f = 0; f < kSizes.front(); ++f) x(f, t) = normal(rng);
      labels.push_back(static_cast<int>(t % kSizes.back()));
    }
    exec.train_step({x.view(), labels, {}});
  }
  std::vector<std::vector<float>> values;
  for (std::int32_t l = 0; l < weights.layer_count(); ++l) {
    values.push_back(weights.weights(l).values());
  }
  return values;
}

TEST(ExecutorGradientMemory, AGradientIsReleasedWhenItsSubmissionReturns) {
  for (const std::int64_t budget : {std::int64_t{0}, std::int64_t{1} << 30}) {
    LoggingMemory memory(budget);
    train(memory, memory.inner());
    EXPECT_EQ(memory.gradients_alive_at_a_later_submit(), 0) << "RAM budget " << budget;
  }
}

TEST(ExecutorGradientMemory, BoundedRamOpensALayersBackwardOnlyOnceTheGradientTwoUpIsIn) {
  LoggingMemory memory(std::int64_t{1} << 30);
  train(memory, memory.inner());
  const auto layers = static_cast<std::int32_t>(kSizes.size()) - 1;
  const std::vector<LoggingMemory::Event> events = memory.events();
  int checked = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (events[i].kind != LoggingMemory::Event::backward_stream) continue;
    const std::int32_t l = events[i].layer;
    if (l + 2 >= layers) continue;
    // The last submit_end of layer l + 2 before this stream, and no submit_begin of it
    // after the one that ended (the same step's).
    bool ended = false;
    for (std::size_t j = i; j-- > 0;) {
      if (events[j].layer != l + 2) continue;
      if (events[j].kind == LoggingMemory::Event::submit_end) ended = true;
      if (events[j].kind != LoggingMemory::Event::backward_stream) break;
    }
    EXPECT_TRUE(ended) << "layer " << l << "'s backward stream opened at event " << i
                       << " before layer " << l + 2 << "'s gradient was submitted";
    ++checked;
  }
  EXPECT_EQ(checked, 3 * (layers - 2));  // every step, every layer below the top two
}

// The executor reserves what a step holds beside a bounded ModelMemory: at least the
// largest layer's stream, its gradient and the gradient being submitted.
TEST(ExecutorGradientMemory, ReservesItsStreamsOutOfABoundedBudgetOnly) {
  LoggingMemory unbounded(0), bounded(std::int64_t{1} << 30);
  train(unbounded, unbounded.inner());
  train(bounded, bounded.inner());
  EXPECT_EQ(unbounded.reserved, -1);
  std::int64_t largest = 0;
  for (std::int32_t l = 0; l < bounded.layer_count(); ++l) {
    const LayerShape w = bounded.layer_shape(l);
    largest = std::max(largest, (w.nnz + w.rows + w.cols + 1) * std::int64_t{8});
  }
  EXPECT_GE(bounded.reserved, 3 * largest);
}

// A budget without room for what the step holds beside the memory is refused, naming the
// least budget that has: the memory keeps as much as it keeps now for its own layers,
// and the executor's reserve at that budget fits beside it (and not one byte below).
TEST(ExecutorGradientMemory, ABudgetWithoutRoomForItsStreamsIsRefusedNamingTheLeast) {
  const std::int64_t budget = std::int64_t{1} << 20;
  LoggingMemory memory(budget);
  build_sparse_mlp(memory, kSizes, 0.4, 11);
  memory.reservable = 100;
  LocalFabric fabric(LocalFabricOptions{});
  ExecutorOptions options;
  options.chunk_packets = 16;
  const std::string message = testing::thrown_message<ResourceError>(
      [&] { LayerStreamingExecutor(memory, fabric, options); });
  EXPECT_EQ(memory.reserved, -1);
  const std::string least_words = "a budget of at least ";
  const std::size_t at = message.find(least_words);
  ASSERT_NE(at, std::string::npos) << message;
  const std::int64_t least = std::stoll(message.substr(at + least_words.size()));
  std::vector<LayerShape> shapes;
  for (std::int32_t l = 0; l < memory.layer_count(); ++l) shapes.push_back(memory.layer_shape(l));
  const std::int64_t own = budget - memory.reservable;
  const auto beside = [&](std::int64_t b) {
    return executor_ram_beside_memory(shapes, options, fabric.engine_count(), b);
  };
  EXPECT_LE(own + beside(least), least);
  EXPECT_GT(own + beside(least - 1), least - 1);
  memory.reservable = beside(budget);  // exactly enough
  LayerStreamingExecutor fits(memory, fabric, options);
  EXPECT_EQ(memory.reserved, beside(budget));
}

TEST(ExecutorGradientMemory, BoundedRamTrainsBitForBitAsUnbounded) {
  LoggingMemory bounded(std::int64_t{1} << 30);
  HostModelMemory plain;
  const auto a = train(bounded, bounded.inner());
  const auto b = train(plain, plain);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t l = 0; l < a.size(); ++l) {
    ASSERT_EQ(a[l].size(), b[l].size());
    EXPECT_EQ(std::memcmp(a[l].data(), b[l].data(), a[l].size() * sizeof(float)), 0) << l;
  }
}

}  // namespace
}  // namespace sluice
