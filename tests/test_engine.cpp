// The engine against a float64 dense reference: forward, backward-data and
// backward-weight, on odd shapes, every ISA this CPU runs and many geometries.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>

#include "reference.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/kernels.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::backward_data_error;
using testing::backward_weight_error;
using testing::csr_gradient;
using testing::forward_error;
using testing::random_dense;

constexpr double kTolerance = 1e-5;  // relative to sum |w x|: a wrong or lost term is ~1

struct Case {
  std::int64_t out, in, tokens;
  double sparsity;
  RowDistribution distribution = RowDistribution::uniform;
};

std::string name(const Case& c) {
  return std::to_string(c.out) + "x" + std::to_string(c.in) + "x" + std::to_string(c.tokens) +
         " s=" + std::to_string(c.sparsity);
}

std::vector<float> gradient_values(const WeightStream& g) {
  std::vector<float> v;
  for (const auto& chunk : g.chunks) {
    for (const Packet& p : chunk->packets) {
      if (!is_control(p)) v.push_back(p.value);
    }
  }
  return v;
}

// A gradient stream is laid out as its weight stream: the same chunks, tags and controls
// (which carry zero).
void expect_laid_out_as(const WeightStream& weights, const WeightStream& grad) {
  ASSERT_EQ(grad.chunks.size(), weights.chunks.size());
  for (std::size_t c = 0; c < grad.chunks.size(); ++c) {
    const StreamChunk& from = *weights.chunks[c];
    const StreamChunk& to = *grad.chunks[c];
    ASSERT_EQ(to.packets.size(), from.size()) << "chunk " << c;
    EXPECT_EQ(to.first_output, from.first_output);
    EXPECT_EQ(to.outputs, from.outputs);
    for (std::size_t k = 0; k < to.packets.size(); ++k) {
      const std::uint32_t tag =
          from.packets.empty() ? tag_of(from.packets_bf16[k]) : from.packets[k].tag;
      ASSERT_EQ(to.packets[k].tag, tag) << "chunk " << c << ", packet " << k;
      if (is_control(to.packets[k])) {
        ASSERT_EQ(to.packets[k].value, 0.0F) << "chunk " << c << ", packet " << k;
      }
    }
  }
}

// The backward from the layer's transpose (a stream by input): one lane holds dY, in bf16
// for a bf16 layer where it packs the rows (else read in place, in fp32), and reads X in
// place, in fp32 whatever the stream's precision, so dW is checked against X as it is.
// Both gradients together, each alone, and from the mask alone.
void check_backward_by_input(CpuEngine& engine, const Case& c, const CsrMatrix& w,
                             const DenseMatrix& x, const DenseMatrix& dy_given,
                             const Placement& placement, std::size_t chunk, Precision precision) {
  SCOPED_TRACE("by input");
  const bool bf16 = precision == Precision::bf16;
  const CsrMatrix w_ref = bf16 ? testing::rounded_to_bf16(w) : w;
  // The engine gets dY as given; the reference takes it as held.
  const DenseMatrix dy_held = testing::rounded_to_bf16(dy_given.view());
  const DenseMatrix& dy =
      bf16 && CpuEngine::holds_bf16(1, w.nnz(), c.out, c.tokens) ? dy_held : dy_given;
  const WeightStream stream =
      encode_stream(w, StreamKind::weights, chunk, precision, StreamOrder::by_input);
  DenseMatrix dx(c.in, c.tokens);
  dx.fill(NAN);  // every element must be written
  MutableMatrixView dx_view = dx.view();
  const WeightStream grad = engine.backward(stream, placement, x.view(), dy_given.view(), &dx_view);
  EXPECT_LE(backward_data_error(w_ref, dy.view(), dx.view()), kTolerance);
  ASSERT_EQ(grad.header.kind, StreamKind::gradient);
  EXPECT_EQ(grad.header.order, StreamOrder::by_input);
  EXPECT_EQ(grad.header.precision, Precision::fp32);
  EXPECT_NO_THROW(grad.validate());
  expect_laid_out_as(stream, grad);
  const std::vector<float> g = csr_gradient(grad);
  ASSERT_EQ(static_cast<std::int64_t>(g.size()), w.nnz());
  EXPECT_LE(backward_weight_error(w, dy.view(), x.view(), g), kTolerance);

  DenseMatrix dx_alone(c.in, c.tokens);
  dx_alone.fill(NAN);
  engine.backward_data(stream, placement, dy_given.view(), dx_alone.view());
  EXPECT_LE(backward_data_error(w_ref, dy.view(), dx_alone.view()), kTolerance);
  const WeightStream mask =
      encode_stream(w, StreamKind::mask, chunk, precision, StreamOrder::by_input);
  const WeightStream g_mask = engine.backward(mask, placement, x.view(), dy_given.view(), nullptr);
  EXPECT_LE(backward_weight_error(w, dy.view(), x.view(), csr_gradient(g_mask)), kTolerance);
}

// Runs forward and both backward products on one engine and checks them. In bf16 the
// engine streams W rounded to bf16, holds X in bf16 where its lanes pack their rows
// (CpuEngine::holds_bf16; a sparser layer or one token holds X in fp32) and sums in fp32,
// so it is checked against the float64 product of those operands at fp32 tolerance.
void check_engine(CpuEngine& engine, const Case& c, std::int32_t lanes, std::size_t chunk,
                  std::uint64_t seed, Precision precision = Precision::fp32) {
  SCOPED_TRACE(name(c) + " lanes=" + std::to_string(lanes) + " chunk=" + std::to_string(chunk) +
               " isa=" + to_string(engine.isa()) + " " + to_string(precision));
  const CsrMatrix w = CsrMatrix::random(c.out, c.in, c.sparsity, seed, c.distribution);
  const DenseMatrix x = random_dense(c.in, c.tokens, seed + 1);
  const DenseMatrix dy = random_dense(c.out, c.tokens, seed + 2);
  const WeightStream stream = encode_stream(w, StreamKind::weights, chunk, precision);
  const Placement placement = round_robin_placement(w, lanes);
  const bool bf16 = precision == Precision::bf16;
  const CsrMatrix w_ref = bf16 ? testing::rounded_to_bf16(w) : w;
  const DenseMatrix x_held = testing::rounded_to_bf16(x.view());
  const bool held = bf16 && CpuEngine::holds_bf16(lanes, w.nnz(), c.in, c.tokens);
  const ConstMatrixView x_ref = held ? x_held.view() : x.view();

  DenseMatrix y(c.out, c.tokens);
  y.fill(NAN);  // every element must be written
  engine.forward(stream, placement, x.view(), y.view());
  EXPECT_LE(forward_error(w_ref, x_ref, y.view()), kTolerance);

  DenseMatrix dx(c.in, c.tokens);
  dx.fill(NAN);
  MutableMatrixView dx_view = dx.view();
  const WeightStream grad = engine.backward(stream, placement, x.view(), dy.view(), &dx_view);
  EXPECT_LE(backward_data_error(w_ref, dy.view(), dx.view()), kTolerance);
  ASSERT_EQ(grad.header.kind, StreamKind::gradient);
  EXPECT_EQ(grad.header.precision, Precision::fp32);
  EXPECT_NO_THROW(grad.validate());
  expect_laid_out_as(stream, grad);
  const std::vector<float> g = gradient_values(grad);
  ASSERT_EQ(static_cast<std::int64_t>(g.size()), w.nnz());
  EXPECT_LE(backward_weight_error(w, dy.view(), x_ref, g), kTolerance);

  // The mask alone suffices for the weight gradient, and gives the same numbers.
  const WeightStream mask = encode_stream(w, StreamKind::mask, chunk, precision);
  const std::vector<float> g_mask =
      gradient_values(engine.backward(mask, placement, x.view(), dy.view(), nullptr));
  EXPECT_EQ(g_mask, g);

  check_backward_by_input(engine, c, w, x, dy, placement, chunk, precision);
}

const Case kCases[] = {
    {1, 1, 1, 0.0},
    {1, 1, 3, 0.0},
    {7, 5, 17, 0.5},
    {5, 7, 1, 0.3},
    {33, 19, 17, 0.9},
    {16, 16, 16, 0.0},
    {64, 48, 1000, 0.9},
    {40, 70, 3, 1.0},
    {31, 64, 33, 0.95},
    {128, 256, 65, 0.9, RowDistribution::powerlaw},
    {200, 100, 129, 0.98, RowDistribution::powerlaw},
};

class EngineByIsa : public testing::ByIsa {};

// Every case on every geometry lanes x blocks, chunks small (outputs spread over many
// chunks) or of the default size.
void check_geometries(Isa isa, std::initializer_list<std::int32_t> lane_counts,
                      std::initializer_list<std::int32_t> block_counts, std::uint64_t seed,
                      Precision precision, std::span<const Case> cases = kCases,
                      std::initializer_list<std::int32_t> share_counts = {1}) {
  for (std::int32_t lanes : lane_counts) {
    for (std::int32_t blocks : block_counts) {
      for (std::int32_t shares : share_counts) {
        EngineOptions options;
        options.isa = isa;
        options.geometry.lanes = lanes;
        options.geometry.blocks = blocks;
        options.geometry.shares = shares;
        options.threads = 2;
        options.path = ProductPath::sparse;  // the streamed kernels on this geometry
        CpuEngine engine(options);
        for (const Case& c : cases) {
          check_engine(engine, c, lanes, (seed % 2 == 0) ? 7 : kDefaultChunkPackets, seed,
                       precision);
          ++seed;
        }
      }
    }
  }
}

TEST_P(EngineByIsa, MatchesReferenceOnOddShapesAndGeometries) {
  check_geometries(GetParam(), {1, 2, 3, 4}, {1, 2, 3}, 11, Precision::fp32);
}

// Stream shares split the chunks (small chunks here: many per layer, and some shares
// with none when a layer has fewer chunks than shares).
TEST_P(EngineByIsa, StreamSharesMatchReference) {
  check_geometries(GetParam(), {1, 3}, {1, 2}, 300, Precision::fp32, kCases, {2, 3});
  check_geometries(GetParam(), {1, 2}, {1}, 900, Precision::bf16, kCases, {2});
}

TEST_P(EngineByIsa, SmallTileWidthsCoverEveryTail) {
  for (std::int32_t tile : {1, 5, 16, 17, 31, 48, 64, 100}) {
    EngineOptions options;
    options.isa = GetParam();
    options.geometry.tile_tokens = tile;
    CpuEngine engine(options);
    for (std::int32_t lanes : {1, 2})
      check_engine(engine, {23, 41, 131, 0.7}, lanes, 64, 100 + tile);
  }
}

// A one-lane forward hands out pieces of chunks (runs of up to 256 outputs) tile by tile
// to whichever task is free: chunks of many outputs, on every block and share count.
TEST_P(EngineByIsa, PiecesOfChunksMatchReference) {
  const Case cases[] = {{700, 50, 70, 0.9}, {1000, 33, 17, 0.99, RowDistribution::powerlaw}};
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    for (const std::int32_t blocks : {1, 2, 3}) {
      EngineOptions options;
      options.isa = GetParam();
      options.threads = 2;
      options.geometry.blocks = blocks;
      options.geometry.shares = 4 - blocks;
      options.geometry.tile_tokens = 16;
      CpuEngine engine(options);
      for (const Case& c : cases) {
        check_engine(engine, c, 1, kDefaultChunkPackets, 70 + blocks, precision);
        check_engine(engine, c, 1, 300, 80 + blocks, precision);
      }
    }
  }
}

// The engine's own geometry on a layer with work and chunks enough for the weight pass
// to take the stream in shares (one writer per weight, sums sent out on the last of
// several tiles), and on one too small for that.
// A one-lane product over one token tile of a stream larger than the engine's caches
// (here a cache of one byte) checks each chunk on the task about to compute it.
TEST_P(EngineByIsa, ChunksTakenInByTheirTasksMatchReference) {
  const Case cases[] = {
      {300, 200, 1, 0.9},
      {300, 200, 5, 0.9},
      {300, 200, 16, 0.5},
      {257, 33, 3, 0.0},
      {100, 2000, 17, 0.95, RowDistribution::powerlaw},
  };
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    EngineOptions options;
    options.isa = GetParam();
    options.threads = 2;
    options.tile_cache_bytes = 1;
    options.path = ProductPath::sparse;  // the streamed kernels, whatever this CPU's costs
    CpuEngine engine(options);
    std::uint64_t seed = 500;
    for (const Case& c : cases) check_engine(engine, c, 1, 100, ++seed, precision);
  }
}

TEST_P(EngineByIsa, ChosenGeometryMatchesReference) {
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    EngineOptions options;
    options.isa = GetParam();
    options.threads = 2;
    options.path = ProductPath::sparse;  // the streamed geometry (the dense path has its own)
    CpuEngine engine(options);
    // (Just over the work for two threads: the test runs under ThreadSanitizer too.)
    check_engine(engine, {96, 200, 130, 0.5}, 1, 40, 61, precision);
    check_engine(engine, {96, 200, 130, 0.5}, 1, kDefaultChunkPackets, 62, precision);
    check_engine(engine, {120, 200, 70, 0.3, RowDistribution::powerlaw}, 1, 100, 63, precision);
  }
}

TEST_P(EngineByIsa, Bf16MatchesReferenceOnOddShapesAndGeometries) {
  check_geometries(GetParam(), {1, 3}, {1, 2}, 500, Precision::bf16);
  // Dense enough that one lane packs its rows too (and so holds them in bf16).
  const Case dense[] = {{40, 20, 77, 0.2}, {300, 30, 50, 0.5}, {17, 16, 33, 0.0}};
  check_geometries(GetParam(), {1, 2}, {1, 2}, 700, Precision::bf16, dense);
}

TEST_P(EngineByIsa, Bf16TileWidthsCoverEveryTail) {
  for (std::int32_t tile : {1, 15, 31, 32, 33, 64, 95, 128, 130}) {
    EngineOptions options;
    options.isa = GetParam();
    options.geometry.tile_tokens = tile;
    options.path = ProductPath::sparse;
    CpuEngine engine(options);
    check_engine(engine, {64, 41, 300, 0.5}, 1 + tile % 2, 64, 200 + tile, Precision::bf16);
  }
}

// One token: runs long enough for the AVX-512 gathers (from 128 packets; by output and by
// input) and shorter ones, X packed into one contiguous column or read in place (a
// DenseMatrix's rows lie 16 floats apart), outputs without weights; a bf16 stream's
// packets are read as they are, X held in fp32. Two lanes pack their rows and route the
// packets.
TEST_P(EngineByIsa, OneTokenMatchesReference) {
  const Case cases[] = {
      {1, 3000, 1, 0.0},                                // one output of 3000 weights, in place
      {90, 1000, 1, 0.6},                               // ~400 a run, packed
      {70, 5000, 1, 0.95},                              // ~250 a run, in place
      {300, 2000, 1, 0.97, RowDistribution::powerlaw},  // long, short and empty runs
      {2000, 40, 1, 0.5},                               // by input, ~1000 a run
  };
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    for (std::int32_t lanes : {1, 2}) {
      EngineOptions options;
      options.isa = GetParam();
      options.threads = 2;
      options.geometry.lanes = lanes;
      options.path = ProductPath::sparse;
      CpuEngine engine(options);
      std::uint64_t seed = 40;
      for (const Case& c : cases) check_engine(engine, c, lanes, 700, ++seed, precision);
    }
  }
}

TEST_P(EngineByIsa, Bf16HoldsActivationsRoundedToNearestEven) {
  // W = I on two lanes (which always pack, so X is held in bf16): Y is X as held.
  const std::int64_t n = 24, tokens = 45;
  std::vector<std::int64_t> offsets(n + 1);
  std::vector<std::uint32_t> indices(n);
  for (std::int64_t i = 0; i < n; ++i) {
    offsets[i + 1] = i + 1;
    indices[i] = static_cast<std::uint32_t>(i);
  }
  const CsrMatrix eye(n, n, offsets, indices, std::vector<float>(n, 1.0F));
  DenseMatrix x = random_dense(n, tokens, 31);
  const float special[] = {1.0F + 0x1p-8F,
                           1.0F + 3 * 0x1p-8F,
                           -1.0F - 0x1p-8F,
                           0x1p-130F * 3,
                           3.4e38F,
                           INFINITY,
                           -INFINITY,
                           -0.0F,
                           std::bit_cast<float>(0x7F800001U),
                           1e-45F,
                           65504.0F,
                           0.1F};
  for (std::size_t k = 0; k < std::size(special); ++k) x(k % n, (k * 7) % tokens) = special[k];
  EngineOptions options;
  options.isa = GetParam();
  options.geometry.lanes = 2;
  CpuEngine engine(options);
  DenseMatrix y(n, tokens);
  engine.forward(encode_stream(eye, StreamKind::weights, 5, Precision::bf16),
                 round_robin_placement(eye, 2), x.view(), y.view());
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      const float want = round_to_bf16(x(i, t));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(y(i, t))) << i << "," << t;
      } else if (want == 0.0F) {
        EXPECT_EQ(y(i, t), 0.0F) << i << "," << t;  // a sum: -0 comes out as +0
      } else {
        EXPECT_EQ(std::bit_cast<std::uint32_t>(y(i, t)), std::bit_cast<std::uint32_t>(want))
            << i << "," << t << ": " << x(i, t);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, EngineByIsa, ::testing::ValuesIn(testing::kAllIsas),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The one-token gathers take 32-bit offsets: from a column whose rows lie 2^23 floats
// apart, inputs past 255 are out of their reach, and those steps are taken packet by
// packet (the matrix spans 9.4 GiB of address space, of which 300 pages are touched).
TEST_P(EngineByIsa, OneTokenFromRowsTooFarApartForGathers) {
  constexpr std::int64_t kInputs = 300, kStride = std::int64_t{1} << 23;
  const auto bytes = static_cast<std::size_t>(kInputs * kStride) * sizeof(float);
  void* memory = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (memory == MAP_FAILED) GTEST_SKIP() << "no address space for a 9.4 GiB mapping";
  auto* column = static_cast<float*>(memory);
  const DenseMatrix x = random_dense(kInputs, 1, 12);
  for (std::int64_t i = 0; i < kInputs; ++i) column[i * kStride] = x(i, 0);
  const ConstMatrixView far{column, kInputs, 1, kStride};
  const CsrMatrix w = CsrMatrix::random(5, kInputs, 0.0, 13);  // too sparse to pack: in place
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(to_string(precision));
    EngineOptions options;
    options.isa = GetParam();
    options.path = ProductPath::sparse;
    CpuEngine engine(options);
    DenseMatrix y(5, 1);
    y.fill(NAN);
    engine.forward(encode_stream(w, StreamKind::weights, kDefaultChunkPackets, precision),
                   round_robin_placement(w, 1), far, y.view());
    const CsrMatrix w_ref = precision == Precision::bf16 ? testing::rounded_to_bf16(w) : w;
    EXPECT_LE(forward_error(w_ref, x.view(), y.view()), kTolerance);
  }
  munmap(memory, bytes);
}

// The engine keeps the lanes' routed packets between products; layers of other shapes,
// lane counts, chunk counts and precisions on one engine must not see each other's.
TEST(Engine, LayersAfterOneAnotherGetTheirOwnRouting) {
  EngineOptions options;
  options.threads = 2;
  options.path = ProductPath::sparse;  // routing is the streamed path's
  CpuEngine engine(options);
  struct Layer {
    Case shape;
    std::int32_t lanes;
    std::size_t chunk;
    Precision precision;
  };
  const Layer layers[] = {
      {{90, 70, 33, 0.6}, 3, 7, Precision::fp32},   {{40, 30, 9, 0.5}, 2, 5, Precision::bf16},
      {{90, 70, 33, 0.6}, 4, 64, Precision::fp32},  {{20, 50, 17, 0.2}, 1, 3, Precision::bf16},
      {{60, 80, 65, 0.95}, 2, 11, Precision::fp32}, {{90, 70, 33, 0.6}, 1, 7, Precision::fp32},
      {{90, 70, 33, 0.6}, 3, 7, Precision::bf16},
  };
  std::uint64_t seed = 1500;
  for (const Layer& l : layers)
    check_engine(engine, l.shape, l.lanes, l.chunk, ++seed, l.precision);
}

TEST(Engine, EmptyRowsAndColumnsAndAllZero) {
  // Rows 0 and 2 empty, column 1 empty.
  const CsrMatrix w(3, 3, {0, 0, 2, 2}, {0, 2}, {2.0F, -1.0F});
  const DenseMatrix x = random_dense(3, 5, 3);
  CpuEngine engine;
  for (std::int32_t lanes : {1, 2, 3}) {
    DenseMatrix y(3, 5);
    y.fill(NAN);
    engine.forward(encode_stream(w), round_robin_placement(w, lanes), x.view(), y.view());
    for (std::int64_t t = 0; t < 5; ++t) {
      EXPECT_EQ(y(0, t), 0.0F);
      EXPECT_FLOAT_EQ(y(1, t), 2.0F * x(0, t) - x(2, t));
      EXPECT_EQ(y(2, t), 0.0F);
    }
  }
}

TEST(Engine, NoTokensGiveZeroGradients) {
  const CsrMatrix w = CsrMatrix::random(30, 20, 0.5, 4);
  for (std::int32_t lanes : {1, 3}) {
    CpuEngine engine;
    DenseMatrix x(20, 0), dy(30, 0), dx(20, 0);
    MutableMatrixView dx_view = dx.view();
    const WeightStream g = engine.backward(encode_stream(w), round_robin_placement(w, lanes),
                                           x.view(), dy.view(), &dx_view);
    ASSERT_EQ(static_cast<std::int64_t>(gradient_values(g).size()), w.nnz());
    for (float v : gradient_values(g)) EXPECT_EQ(v, 0.0F);
  }
}

// The engine recycles the memory of gradient streams nobody holds any more: a stream
// still held must never be written by a later backward, and one that outlives its engine
// stays whole.
TEST(Engine, GradientStreamsStayIntactWhileHeldAndAfterTheEngine) {
  auto engine = std::make_unique<CpuEngine>();
  struct Layer {
    CsrMatrix w;
    DenseMatrix x, dy;
  };
  auto layer = [](std::int64_t out, std::int64_t in, std::int64_t tokens, std::uint64_t seed) {
    return Layer{CsrMatrix::random(out, in, 0.7, seed), random_dense(in, tokens, seed + 1),
                 random_dense(out, tokens, seed + 2)};
  };
  auto gradient = [&](const Layer& l) {
    return engine->backward(encode_stream(l.w, StreamKind::mask, 1000),
                            round_robin_placement(l.w, 1), l.x.view(), l.dy.view(), nullptr);
  };
  auto expect_right = [](const Layer& l, const WeightStream& g) {
    EXPECT_LE(backward_weight_error(l.w, l.dy.view(), l.x.view(), gradient_values(g)), kTolerance);
  };
  const Layer a = layer(90, 60, 40, 21), b = layer(70, 110, 30, 31), c = layer(40, 30, 9, 41);
  const WeightStream held = gradient(a);
  for (int round = 0; round < 3; ++round) {
    expect_right(b, gradient(b));  // made and dropped: its chunks go back for reuse
    expect_right(c, gradient(c));  // smaller chunks, into the same memory
  }
  const WeightStream last = gradient(b);
  expect_right(a, held);
  engine.reset();
  expect_right(a, held);
  expect_right(b, last);
}

TEST(Engine, BitwiseReproducibleAcrossRuns) {
  const CsrMatrix w = CsrMatrix::random(300, 200, 0.8, 5, RowDistribution::powerlaw);
  const DenseMatrix x = random_dense(200, 77, 6);
  EngineOptions options;
  options.geometry = {3, 2, 16};
  CpuEngine engine(options);
  const Placement placement = round_robin_placement(w, 3);
  DenseMatrix first(300, 77);
  engine.forward(encode_stream(w), placement, x.view(), first.view());
  for (int run = 0; run < 5; ++run) {
    DenseMatrix again(300, 77);
    engine.forward(encode_stream(w), placement, x.view(), again.view());
    for (std::int64_t r = 0; r < 300; ++r) {
      ASSERT_EQ(0, std::memcmp(first.row(r), again.row(r), 77 * sizeof(float))) << "row " << r;
    }
  }
}

// Stream shares add their parts of dX in a fixed order: the same bits every time.
TEST(Engine, StreamSharesAreBitwiseReproducible) {
  const CsrMatrix w = CsrMatrix::random(300, 200, 0.5, 7, RowDistribution::powerlaw);
  const DenseMatrix x = random_dense(200, 9, 8), dy = random_dense(300, 9, 9);
  EngineOptions options;
  options.geometry = {1, 1, 0, 3};
  CpuEngine engine(options);
  const Placement placement = round_robin_placement(w, 1);
  auto run = [&] {
    DenseMatrix dx(200, 9);
    MutableMatrixView dx_view = dx.view();
    const WeightStream g = engine.backward(encode_stream(w, StreamKind::weights, 500), placement,
                                           x.view(), dy.view(), &dx_view);
    return std::make_pair(std::move(dx), gradient_values(g));
  };
  const auto first = run();
  EXPECT_LE(backward_data_error(w, dy.view(), first.first.view()), kTolerance);
  for (int again = 0; again < 5; ++again) {
    const auto next = run();
    for (std::int64_t r = 0; r < 200; ++r) {
      ASSERT_EQ(0, std::memcmp(first.first.row(r), next.first.row(r), 9 * sizeof(float)))
          << "row " << r;
    }
    ASSERT_EQ(first.second, next.second);
  }
}

TEST(Engine, GeometryForIsTheGeometryALayerRunsWith) {
  EngineOptions options;
  options.threads = 2;
  options.tile_cache_bytes = 1 << 20;
  CpuEngine engine(options);
  const std::uint64_t tenth = 512 * 512 / 10;
  // Tokens split over both threads, unless there is too little work to wake one for.
  EXPECT_EQ(engine.geometry_for(512, 512, 256).blocks, 2);
  EXPECT_EQ(engine.geometry_for(512, 512, 256, Precision::fp32, tenth).blocks, 2);
  EXPECT_EQ(engine.geometry_for(512, 512, 256, Precision::fp32, 100).blocks, 1);
  // bf16 tiles are twice as wide, unless the layer is too sparse to pack them.
  EXPECT_EQ(engine.geometry_for(512, 512, 256, Precision::fp32, tenth).tile_tokens, 64);
  EXPECT_EQ(engine.geometry_for(512, 512, 256, Precision::bf16, tenth).tile_tokens, 128);
  EXPECT_EQ(engine.geometry_for(512, 512, 256, Precision::bf16, 2000).tile_tokens, 64);
  // Tiles are as wide as the kernels go, however many inputs; input features are split
  // over lanes only where a lane's tile would not fit the cache budget (1 MiB here).
  EXPECT_EQ(engine.geometry_for(512, 1 << 12, 256).to_string(), "1x2/64");  // 1 MiB
  EXPECT_EQ(engine.geometry_for(512, 1 << 14, 256).to_string(), "4x1/64");
  EXPECT_EQ(engine.geometry_for(512, 1 << 14, 256, Precision::bf16, 1 << 20).to_string(),
            "4x1/128");
  EXPECT_EQ(engine.geometry_for(512, (1 << 14) + 1, 256).lanes, 8);  // a lane's rows round up
  // A small batch runs on one lane (routing packets to lanes would cost more than the
  // product), unless even its narrow tile of all inputs would not fit; the threads its
  // blocks leave idle take a share of the stream each.
  EXPECT_EQ(engine.geometry_for(512, 512, 16).lanes, 1);
  EXPECT_EQ(engine.geometry_for(512, 512, 1).lanes, 1);
  EXPECT_EQ(engine.geometry_for(512, 1 << 14, 16).lanes, 1);  // 1 MiB of X
  EXPECT_EQ(engine.geometry_for(512, 1 << 16, 16).lanes, 4);  // 4 MiB of X: a quarter each
  EXPECT_EQ(engine.geometry_for(512, 1 << 16, 1).lanes, 1);   // 256 KiB
  EXPECT_EQ(engine.geometry_for(512, 512, 16, Precision::fp32, 512 * 512).to_string(), "1x1x2/16");
  EXPECT_EQ(engine.geometry_for(2048, 2048, 1, Precision::fp32, 2048 * 1024).to_string(),
            "1x1x2/1");
  EXPECT_EQ(engine.geometry_for(512, 512, 256, Precision::fp32, tenth).shares, 1);
  EXPECT_EQ(engine.geometry_for(512, 512, 16, Precision::fp32, 100).shares, 1);  // one task
  // And a small layer still gives the right numbers as one block.
  const CsrMatrix w = CsrMatrix::random(40, 30, 0.9, 12);
  const DenseMatrix x = random_dense(30, 50, 13);
  ASSERT_EQ(engine.geometry_for(40, 30, 50, Precision::fp32, w.nnz()).blocks, 1);
  DenseMatrix y(40, 50);
  engine.forward(encode_stream(w), round_robin_placement(w, 1), x.view(), y.view());
  EXPECT_LE(forward_error(w, x.view(), y.view()), kTolerance);
}

TEST(Engine, RingEndsWhereTheNextLayerWantsTheOutput) {
  // Any next-layer placement gives the same numbers, within rounding.
  const CsrMatrix w = CsrMatrix::random(50, 60, 0.5, 8);
  const DenseMatrix x = random_dense(60, 9, 9);
  EngineOptions streamed;
  streamed.path = ProductPath::sparse;  // the ring is the streamed path's
  CpuEngine engine(streamed);
  const Placement placement = round_robin_placement(w, 3);
  const Placement next = round_robin_placement(CsrMatrix::random(10, 50, 0.5, 10), 3);
  DenseMatrix y(50, 9);
  engine.forward(encode_stream(w), placement, x.view(), y.view(), &next);
  EXPECT_LE(forward_error(w, x.view(), y.view()), kTolerance);

  // Where the ring ends shows in the order of its additions: it starts one lane past the
  // output's home lane and adds the home lane's partial sum last. Three lanes, one input
  // each, X all ones: lane p's partial sum of output o is exactly w(o, p). Each output has
  // 1 on one lane and +2^26, -2^26 on the others, so in float (2^26 + 1 == 2^26) the sum is
  // 1 where the 1 is added last, on the home lane, and 0 wherever else the ring ends.
  constexpr float kBig = 67108864.0F;  // 2^26
  constexpr std::int64_t kOutputs = 7, kTokens = 5;
  std::vector<std::int64_t> offsets{0};
  std::vector<std::uint32_t> columns;
  std::vector<float> values;
  for (std::int64_t o = 0; o < kOutputs; ++o) {
    const std::uint32_t one = o % 3;  // the lane whose partial sum is 1
    for (std::uint32_t p = 0; p < 3; ++p) {
      columns.push_back(p);
      values.push_back(p == one ? 1.0F : p == (one + 1) % 3 ? kBig : -kBig);
    }
    offsets.push_back(static_cast<std::int64_t>(columns.size()));
  }
  const CsrMatrix ring(kOutputs, 3, offsets, columns, values);
  Placement one_input_a_lane;
  one_input_a_lane.lanes = 3;
  one_input_a_lane.lane_of = {0, 1, 2};
  one_input_a_lane.lane_nnz = {kOutputs, kOutputs, kOutputs};
  DenseMatrix ones(3, kTokens);
  for (std::int64_t i = 0; i < 3; ++i) {
    for (std::int64_t t = 0; t < kTokens; ++t) ones(i, t) = 1.0F;
  }
  // The next layer wants output o on lane (o + shift) % 3; shift -1: no next placement,
  // which means lane o % 3 (default_output_lane).
  for (const std::int32_t shift : {0, 1, 2, -1}) {
    Placement wants;
    wants.lanes = 3;
    wants.lane_nnz = {0, 0, 0};
    for (std::int64_t o = 0; o < kOutputs; ++o) {
      wants.lane_of.push_back(static_cast<std::int32_t>((o + shift + 3) % 3));
    }
    const float expected = shift <= 0 ? 1.0F : 0.0F;
    DenseMatrix out(kOutputs, kTokens);
    engine.forward(encode_stream(ring), one_input_a_lane, ones.view(), out.view(),
                   shift < 0 ? nullptr : &wants);
    for (std::int64_t o = 0; o < kOutputs; ++o) {
      for (std::int64_t t = 0; t < kTokens; ++t) {
        EXPECT_EQ(out(o, t), expected)
            << "output " << o << ", token " << t << ", home shifted by " << shift;
      }
    }
  }
}

TEST(Engine, Bf16KeepsTokensApart) {
  // A non-finite activation in one token must not leak into its neighbours, which share
  // the same 32-bit word of a bf16 row.
  const CsrMatrix w = CsrMatrix::random(64, 12, 0.0, 21);  // dense enough to be held in bf16
  ASSERT_TRUE(CpuEngine::holds_bf16(1, w.nnz(), 12, 37));
  DenseMatrix x = random_dense(12, 37, 22);
  x(3, 10) = INFINITY;
  x(5, 20) = NAN;
  CpuEngine engine;
  DenseMatrix y(64, 37);
  engine.forward(encode_stream(w, StreamKind::weights, kDefaultChunkPackets, Precision::bf16),
                 round_robin_placement(w, 1), x.view(), y.view());
  for (std::int64_t o = 0; o < 64; ++o) {
    for (std::int64_t t = 0; t < 37; ++t) {
      if (t != 10 && t != 20) EXPECT_TRUE(std::isfinite(y(o, t))) << o << "," << t;
    }
  }
}

// The 16-bit index's one reserved value marks control packets: 65535 inputs (indices up
// to 65534) fit, and the last one is read correctly, whether the lane packs X into a bf16
// tile (a dense layer) or reads it in place in fp32 (a sparse one); 65536 do not.
TEST(Engine, Bf16StreamsAddressUpToTheirLastIndex) {
  const CsrMatrix sparse(2, 65535, {0, 2, 3}, {0, 65534, 65534}, {0.5F, -2.0F, 1.5F});
  const CsrMatrix dense = CsrMatrix::random(16, 65535, 0.0, 8);
  const DenseMatrix x = random_dense(65535, 3, 7);
  CpuEngine engine;
  for (const CsrMatrix* w : {&sparse, &dense}) {
    const WeightStream s =
        encode_stream(*w, StreamKind::weights, kDefaultChunkPackets, Precision::bf16);
    DenseMatrix y(w->rows(), 3);
    engine.forward(s, round_robin_placement(*w, 1), x.view(), y.view());
    const bool packed = CpuEngine::holds_bf16(1, w->nnz(), w->cols(), 3);
    EXPECT_EQ(packed, w == &dense);
    const DenseMatrix rounded = testing::rounded_to_bf16(x.view());
    const ConstMatrixView held = packed ? rounded.view() : x.view();
    EXPECT_LT(forward_error(testing::rounded_to_bf16(*w), held, y.view()), kTolerance)
        << (packed ? "packed" : "in place");
  }
  EXPECT_THROW(encode_stream(CsrMatrix(2, 65536, {0, 1, 1}, {65535}, {1.0F}), StreamKind::weights,
                             kDefaultChunkPackets, Precision::bf16),
               UnsupportedError);
}

TEST(Engine, ConsumesALiveChannel) {
  const CsrMatrix w = CsrMatrix::random(120, 90, 0.7, 4);
  const DenseMatrix x = random_dense(90, 20, 5);
  const WeightStream s = encode_stream(w, StreamKind::weights, 64);
  StreamChannel channel(2);
  std::thread producer([&] {
    for (const auto& c : s.chunks) channel.push(c);
    channel.close();
  });
  ChannelStreamSource source(s.header, channel);
  CpuEngine engine;
  DenseMatrix y(120, 20);
  engine.forward(source, round_robin_placement(w, 2), x.view(), y.view());
  producer.join();
  EXPECT_LE(forward_error(w, x.view(), y.view()), kTolerance);
}

TEST(Kernels, SpmmSpmmTSddmmMatchReference) {
  const CsrMatrix w = CsrMatrix::random(70, 45, 0.8, 12, RowDistribution::powerlaw);
  const DenseMatrix x = random_dense(45, 19, 13);
  const DenseMatrix dy = random_dense(70, 19, 14);
  EXPECT_LE(forward_error(w, x.view(), spmm(w, x.view()).view()), kTolerance);
  EXPECT_LE(backward_data_error(w, dy.view(), spmm_t(w, dy.view()).view()), kTolerance);
  EXPECT_LE(backward_weight_error(w, dy.view(), x.view(), sddmm(w, dy.view(), x.view())),
            kTolerance);
}

}  // namespace
}  // namespace sluice
