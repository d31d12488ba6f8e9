// The engine computes a layer's stream as it arrives: its lanes start on the first
// chunks while later ones are still being produced, with results bitwise those of the
// whole stream taken at once, and the counters say how much of the arrival they covered.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <thread>

#include "reference.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::random_dense;
using testing::thrown_message;

/// A ModelMemory that cannot keep up: makes each chunk when the engine asks for it, after
/// a pause, and first tells `before` which chunk it is about to make.
class SlowProducer final : public StreamSource {
 public:
  SlowProducer(const WeightStream& stream, std::function<void(std::size_t)> before)
      : stream_(stream), before_(std::move(before)) {}
  const StreamHeader& header() const override { return stream_.header; }
  ChunkPtr next() override {
    if (next_ == stream_.chunks.size()) return nullptr;
    before_(next_);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return stream_.chunks[next_++];
  }

 private:
  const WeightStream& stream_;
  std::function<void(std::size_t)> before_;
  std::size_t next_ = 0;
};

bool same_rows(ConstMatrixView a, ConstMatrixView b, std::int64_t first, std::int64_t count) {
  for (std::int64_t r = first; r < first + count; ++r) {
    if (std::memcmp(a.row(r), b.row(r), static_cast<std::size_t>(a.cols) * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// One engine thread, so the producer runs on the task that computes (it is asked for
// each chunk by that task, under the intake's lock): it may look at the output the task
// wrote. The first chunk's rows must be final before the last chunk is made. Taken
// whole before any lane computes, they would still hold NaN.
struct FirstKernelCase {
  const char* name;
  std::int64_t tile_cache_bytes;  // tiny: each chunk is taken in by its task
};

class FirstKernelBeforeLastChunk : public ::testing::TestWithParam<FirstKernelCase> {
 protected:
  static EngineOptions one_thread() {
    EngineOptions options;
    options.threads = 1;
    options.tile_cache_bytes = GetParam().tile_cache_bytes;
    return options;
  }
};

TEST_P(FirstKernelBeforeLastChunk, Forward) {
  const CsrMatrix w = CsrMatrix::random(500, 300, 0.9, 3);
  const DenseMatrix x = random_dense(300, 40, 4);  // one token tile
  const WeightStream s = encode_stream(w, StreamKind::weights, 256);
  ASSERT_GT(s.chunks.size(), 8U);
  const EngineOptions options = one_thread();
  const Placement placement = round_robin_placement(w, 1);
  DenseMatrix expected(500, 40);
  CpuEngine(options).forward(s, placement, x.view(), expected.view());

  CpuEngine engine(options);
  DenseMatrix y(500, 40);
  y.fill(NAN);
  const std::int64_t first_rows = s.chunks[0]->outputs;
  bool first_done_before_last = false;
  SlowProducer producer(s, [&](std::size_t c) {
    if (c + 1 == s.chunks.size()) {
      first_done_before_last = same_rows(y.view(), expected.view(), 0, first_rows);
    }
  });
  engine.forward(producer, placement, x.view(), y.view());
  EXPECT_TRUE(first_done_before_last);
  EXPECT_TRUE(same_rows(y.view(), expected.view(), 0, 500));
  const EngineCounters& n = engine.counters();
  EXPECT_GT(n.stream_arrival_seconds, 0.0);
  EXPECT_GT(n.overlapped_seconds, 0.0);
  EXPECT_LE(n.overlapped_seconds, n.stream_arrival_seconds);
}

// By input, the runs are input features: chunk 0's dX rows are final once it is computed.
TEST_P(FirstKernelBeforeLastChunk, BackwardByInput) {
  const CsrMatrix w = CsrMatrix::random(400, 350, 0.9, 5);
  const DenseMatrix x = random_dense(350, 40, 6), dy = random_dense(400, 40, 7);
  const WeightStream s =
      encode_stream(w, StreamKind::weights, 256, Precision::fp32, StreamOrder::by_input);
  ASSERT_GT(s.chunks.size(), 8U);
  const EngineOptions options = one_thread();
  const Placement placement = round_robin_placement(w, 1);
  DenseMatrix expected(350, 40);
  MutableMatrixView expected_view = expected.view();
  const WeightStream expected_g =
      CpuEngine(options).backward(s, placement, x.view(), dy.view(), &expected_view);

  CpuEngine engine(options);
  DenseMatrix dx(350, 40);
  dx.fill(NAN);
  MutableMatrixView dx_view = dx.view();
  const std::int64_t first_rows = s.chunks[0]->outputs;
  bool first_done_before_last = false;
  SlowProducer producer(s, [&](std::size_t c) {
    if (c + 1 == s.chunks.size()) {
      first_done_before_last = same_rows(dx.view(), expected.view(), 0, first_rows);
    }
  });
  const WeightStream g = engine.backward(producer, placement, x.view(), dy.view(), &dx_view);
  EXPECT_TRUE(first_done_before_last);
  EXPECT_TRUE(same_rows(dx.view(), expected.view(), 0, 350));
  ASSERT_EQ(g.chunks.size(), expected_g.chunks.size());
  for (std::size_t c = 0; c < g.chunks.size(); ++c) {
    ASSERT_EQ(g.chunks[c]->packets.size(), expected_g.chunks[c]->packets.size());
    EXPECT_EQ(0, std::memcmp(g.chunks[c]->packets.data(), expected_g.chunks[c]->packets.data(),
                             g.chunks[c]->packets.size() * sizeof(Packet)))
        << "gradient chunk " << c;
  }
  EXPECT_GT(engine.counters().overlapped_seconds, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Intakes, FirstKernelBeforeLastChunk,
                         ::testing::Values(FirstKernelCase{"TakenByThePuller", 0},
                                           FirstKernelCase{"TakenByTheirTasks", 1024}),
                         [](const auto& info) { return std::string(info.param.name); });

/// Feeds a channel from a thread of its own at an uneven pace.
class JitteryFeed {
 public:
  JitteryFeed(const WeightStream& s, std::uint64_t seed, std::size_t fail_at = SIZE_MAX)
      : channel_(3), thread_([this, &s, seed, fail_at] {
          std::mt19937_64 rng(seed);
          for (std::size_t c = 0; c < s.chunks.size(); ++c) {
            if (c == fail_at) {
              channel_.fail(std::make_exception_ptr(std::runtime_error("model memory failed")));
              return;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
            channel_.push(s.chunks[c]);
          }
          channel_.close();
        }) {}
  ~JitteryFeed() { thread_.join(); }
  StreamChannel& channel() { return channel_; }

 private:
  StreamChannel channel_;
  std::thread thread_;
};

// Two threads and a live channel: whichever task computes which chunk when, the bits
// are those of the whole stream in memory (forward with token blocks and tiles, backward
// by input with shares claiming chunks, and with blocks).
TEST(EngineStreaming, LiveChannelsGiveTheBitsOfTheWholeStream) {
  const CsrMatrix w = CsrMatrix::random(700, 450, 0.9, 8, RowDistribution::powerlaw);
  EngineOptions options;
  options.threads = 2;
  CpuEngine engine(options);
  const Placement placement = round_robin_placement(w, 1);
  std::uint64_t seed = 100;
  for (std::int64_t tokens : {7, 40, 200}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    const DenseMatrix x = random_dense(450, tokens, 9), dy = random_dense(700, tokens, 10);
    for (std::size_t chunk : {std::size_t{64}, std::size_t{1000}}) {
      const WeightStream fwd = encode_stream(w, StreamKind::weights, chunk);
      const WeightStream bwd =
          encode_stream(w, StreamKind::weights, chunk, Precision::fp32, StreamOrder::by_input);
      DenseMatrix y0(700, tokens), dx0(450, tokens);
      MutableMatrixView dx0_view = dx0.view();
      engine.forward(fwd, placement, x.view(), y0.view());
      const WeightStream g0 = engine.backward(bwd, placement, x.view(), dy.view(), &dx0_view);
      for (int round = 0; round < 2; ++round) {
        DenseMatrix y(700, tokens), dx(450, tokens);
        MutableMatrixView dx_view = dx.view();
        {
          JitteryFeed feed(fwd, ++seed);
          ChannelStreamSource source(fwd.header, feed.channel());
          engine.forward(source, placement, x.view(), y.view());
        }
        WeightStream g;
        {
          JitteryFeed feed(bwd, ++seed);
          ChannelStreamSource source(bwd.header, feed.channel());
          g = engine.backward(source, placement, x.view(), dy.view(), &dx_view);
        }
        EXPECT_TRUE(same_rows(y.view(), y0.view(), 0, 700));
        EXPECT_TRUE(same_rows(dx.view(), dx0.view(), 0, 450));
        ASSERT_EQ(g.chunks.size(), g0.chunks.size());
        for (std::size_t c = 0; c < g.chunks.size(); ++c) {
          ASSERT_EQ(0, std::memcmp(g.chunks[c]->packets.data(), g0.chunks[c]->packets.data(),
                                   g.chunks[c]->packets.size() * sizeof(Packet)))
              << "gradient chunk " << c << " chunk packets " << chunk;
        }
      }
    }
  }
}

// A producer that fails half-way: every task that waits for a chunk sees its error, the
// product throws it, and the engine's next product is whole.
TEST(EngineStreaming, AProducerFailingHalfWayFailsTheProductOnly) {
  const CsrMatrix w = CsrMatrix::random(600, 300, 0.9, 11);
  const DenseMatrix x = random_dense(300, 100, 12), dy = random_dense(600, 100, 13);
  EngineOptions options;
  options.threads = 2;
  CpuEngine engine(options);
  const Placement placement = round_robin_placement(w, 1);
  const WeightStream fwd = encode_stream(w, StreamKind::weights, 128);
  const WeightStream bwd =
      encode_stream(w, StreamKind::weights, 128, Precision::fp32, StreamOrder::by_input);
  DenseMatrix y(600, 100), dx(300, 100);
  MutableMatrixView dx_view = dx.view();
  {
    JitteryFeed feed(fwd, 1, fwd.chunks.size() / 2);
    ChannelStreamSource source(fwd.header, feed.channel());
    EXPECT_CONTAINS(thrown_message<std::runtime_error>(
                        [&] { engine.forward(source, placement, x.view(), y.view()); }),
                    "model memory failed");
  }
  {
    JitteryFeed feed(bwd, 2, bwd.chunks.size() / 2);
    ChannelStreamSource source(bwd.header, feed.channel());
    EXPECT_CONTAINS(thrown_message<std::runtime_error>(
                        [&] { engine.backward(source, placement, x.view(), dy.view(), &dx_view); }),
                    "model memory failed");
  }
  engine.forward(fwd, placement, x.view(), y.view());
  EXPECT_LE(testing::forward_error(w, x.view(), y.view()), 1e-5);
  engine.backward(bwd, placement, x.view(), dy.view(), &dx_view);
  EXPECT_LE(testing::backward_data_error(w, dy.view(), dx.view()), 1e-5);
}

}  // namespace
}  // namespace sluice
