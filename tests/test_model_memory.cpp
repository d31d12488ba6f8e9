// HostModelMemory as a store: layers, argument checks, placements, and the weight streams
// it sends (whole, and chunk by chunk through a channel). The optimizer is in
// test_optimizer.cpp, checkpoints in test_checkpoint.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

std::vector<Packet> all_packets(const WeightStream& s) {
  std::vector<Packet> out;
  for (const auto& c : s.chunks) out.insert(out.end(), c->packets.begin(), c->packets.end());
  return out;
}

// Drains a channel fed by stream_to on another thread.
WeightStream stream_through_channel(const ModelMemory& mm, std::int32_t layer, StreamKind kind,
                                    std::size_t chunk_packets, std::size_t capacity = 2) {
  StreamChannel channel(capacity);
  std::thread producer([&] { mm.stream_to(layer, kind, channel, chunk_packets); });
  WeightStream s;
  try {
    while (ChunkPtr c = channel.pop()) s.chunks.push_back(std::move(c));
  } catch (...) {
    producer.join();
    throw;  // the producer's error, through the channel
  }
  producer.join();
  s.header = mm.stream_header(layer, kind);
  return s;
}

template <typename A, typename B>
void expect_same_packets(const A& a, const B& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].tag, b[i].tag) << i;
    ASSERT_EQ(a[i].value, b[i].value) << i;
  }
}

class Layers : public ::testing::Test {
 protected:
  void SetUp() override {
    mm.add_layer(CsrMatrix::random(41, 29, 0.8, 1), std::vector<float>(41, 0.25F));
    mm.add_layer(CsrMatrix::random(7, 41, 0.5, 2, RowDistribution::powerlaw));
    mm.add_layer(CsrMatrix(3, 4, {0, 0, 0, 0}, {}, {}));  // no non-zeros
    mm.add_layer(CsrMatrix(0, 3, {0}, {}, {}));           // no outputs
  }
  HostModelMemory mm;
};

TEST_F(Layers, HoldsWhatWasAdded) {
  EXPECT_EQ(mm.layer_count(), 4);
  EXPECT_EQ(mm.weights(0).rows(), 41);
  EXPECT_EQ(mm.weights(0).values(), CsrMatrix::random(41, 29, 0.8, 1).values());
  EXPECT_EQ(mm.bias(0), std::vector<float>(41, 0.25F));
  EXPECT_TRUE(mm.bias(1).empty());
  EXPECT_EQ(mm.step(), 0);
  const StreamHeader h = mm.stream_header(1, StreamKind::gradient);
  EXPECT_EQ(h.kind, StreamKind::gradient);
  EXPECT_EQ(h.outputs, 7U);
  EXPECT_EQ(h.inputs, 41U);
  EXPECT_EQ(h.nnz, static_cast<std::uint64_t>(mm.weights(1).nnz()));
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    const LayerShape s = mm.layer_shape(l);
    EXPECT_EQ(s.rows, mm.weights(l).rows()) << l;
    EXPECT_EQ(s.cols, mm.weights(l).cols()) << l;
    EXPECT_EQ(s.nnz, mm.weights(l).nnz()) << l;
    EXPECT_EQ(s.bias, static_cast<std::int64_t>(mm.bias(l).size())) << l;
  }
}

TEST_F(Layers, BadArgumentsAreRefused) {
  EXPECT_THROW(mm.weights(4), ArgumentError);
  EXPECT_THROW(mm.weights(-1), ArgumentError);
  EXPECT_THROW(mm.layer_shape(4), ArgumentError);
  EXPECT_THROW(mm.bias(4), ArgumentError);
  EXPECT_THROW(mm.placement(4, 2), ArgumentError);
  EXPECT_THROW(mm.placement(0, 0), ArgumentError);
  EXPECT_THROW(mm.stream(4), ArgumentError);
  EXPECT_THROW(mm.stream(0, StreamKind::gradient), ArgumentError);
  EXPECT_THROW(mm.stream_header(9), ArgumentError);
  EXPECT_THROW(mm.add_layer(CsrMatrix::random(5, 5, 0.5, 3), std::vector<float>(4)), ShapeError);
  EXPECT_THROW(mm.add_layer(CsrMatrix::random(5, 5, 0.5, 3),
                            std::vector<float>(5, std::numeric_limits<float>::quiet_NaN())),
               FormatError);
  CsrMatrix nan_weights = CsrMatrix::random(5, 5, 0.5, 3);
  ASSERT_GT(nan_weights.nnz(), 0);
  nan_weights.values()[0] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(mm.add_layer(std::move(nan_weights)), FormatError);
  EXPECT_EQ(mm.layer_count(), 4);
  EXPECT_THROW(mm.save(""), ArgumentError);
}

TEST_F(Layers, PlacementIsPlannedOnceAndKept) {
  const Placement& p4 = mm.placement(0, 4);
  const Placement expected = round_robin_placement(mm.weights(0), 4);
  EXPECT_EQ(p4.lanes, 4);
  EXPECT_EQ(p4.lane_of, expected.lane_of);
  EXPECT_EQ(p4.lane_nnz, expected.lane_nnz);
  EXPECT_EQ(&mm.placement(0, 4), &p4);  // the same object, not planned again
  const Placement& p3 = mm.placement(0, 3);
  EXPECT_EQ(p3.lanes, 3);
  EXPECT_EQ(&mm.placement(0, 4), &p4);  // a second lane count does not move the first
  EXPECT_EQ(mm.placement(2, 2).features(), 4);
}

TEST_F(Layers, PlacementFromManyThreads) {
  std::vector<const Placement*> seen(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] { seen[t] = &mm.placement(1, 1 + t % 2); });
  }
  for (auto& t : threads) t.join();
  for (int t = 2; t < 8; ++t) EXPECT_EQ(seen[t], seen[t % 2]);
}

TEST_F(Layers, StreamIsTheEncodedWeights) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    SCOPED_TRACE(l);
    const WeightStream s = mm.stream(l);
    EXPECT_NO_THROW(s.validate());
    const CsrMatrix back = decode_stream(s);
    EXPECT_EQ(back.row_offsets(), mm.weights(l).row_offsets());
    EXPECT_EQ(back.col_indices(), mm.weights(l).col_indices());
    EXPECT_EQ(back.values(), mm.weights(l).values());
  }
}

TEST_F(Layers, StreamToSendsTheSamePacketsInWholeOutputChunks) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    for (StreamKind kind : {StreamKind::weights, StreamKind::mask}) {
      for (std::size_t chunk_packets :
           {std::size_t{1}, std::size_t{9}, std::size_t{64}, kDefaultChunkPackets}) {
        SCOPED_TRACE("layer " + std::to_string(l) + ", " + to_string(kind) + ", chunks of " +
                     std::to_string(chunk_packets));
        const WeightStream expected = encode_stream(mm.weights(l), kind, chunk_packets);
        const WeightStream got = stream_through_channel(mm, l, kind, chunk_packets);
        EXPECT_NO_THROW(got.validate());
        expect_same_packets(all_packets(got), all_packets(expected));
        ASSERT_EQ(got.chunks.size(), expected.chunks.size());
        std::uint32_t next = 0;
        for (std::size_t c = 0; c < got.chunks.size(); ++c) {
          const StreamChunk& chunk = *got.chunks[c];
          EXPECT_EQ(chunk.first_output, next);
          EXPECT_EQ(chunk.first_output, expected.chunks[c]->first_output);
          EXPECT_EQ(chunk.outputs, expected.chunks[c]->outputs);
          next += chunk.outputs;
          // Whole outputs: at most chunk_packets packets unless one output alone is larger.
          if (chunk.outputs > 1) {
            EXPECT_LE(chunk.packets.size() - (c + 1 == got.chunks.size() ? 1 : 0), chunk_packets);
          }
          if (kind == StreamKind::mask) {
            for (const Packet& p : chunk.packets) EXPECT_EQ(p.value, 0.0F);
          }
        }
        EXPECT_EQ(next, mm.weights(l).rows());
        EXPECT_EQ(got.chunks.back()->packets.back().tag, kEndOfLayer);
      }
    }
  }
}

// By input, ModelMemory sends the layer's transpose, its values read through the kept
// transposed pattern: the same packets and chunks as encoding the transpose directly.
TEST_F(Layers, StreamsByInputAreTheTransposeEncoded) {
  for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      for (std::size_t chunk_packets : {std::size_t{1}, std::size_t{9}, kDefaultChunkPackets}) {
        SCOPED_TRACE("layer " + std::to_string(l) + ", " + to_string(precision) + ", chunks of " +
                     std::to_string(chunk_packets));
        StreamChannel channel(1000);
        mm.stream_to(l, StreamKind::weights, channel, chunk_packets, precision,
                     StreamOrder::by_input);
        const WeightStream expected =
            encode_stream(transpose(mm.weights(l)), StreamKind::weights, chunk_packets, precision);
        std::size_t c = 0;
        while (ChunkPtr chunk = channel.pop()) {
          ASSERT_LT(c, expected.chunks.size());
          EXPECT_EQ(chunk->first_output, expected.chunks[c]->first_output);
          EXPECT_EQ(chunk->outputs, expected.chunks[c]->outputs);
          expect_same_packets(chunk->packets, expected.chunks[c]->packets);
          ASSERT_EQ(chunk->packets_bf16.size(), expected.chunks[c]->packets_bf16.size());
          for (std::size_t k = 0; k < chunk->packets_bf16.size(); ++k) {
            ASSERT_EQ(chunk->packets_bf16[k].index, expected.chunks[c]->packets_bf16[k].index);
            ASSERT_EQ(chunk->packets_bf16[k].value, expected.chunks[c]->packets_bf16[k].value);
          }
          ++c;
        }
        EXPECT_EQ(c, expected.chunks.size());
        StreamHeader h = expected.header;
        h.order = StreamOrder::by_input;
        const StreamHeader got =
            mm.stream_header(l, StreamKind::weights, precision, StreamOrder::by_input);
        EXPECT_EQ(got.outputs, h.outputs);
        EXPECT_EQ(got.inputs, h.inputs);
        EXPECT_EQ(got.nnz, h.nnz);
        EXPECT_EQ(got.order, StreamOrder::by_input);
      }
    }
    const WeightStream whole =
        mm.stream(l, StreamKind::mask, Precision::fp32, StreamOrder::by_input);
    EXPECT_EQ(whole.header.order, StreamOrder::by_input);
    EXPECT_EQ(decode_stream(whole).col_indices(), mm.weights(l).col_indices());
  }
  // Built once and kept, whichever thread asks first.
  std::vector<const TransposedPattern*> seen(6);
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) threads.emplace_back([&, t] { seen[t] = &mm.transposed(t % 2); });
  for (auto& t : threads) t.join();
  for (int t = 2; t < 6; ++t) EXPECT_EQ(seen[t], seen[t % 2]);
  EXPECT_EQ(seen[1]->source, transposed_pattern(mm.weights(1)).source);
  EXPECT_THROW(mm.transposed(4), ArgumentError);
}

TEST_F(Layers, StreamToDeliversErrorsThroughTheChannel) {
  EXPECT_THROW(stream_through_channel(mm, 7, StreamKind::weights, 64), ArgumentError);
  EXPECT_THROW(stream_through_channel(mm, 0, StreamKind::gradient, 64), ArgumentError);
  EXPECT_THROW(stream_through_channel(mm, 0, StreamKind::weights, 0), ArgumentError);
}

TEST_F(Layers, StreamToWithASmallChannelMeetsAConsumerThatKeepsUp) {
  // Capacity 1 and one output per chunk: the producer can only ever be one chunk ahead.
  const WeightStream got = stream_through_channel(mm, 0, StreamKind::weights, 1, 1);
  EXPECT_EQ(got.chunks.size(), 41U);
  expect_same_packets(all_packets(got), all_packets(mm.stream(0)));
}

}  // namespace
}  // namespace sluice
