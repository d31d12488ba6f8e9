// The engine's dense path (ProductPath::dense): the packets densified into tiles and
// multiplied by oneDNN's matmul, forward and backward, against float64 on odd shapes in
// fp32 and bf16 (bf16: against the operands rounded as the path holds them, all of them);
// its gradient stream is the sparse path's in form; and `automatic` takes the path the
// cost model names.
#include <gtest/gtest.h>

#include <random>

#include "engine/dense_matmul.hpp"
#include "engine/kernels/densify.hpp"
#include "reference.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace sluice {
namespace {

using testing::random_dense;

constexpr double kTolerance = 1e-5;

CpuEngine engine_on(ProductPath path, std::int32_t threads = 2) {
  EngineOptions o;
  o.path = path;
  o.threads = threads;
  return CpuEngine(o);
}

struct Case {
  std::int64_t outputs, inputs, tokens;
  double sparsity;
};

// Shapes that are no multiple of anything: tiles, slices and AMX blocks all end ragged.
// Past 256 rows a stream's matrix takes whole tiles and a short last one per group (a
// group holds several chunks); by input, a layer 600 wide does.
const Case kCases[] = {{1, 1, 1, 0.0},     {67, 131, 37, 0.0}, {130, 65, 129, 0.5},
                       {200, 97, 3, 0.9},  {64, 128, 64, 0.3}, {33, 300, 17, 0.99},
                       {601, 77, 35, 0.2}, {45, 600, 19, 0.6}};

TEST(DensePath, ForwardMatchesFloat64) {
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    for (const Case& c : kCases) {
      SCOPED_TRACE(std::string(to_string(precision)) + " " + std::to_string(c.outputs) + "x" +
                   std::to_string(c.inputs) + "x" + std::to_string(c.tokens));
      const CsrMatrix w = CsrMatrix::random(c.outputs, c.inputs, c.sparsity, 7);
      const WeightStream s = encode_stream(w, StreamKind::weights, 100, precision);
      const DenseMatrix x = random_dense(c.inputs, c.tokens, 8);
      DenseMatrix y(c.outputs, c.tokens);
      CpuEngine engine = engine_on(ProductPath::dense);
      ASSERT_EQ(engine.path_for(s.header, c.tokens), ProductPath::dense);
      engine.forward(s, round_robin_placement(w, 1), x.view(), y.view());
      const bool bf16 = precision == Precision::bf16;
      const CsrMatrix w_ref = bf16 ? testing::rounded_to_bf16(w) : w;
      const DenseMatrix x_ref = bf16 ? testing::rounded_to_bf16(x.view()) : x.clone();
      EXPECT_LT(testing::forward_error(w_ref, x_ref.view(), y.view()), kTolerance);
      EXPECT_GT(engine.counters().packets, 0u);
    }
  }
}

TEST(DensePath, BackwardMatchesFloat64EitherOrder) {
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    for (const StreamOrder order : {StreamOrder::by_input, StreamOrder::by_output}) {
      for (const Case& c : kCases) {
        SCOPED_TRACE(std::string(to_string(precision)) + " " + to_string(order) + " " +
                     std::to_string(c.outputs) + "x" + std::to_string(c.inputs) + "x" +
                     std::to_string(c.tokens));
        const CsrMatrix w = CsrMatrix::random(c.outputs, c.inputs, c.sparsity, 9);
        const WeightStream s = encode_stream(w, StreamKind::weights, 64, precision, order);
        const DenseMatrix x = random_dense(c.inputs, c.tokens, 10);
        const DenseMatrix dy = random_dense(c.outputs, c.tokens, 11);
        DenseMatrix dx(c.inputs, c.tokens), dx_alone(c.inputs, c.tokens);
        MutableMatrixView dx_view = dx.view();
        CpuEngine dense = engine_on(ProductPath::dense);
        const Placement p = round_robin_placement(w, 1);
        const WeightStream g = dense.backward(s, p, x.view(), dy.view(), &dx_view);
        dense.backward_data(s, p, dy.view(), dx_alone.view());
        const WeightStream g_alone = dense.backward(s, p, x.view(), dy.view(), nullptr);

        const bool bf16 = precision == Precision::bf16;
        const CsrMatrix w_ref = bf16 ? testing::rounded_to_bf16(w) : w;
        const DenseMatrix x_ref = bf16 ? testing::rounded_to_bf16(x.view()) : x.clone();
        const DenseMatrix dy_ref = bf16 ? testing::rounded_to_bf16(dy.view()) : dy.clone();
        EXPECT_LT(testing::backward_data_error(w_ref, dy_ref.view(), dx.view()), kTolerance);
        EXPECT_LT(testing::backward_data_error(w_ref, dy_ref.view(), dx_alone.view()), kTolerance);
        for (const WeightStream* grad : {&g, &g_alone}) {
          EXPECT_LT(testing::backward_weight_error(w, dy_ref.view(), x_ref.view(),
                                                   testing::csr_gradient(*grad)),
                    kTolerance);
        }
        // The same stream, in form, as the sparse path returns.
        CpuEngine sparse = engine_on(ProductPath::sparse);
        const WeightStream want = sparse.backward(s, p, x.view(), dy.view(), nullptr);
        EXPECT_EQ(g.header.kind, StreamKind::gradient);
        EXPECT_EQ(g.header.precision, Precision::fp32);
        EXPECT_EQ(g.header.order, want.header.order);
        ASSERT_EQ(g.chunks.size(), want.chunks.size());
        for (std::size_t k = 0; k < g.chunks.size(); ++k) {
          ASSERT_EQ(g.chunks[k]->packets.size(), want.chunks[k]->packets.size());
          EXPECT_EQ(g.chunks[k]->first_output, want.chunks[k]->first_output);
          for (std::size_t i = 0; i < g.chunks[k]->packets.size(); ++i) {
            EXPECT_EQ(g.chunks[k]->packets[i].tag, want.chunks[k]->packets[i].tag);
          }
        }
        g.validate();
      }
    }
  }
}

// The packet kernels of this CPU against the scalar ones, on runs of every density and
// widths that end inside a vector: the row written whole (zeros between, and past the
// run up to the width) and nothing past the width, the gradient read at the run's tags.
TEST(DensePath, DensifyKernelsMatchScalar) {
  const detail::DensifyKernels& fast = detail::densify_kernels();
  const detail::DensifyKernels& slow = detail::kScalarDensify;
  std::mt19937 rng(5);
  for (int trial = 0; trial < 400; ++trial) {
    const std::uint32_t width = 1 + rng() % 150;
    // Every eighth run fills its row (the kernels' other case).
    const double density = trial % 8 == 0 ? 1.0 : std::uniform_real_distribution<double>(0, 1)(rng);
    std::vector<Packet> run;
    std::vector<Bf16Packet> run_bf16;
    for (std::uint32_t i = 0; i < width; ++i) {
      if (std::uniform_real_distribution<double>(0, 1)(rng) < density) {
        const float v = static_cast<float>(rng() % 1000) - 500.0F;
        run.push_back({i, v});
        run_bf16.push_back({static_cast<std::uint16_t>(i), to_bf16(v)});
      }
    }
    const auto n = static_cast<std::uint32_t>(run.size());
    const std::size_t room = width + 64;  // past a vector of either width
    std::vector<float> a(room, 7.0F), b(room, 7.0F);
    fast.fp32(run.data(), n, a.data(), width);
    slow.fp32(run.data(), n, b.data(), width);
    ASSERT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << "trial " << trial;
    ASSERT_EQ(a[width], 7.0F) << "trial " << trial;
    std::vector<std::uint16_t> c(room, 7), d(room, 7);
    fast.bf16(run_bf16.data(), n, c.data(), width);
    slow.bf16(run_bf16.data(), n, d.data(), width);
    ASSERT_TRUE(std::equal(c.begin(), c.end(), d.begin())) << "trial " << trial;
    ASSERT_EQ(c[width], 7) << "trial " << trial;
    std::vector<Packet> g1(n), g2(n), g3(n);
    fast.gradient_fp32(run.data(), n, a.data(), g1.data());
    slow.gradient_fp32(run.data(), n, a.data(), g2.data());
    fast.gradient_bf16(run_bf16.data(), n, a.data(), g3.data());
    for (std::uint32_t k = 0; k < n; ++k) {
      ASSERT_EQ(g1[k].tag, run[k].tag);
      ASSERT_EQ(g1[k].value, run[k].value);
      ASSERT_EQ(g2[k].value, run[k].value);
      ASSERT_EQ(g3[k].tag, run[k].tag);
      ASSERT_EQ(g3[k].value, run[k].value);
    }
  }
}

// B packed in parts (each task its rows, as the dense path packs it) is byte for byte B
// packed whole, padding included, in both precisions, either orientation, ragged k and n.
TEST(DensePath, PacksBInPartsAsWhole) {
  struct Shape {
    std::int64_t k, n;
    bool transposed;
  };
  for (const auto type : {detail::DenseType::f32, detail::DenseType::bf16}) {
    for (const Shape sh : {Shape{1500, 77, false}, Shape{77, 1500, true}, Shape{200, 5, false},
                           Shape{130, 33, true}}) {
      SCOPED_TRACE(std::to_string(sh.k) + "x" + std::to_string(sh.n));
      const std::int64_t ldb = sh.transposed ? sh.k : sh.n;
      const detail::DenseMatmul mm(type, 256, sh.n, sh.k, false, sh.k, sh.transposed, ldb, sh.n,
                                   true);
      const DenseMatrix b = random_dense(sh.transposed ? sh.n : sh.k, ldb, 31);
      const std::size_t bytes = mm.packed_b_bytes();
      auto* whole = static_cast<std::uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
      auto* parts = static_cast<std::uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
      std::fill_n(whole, bytes, 0xAB);
      std::fill_n(parts, bytes, 0xCD);
      mm.pack_b(b.data(), true, whole, 0, sh.k);
      constexpr std::int64_t step = detail::DenseMatmul::kPackRows;
      for (std::int64_t first = 0; first < sh.k; first += step) {
        mm.pack_b(b.data(), true, parts, first, std::min(sh.k, first + step));
      }
      EXPECT_TRUE(std::equal(whole, whole + bytes, parts));
      std::free(whole);
      std::free(parts);
    }
  }
}

// A layer's gradient from its mask alone (the first layer's), and an empty batch.
TEST(DensePath, MaskStreamsAndEmptyBatches) {
  const CsrMatrix w = CsrMatrix::random(50, 40, 0.6, 12);
  const WeightStream mask = encode_stream(w, StreamKind::mask, 64);
  const DenseMatrix x = random_dense(40, 9, 13), dy = random_dense(50, 9, 14);
  CpuEngine engine = engine_on(ProductPath::dense);
  const Placement p = round_robin_placement(w, 1);
  const WeightStream g = engine.backward(mask, p, x.view(), dy.view(), nullptr);
  EXPECT_LT(testing::backward_weight_error(w, dy.view(), x.view(), testing::csr_gradient(g)),
            kTolerance);
  DenseMatrix x0(40, 0), y0(50, 0), dy0(50, 0), dx0(40, 0);
  const WeightStream s = encode_stream(w);
  engine.forward(s, p, x0.view(), y0.view());
  MutableMatrixView dx_view = dx0.view();
  const WeightStream g0 = engine.backward(s, p, x0.view(), dy0.view(), &dx_view);
  for (const float v : testing::csr_gradient(g0)) EXPECT_EQ(v, 0.0F);
}

// `automatic` takes the path the cost model names, and the model names the dense path
// where a layer is dense enough for a wide enough batch, the sparse one otherwise.
TEST(DensePath, AutomaticFollowsTheCostModel) {
  CpuEngine engine = engine_on(ProductPath::automatic);
  const PathCosts model = PathCosts::for_this_cpu();
  for (const Precision precision : {Precision::fp32, Precision::bf16}) {
    for (const double sparsity : {0.0, 0.5, 0.8, 0.95, 0.999}) {
      for (const std::int64_t tokens : {1, 16, 256}) {
        const CsrMatrix w = CsrMatrix::random(256, 512, sparsity, 15);
        const StreamHeader h = stream_header_for(w, StreamKind::weights, precision);
        EXPECT_EQ(engine.path_for(h, tokens), model.choose(256, 512, static_cast<double>(w.nnz()),
                                                           tokens, precision, engine.threads()));
      }
    }
    // The model's own behaviour: at every batch size, dense below its crossover and
    // sparse above it.
    for (const std::int64_t tokens : {1, 16, 256}) {
      const double crossover = model.crossover_sparsity(tokens, precision);
      if (crossover > 0.02) {
        const double below = 4096.0 * 4096 * (1 - (crossover - 0.01));
        EXPECT_EQ(model.choose(4096, 4096, below, tokens, precision, 2), ProductPath::dense);
      }
      if (crossover < 0.98) {
        const double above = 4096.0 * 4096 * (1 - (crossover + 0.01));
        EXPECT_EQ(model.choose(4096, 4096, above, tokens, precision, 2), ProductPath::sparse);
      }
    }
    ASSERT_GT(model.crossover_sparsity(256, precision), 0.0);
    ASSERT_LT(model.crossover_sparsity(256, precision), 1.0);
  }
  EXPECT_EQ(engine_on(ProductPath::sparse)
                .path_for(encode_stream(CsrMatrix::random(8, 8, 0, 1)).header, 256),
            ProductPath::sparse);
  EXPECT_EQ(parse_product_path("auto"), ProductPath::automatic);
  EXPECT_THROW(parse_product_path("fast"), ArgumentError);
}

}  // namespace
}  // namespace sluice
