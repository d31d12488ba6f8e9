// The checks on gradient streams that HostModelMemory takes: a stream that does not fit
// its layer is refused with a message that names what is wrong and where, nothing
// changes, and a good gradient is still taken after it.
#include <gtest/gtest.h>

#include <span>
#include <string>
#include <vector>

#include "optimizer_reference.hpp"
#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

using namespace optimizer_reference;  // NOLINT(google-build-using-namespace)

class BadGradient : public ::testing::Test {
 protected:
  void SetUp() override {
    OptimizerConfig c;
    c.kind = OptimizerKind::sgd;
    c.learning_rate = 0.1;
    build(m, c);
    g = random_gradients(m.memory, 1500);
    before = fingerprint(m.memory);
  }
  WeightStream good(std::int32_t layer) {
    return gradient_stream(m.memory.weights(layer), g.weights[layer]);
  }
  // Submitting `s` for layer 0 throws E whose message contains every one of `words`;
  // afterwards a good gradient is still accepted and the step matches the reference.
  template <typename E>
  void expect_refused(const WeightStream& s, std::vector<std::string> words,
                      std::span<const float> bias) {
    try {
      m.memory.submit_gradient(0, s, bias);
      ADD_FAILURE() << "accepted";
    } catch (const E& e) {
      for (const auto& w : words) {
        EXPECT_NE(std::string(e.what()).find(w), std::string::npos)
            << "'" << w << "' not in: " << e.what();
      }
    }
    EXPECT_TRUE(fingerprint(m.memory) == before) << "state changed";
    ASSERT_TRUE(submit_and_commit(m.memory, g).applied);
    m.ref.apply(g);
    expect_matches_reference(m, "after a refused gradient");
    before = fingerprint(m.memory);
  }
  template <typename E>
  void expect_refused(const WeightStream& s, std::vector<std::string> words) {
    expect_refused<E>(s, std::move(words), g.bias[0]);
  }
  Model m;
  Gradients g;
  std::string before;
};

TEST_F(BadGradient, WrongKind) {
  WeightStream s = good(0);
  s.header.kind = StreamKind::weights;
  expect_refused<FormatError>(s, {"layer 0", "not a gradient"});
}

// Gradients are fp32 whatever the weights' precision: a bf16 header over fp32 packets, or
// bf16 packets, are named as such (not as a pattern mismatch deep in the stream).
TEST_F(BadGradient, NotFp32) {
  WeightStream s = good(0);
  s.header.precision = Precision::bf16;
  expect_refused<FormatError>(s, {"layer 0", "must be fp32"});
  s = good(0);
  auto chunk = std::make_shared<StreamChunk>(*s.chunks[0]);
  chunk->packets_bf16.push_back(bf16_control(kEndOfLayer));
  s.chunks[0] = chunk;
  expect_refused<FormatError>(s, {"layer 0", "chunks hold bf16"});
}

TEST_F(BadGradient, WrongHeaderShape) {
  WeightStream s = good(0);
  s.header.outputs += 1;
  expect_refused<FormatError>(s, {"layer 0"});
  s = good(0);
  s.header.inputs -= 1;
  expect_refused<FormatError>(s, {"layer 0"});
  s = good(0);
  s.header.nnz += 1;
  expect_refused<FormatError>(s, {"layer 0"});
}

TEST_F(BadGradient, StreamOfAnotherLayer) {
  expect_refused<FormatError>(good(1), {"layer 0"});
}

TEST_F(BadGradient, WrongTagNamesLayerOutputAndPosition) {
  WeightStream s = good(0);
  // Output 6's second non-zero (chunk 1 holds outputs 5..9).
  const auto& off = m.memory.weights(0).row_offsets();
  ASSERT_GE(off[7] - off[6], 2);
  StreamChunk& chunk = editable_chunk(s, 1);
  const std::size_t pos = static_cast<std::size_t>(off[6] - off[5]) + 1 + 1;
  chunk.packets[pos].tag += 1;
  expect_refused<FormatError>(s, {"layer 0", "output 6", "position 1"});
}

TEST_F(BadGradient, MissingCarriageReturn) {
  WeightStream s = good(0);
  StreamChunk& chunk = editable_chunk(s, 0);
  const auto& off = m.memory.weights(0).row_offsets();
  chunk.packets.erase(chunk.packets.begin() + (off[1] - off[0]));  // output 0's return
  expect_refused<FormatError>(s, {"layer 0", "output"});
}

TEST_F(BadGradient, MissingEndOfLayer) {
  WeightStream s = good(0);
  editable_chunk(s, s.chunks.size() - 1).packets.pop_back();
  expect_refused<FormatError>(s, {"layer 0", "end-of-layer"});
}

TEST_F(BadGradient, PacketAfterEndOfLayer) {
  WeightStream s = good(0);
  editable_chunk(s, s.chunks.size() - 1).packets.push_back({0, 1.0F});
  expect_refused<FormatError>(s, {"layer 0"});
}

TEST_F(BadGradient, ExtraWeightInAnOutput) {
  WeightStream s = good(0);
  StreamChunk& chunk = editable_chunk(s, 0);
  // A duplicate of output 0's first non-zero.
  chunk.packets.insert(chunk.packets.begin() + 1, chunk.packets[0]);
  expect_refused<FormatError>(s, {"layer 0", "output 0", "position 1"});
}

TEST_F(BadGradient, ChunksOutOfOrderOrMissing) {
  WeightStream s = good(0);
  std::swap(s.chunks[0], s.chunks[1]);
  expect_refused<FormatError>(s, {"layer 0", "chunk 0"});
  s = good(0);
  s.chunks.erase(s.chunks.begin() + 1);
  expect_refused<FormatError>(s, {"layer 0"});
  s = good(0);
  s.chunks.clear();
  expect_refused<FormatError>(s, {"layer 0"});
}

// By input the runs are input features: a wrong tag is named by input and position, and
// a stream by output under a by-input header is refused, not read crosswise.
TEST_F(BadGradient, ByInputWrongTagNamesTheInput) {
  WeightStream s = gradient_stream_by_input(m.memory.weights(0), g.weights[0]);
  ASSERT_GE(s.chunks.size(), 2U);
  StreamChunk& chunk = editable_chunk(s, 1);  // inputs 4..7
  std::size_t pos = 0;
  while (is_control(chunk.packets[pos])) ++pos;  // the first weight of the chunk
  std::size_t run = 4;
  for (std::size_t k = 0; k < pos; ++k) run += chunk.packets[k].tag == kCarriageReturn ? 1 : 0;
  chunk.packets[pos].tag += 1;
  expect_refused<FormatError>(s, {"layer 0", "input " + std::to_string(run), "position 0"});
  WeightStream crosswise = good(0);
  crosswise.header.order = StreamOrder::by_input;
  std::swap(crosswise.header.outputs, crosswise.header.inputs);
  expect_refused<FormatError>(crosswise, {"layer 0", "inputs"});
  WeightStream unknown = good(0);
  unknown.header.order = StreamOrder{3};
  expect_refused<FormatError>(unknown, {"layer 0", "unknown stream order"});
}

TEST_F(BadGradient, WrongBiasGradientSize) {
  const std::vector<float> short_bias(g.bias[0].size() - 1, 0.0F);
  expect_refused<ShapeError>(good(0), {"layer 0", "bias"}, short_bias);
}

TEST_F(BadGradient, LayerOutOfRange) {
  EXPECT_THROW(m.memory.submit_gradient(-1, good(0), g.bias[0]), ArgumentError);
  EXPECT_THROW(m.memory.submit_gradient(3, good(0), g.bias[0]), ArgumentError);
}

TEST_F(BadGradient, SecondGradientForTheSameLayerInOneStep) {
  m.memory.submit_gradient(0, good(0), g.bias[0]);
  EXPECT_THROW(m.memory.submit_gradient(0, good(0), g.bias[0]), ShapeError);
}

}  // namespace
}  // namespace sluice
