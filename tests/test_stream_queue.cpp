// The executor's StreamQueue: which streams are opened ahead of the engines, and when;
// and a LayerStream's producer, counted as background work while it runs.
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "core/background_work.hpp"
#include "executor/layer_stream.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::detail {
namespace {

// A queue whose opener records the order of the streams it opened (no streams are made:
// the queue's bookkeeping never looks into them).
struct Recorded {
  std::vector<std::size_t> opened;
  StreamQueue queue(std::vector<std::int64_t> packets, std::int64_t ahead) {
    return StreamQueue(std::move(packets), ahead, [this](std::size_t i) {
      opened.push_back(i);
      return std::unique_ptr<LayerStream>();
    });
  }
};

TEST(StreamQueue, OpensALargestLayerAheadAcrossSmallLayers) {
  // A step of a 4-layer model: forward 0..3, backward 3..0; layers 1 and 2 are large.
  Recorded r;
  StreamQueue q = r.queue({10, 100, 100, 5, 5, 100, 100, 10}, 100);
  q.take();  // forward 0: forward 1 ahead
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1}));
  q.take();  // forward 1: forward 2 is a whole layer
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1, 2}));
  q.take();  // forward 2: the small forward 3 and backward 3, then backward 2
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1, 2, 3, 4, 5}));
  q.take();  // forward 3: backward 3 and 2 are still ahead, 105 packets
  EXPECT_EQ(r.opened.size(), 6U);
  q.take();  // backward 3: backward 2 ahead suffices
  EXPECT_EQ(r.opened.size(), 6U);
  q.take();  // backward 2: backward 1
  EXPECT_EQ(r.opened.size(), 7U);
  q.take();
  q.take();
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(StreamQueue, WithoutABudgetOpensOneAheadAndOnlyWhenAsked) {
  Recorded r;
  StreamQueue q = r.queue({10, 100, 100, 10}, 0);
  q.take();
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1}));
  q.take(false);  // taken, nothing opened after it until fill()
  EXPECT_EQ(r.opened.size(), 2U);
  q.fill();
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1, 2}));
  q.fill();  // one ahead already
  EXPECT_EQ(r.opened.size(), 3U);
  q.take(false);
  q.take(false);  // nothing ahead: opened when taken
  EXPECT_EQ(r.opened, (std::vector<std::size_t>{0, 1, 2, 3}));
}

// An MPI fabric's waits sleep rather than yield while ModelMemory's producers run
// (link.cpp): a producer blocked on its full channel is still running.
TEST(LayerStream, ItsProducerCountsAsBackgroundWorkUntilItEnds) {
  HostModelMemory memory;
  memory.add_layer(CsrMatrix::random(64, 64, 0.5, 7));
  ASSERT_FALSE(background_work_running());
  Producers idle;
  {
    LayerStream stream(memory, 0, StreamKind::weights, /*depth=*/1, /*chunk_packets=*/16,
                       Precision::fp32, StreamOrder::by_output, idle);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!background_work_running() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_TRUE(background_work_running());
    ASSERT_NE(stream.metered.next(), nullptr);
  }  // drains the channel and waits for the producer
  EXPECT_FALSE(background_work_running());
}

}  // namespace
}  // namespace sluice::detail
