// What the engine refuses, and that a refusal leaves no result: streams of more inputs
// than bf16 tags address, wrong shapes, views that share an element, placements out of
// range, and corrupt streams at intake (every corruption, on every product).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "reference.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::forward_error;
using testing::random_dense;
using testing::thrown_message;

constexpr double kTolerance = 1e-5;  // as test_engine.cpp's: relative to sum |w x|

TEST(Engine, RefusesBf16StreamsWithTooManyInputs) {
  const CsrMatrix wide = CsrMatrix::random(2, 70000, 0.999, 3);
  EXPECT_THROW(encode_stream(wide, StreamKind::weights, kDefaultChunkPackets, Precision::bf16),
               UnsupportedError);
  // A header that claims it anyway is refused at intake.
  WeightStream s = encode_stream(CsrMatrix::random(2, 10, 0.5, 3), StreamKind::weights,
                                 kDefaultChunkPackets, Precision::bf16);
  s.header.inputs = 70000;
  CpuEngine engine;
  Placement p;
  p.lanes = 1;
  p.lane_of.assign(70000, 0);
  p.lane_nnz = {0};
  DenseMatrix x(70000, 1), y(2, 1);
  EXPECT_THROW(engine.forward(s, p, x.view(), y.view()), FormatError);
}

TEST(Engine, RejectsWrongShapes) {
  const CsrMatrix w = CsrMatrix::random(8, 6, 0.5, 1);
  const WeightStream s = encode_stream(w);
  CpuEngine engine;
  const Placement p = round_robin_placement(w, 2);
  DenseMatrix x(6, 4), y(8, 4), bad_x(5, 4), bad_y(8, 3);
  EXPECT_THROW(engine.forward(s, p, bad_x.view(), y.view()), ShapeError);
  EXPECT_THROW(engine.forward(s, p, x.view(), bad_y.view()), ShapeError);
  EXPECT_THROW(engine.forward(s, round_robin_placement(CsrMatrix::random(8, 7, 0.5, 1), 2),
                              x.view(), y.view()),
               ShapeError);
  EXPECT_THROW(engine.forward(encode_stream(w, StreamKind::mask), p, x.view(), y.view()),
               ArgumentError);
  MutableMatrixView alias{x.data(), 6, 4, x.stride()};
  EXPECT_THROW(engine.backward(s, p, x.view(), y.view(), &alias), ArgumentError);
}

// X and Y as views into one buffer, at random strides and offsets: refused exactly when
// they share an element (found by marking X's), computed right when they do not — e.g.
// side-by-side column blocks of one buffer, which a check by address spans refused.
TEST(Engine, ViewsOfOneBufferAreRefusedExactlyWhenTheyShareAnElement) {
  std::mt19937_64 rng(11);
  CpuEngine engine;
  int refused = 0, ran = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t inputs = 1 + rng() % 5, outputs = 1 + rng() % 5, tokens = 1 + rng() % 6;
    const std::int64_t stride = tokens + rng() % 8;
    const CsrMatrix w = CsrMatrix::random(outputs, inputs, 0.3, trial);
    std::vector<float> buffer(static_cast<std::size_t>(64 + 12 * stride), 0.0F);
    const std::int64_t x_at = rng() % 48, y_at = rng() % 48;
    std::vector<char> in_x(buffer.size(), 0);
    bool shared = false;
    for (std::int64_t r = 0; r < inputs; ++r) {
      for (std::int64_t c = 0; c < tokens; ++c) {
        in_x[x_at + r * stride + c] = 1;
        buffer[x_at + r * stride + c] = static_cast<float>(r + 1) - 0.5F * static_cast<float>(c);
      }
    }
    for (std::int64_t r = 0; r < outputs; ++r) {
      for (std::int64_t c = 0; c < tokens; ++c) shared = shared || in_x[y_at + r * stride + c];
    }
    const ConstMatrixView x{buffer.data() + x_at, inputs, tokens, stride};
    const MutableMatrixView y{buffer.data() + y_at, outputs, tokens, stride};
    const DenseMatrix x_copy = [&] {
      DenseMatrix m(inputs, tokens);
      for (std::int64_t r = 0; r < inputs; ++r) std::copy_n(x.row(r), tokens, m.row(r));
      return m;
    }();
    const WeightStream s = encode_stream(w);
    if (shared) {
      EXPECT_THROW(engine.forward(s, round_robin_placement(w, 1), x, y), ArgumentError)
          << "trial " << trial;
      ++refused;
    } else {
      engine.forward(s, round_robin_placement(w, 1), x, y);
      EXPECT_LT(forward_error(w, x_copy.view(), y), kTolerance) << "trial " << trial;
      ++ran;
    }
  }
  EXPECT_GT(refused, 50);  // both kinds were met
  EXPECT_GT(ran, 50);
}

// A placement filled in by hand may name lanes that do not exist; every product refuses
// it (the engine would index its lanes with them), and so does forward for the next
// layer's placement, which only picks where each output's sum ends.
TEST(Engine, RejectsPlacementsWithLanesOutOfRange) {
  const CsrMatrix w = CsrMatrix::random(40, 30, 0.5, 4);
  const WeightStream s = encode_stream(w);
  CpuEngine engine;
  DenseMatrix x = random_dense(30, 20, 1), y(40, 20), dy = random_dense(40, 20, 2), dx(30, 20);
  MutableMatrixView dxv = dx.view();
  for (const std::int32_t lane : {-1, 3, 7}) {
    Placement p = round_robin_placement(w, 3);
    p.lane_of[5] = lane;
    EXPECT_CONTAINS(thrown_message<ShapeError>([&] { engine.forward(s, p, x.view(), y.view()); }),
                    "feature 5 on lane " + std::to_string(lane));
    EXPECT_THROW(engine.backward(s, p, x.view(), dy.view(), &dxv), ShapeError);
    EXPECT_THROW(engine.backward_data(s, p, dy.view(), dxv), ShapeError);
    Placement next = round_robin_placement(CsrMatrix::random(10, 40, 0.5, 5), 3);
    next.lane_of[39] = lane;
    const Placement good = round_robin_placement(w, 3);
    EXPECT_CONTAINS(
        thrown_message<ShapeError>([&] { engine.forward(s, good, x.view(), y.view(), &next); }),
        "next layer's placement puts feature 39");
  }
}

// Every product, on one lane and on several, refuses the same corruptions before any
// kernel reads them (ASan would see the out-of-range index read).
// Also where each task takes its chunks in as it computes them (one lane, one tile, a
// stream larger than the caches): the error comes all the same, if only after the product.
TEST(Engine, RefusesCorruptStreamsAtIntake) {
  const CsrMatrix w = CsrMatrix::random(20, 10, 0.5, 2);
  EngineOptions small_caches;
  small_caches.tile_cache_bytes = 1;
  EngineOptions dense;  // the dense path checks what it densifies just as well
  dense.path = ProductPath::dense;
  for (const EngineOptions& options : {EngineOptions{}, small_caches, dense}) {
    CpuEngine engine(options);
    SCOPED_TRACE("tile cache " + std::to_string(options.tile_cache_bytes) + ", path " +
                 to_string(options.path));
    DenseMatrix x = random_dense(10, 3, 1), y(20, 3), dy = random_dense(20, 3, 3), dx(10, 3);
    StreamOrder order = StreamOrder::by_output;
    auto corrupt = [&](auto mutate) {
      WeightStream s = encode_stream(w, StreamKind::weights, 8, Precision::fp32, order);
      auto chunk = std::make_shared<StreamChunk>(*s.chunks[1]);
      mutate(*chunk, s);
      s.chunks[1] = chunk;
      return s;
    };
    auto corrupted = [&] {
      return std::vector<std::pair<const char*, WeightStream>>{
          {"index out of range",
           corrupt([](StreamChunk& c, WeightStream&) { c.packets[0].tag = 1000000; })},
          {"missing carriage return", corrupt([](StreamChunk& c, WeightStream&) {
             for (auto& pk : c.packets) {
               if (pk.tag == kCarriageReturn) {
                 pk = {0, 1.0F};
                 break;
               }
             }
           })},
          {"lost chunk",
           corrupt([](StreamChunk&, WeightStream& s) { s.chunks.erase(s.chunks.begin() + 2); })},
          {"no end-of-layer", corrupt([](StreamChunk&, WeightStream& s) { s.chunks.pop_back(); })},
          {"NaN weight", corrupt([](StreamChunk& c, WeightStream&) { c.packets[0].value = NAN; })},
      };
    };
    for (std::int32_t lanes : {1, 2}) {
      const Placement p = round_robin_placement(w, lanes);
      order = StreamOrder::by_output;
      for (const auto& [what, s] : corrupted()) {
        SCOPED_TRACE(std::string(what) + ", lanes " + std::to_string(lanes));
        MutableMatrixView dx_view = dx.view();
        EXPECT_THROW(engine.forward(s, p, x.view(), y.view()), FormatError);
        EXPECT_THROW(engine.backward(s, p, x.view(), dy.view(), &dx_view), FormatError);
        EXPECT_THROW(engine.backward(s, p, x.view(), dy.view(), nullptr), FormatError);
        EXPECT_THROW(engine.backward_data(s, p, dy.view(), dx_view), FormatError);
      }
      order = StreamOrder::by_input;
      for (const auto& [what, s] : corrupted()) {
        SCOPED_TRACE(std::string(what) + " by input, lanes " + std::to_string(lanes));
        MutableMatrixView dx_view = dx.view();
        EXPECT_THROW(engine.backward(s, p, x.view(), dy.view(), &dx_view), FormatError);
        EXPECT_THROW(engine.backward(s, p, x.view(), dy.view(), nullptr), FormatError);
        EXPECT_THROW(engine.backward_data(s, p, dy.view(), dx_view), FormatError);
      }
    }
  }
}

}  // namespace
}  // namespace sluice
