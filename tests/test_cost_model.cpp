// The cost model: its arithmetic, calibration by least squares, the wafer-scale
// predictions of seed 002, and the JSON writer it (and the CLI) print with.
#include <nlohmann/json.hpp>

#include "sluice/cost_model.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sluice/error.hpp"

namespace sluice {
namespace {

Geometry make_geometry(std::int32_t lanes, std::int32_t blocks, std::int32_t tile = 0) {
  Geometry g;
  g.lanes = lanes;
  g.blocks = blocks;
  g.tile_tokens = tile;
  return g;
}

LayerWork make_work(std::int64_t outputs, std::int64_t inputs, std::int64_t tokens, Geometry g,
                    double max_lane_nnz) {
  LayerWork w;
  w.outputs = outputs;
  w.inputs = inputs;
  w.tokens = tokens;
  w.geometry = g;
  w.max_lane_nnz = max_lane_nnz;
  return w;
}

CostConstants cpu_like_constants() {
  CostConstants c;
  c.axpy_fixed = 5e-9;              // per packet
  c.axpy_per_token = 4e-11;         // ~50 GFLOP/s per lane
  c.partial_sum_fixed = 2e-7;       // per output hand-off
  c.partial_sum_per_token = 1e-10;  // moving the accumulator
  c.layer_fixed = 5e-5;             // dispatch, fill and drain
  c.dense_flops = 4e11;
  return c;
}

// ---- arithmetic ----------------------------------------------------------------------

TEST(CostModel, TermsCountPassesAndFullestBlock) {
  // 1000 tokens in tiles of 300 over 3 blocks: passes of 300, 300, 300, 100 tokens; the
  // fullest block holds 100, 100, 100, 34 tokens.
  const auto terms = cost_terms(make_work(7, 11, 1000, make_geometry(2, 3, 300), 13));
  EXPECT_DOUBLE_EQ(terms[0], 13.0 * 4);
  EXPECT_DOUBLE_EQ(terms[1], 13.0 * 334);
  EXPECT_DOUBLE_EQ(terms[2], 7.0 * 4);
  EXPECT_DOUBLE_EQ(terms[3], 7.0 * 334);
  EXPECT_DOUBLE_EQ(terms[4], 1.0);

  // tile 0 and a tile larger than the tokens both mean one pass.
  for (const std::int32_t tile : {0, 5000}) {
    const auto one = cost_terms(make_work(7, 11, 1000, make_geometry(2, 3, tile), 13));
    EXPECT_DOUBLE_EQ(one[0], 13.0);
    EXPECT_DOUBLE_EQ(one[1], 13.0 * 334);  // ceil(1000 / 3)
    EXPECT_DOUBLE_EQ(one[2], 7.0);
  }
}

TEST(CostModel, StreamSharesDivideTheStreamsWork) {
  // Each of S shares sees 1/S of the busiest lane's non-zeros and of the outputs; the
  // tokens per block and the passes stay.
  Geometry g = make_geometry(2, 1, 16);
  g.shares = 3;
  const auto shared = cost_terms(make_work(30, 11, 16, g, 12));
  EXPECT_DOUBLE_EQ(shared[0], 4.0);
  EXPECT_DOUBLE_EQ(shared[1], 4.0 * 16);
  EXPECT_DOUBLE_EQ(shared[2], 10.0);
  EXPECT_DOUBLE_EQ(shared[3], 10.0 * 16);
  EXPECT_DOUBLE_EQ(shared[4], 1.0);
  g.shares = -1;
  EXPECT_THROW(cost_terms(make_work(30, 11, 16, g, 12)), ArgumentError);
}

TEST(CostModel, LayerTimeMatchesFormula) {
  const CostConstants c = cpu_like_constants();
  const CostModel model(c);
  const Geometry g = make_geometry(4, 2);
  const LayerWork work = make_work(300, 1000, 512, g, 12345);
  const double tq = 256;
  const double expected = 12345 * (c.axpy_fixed + c.axpy_per_token * tq) +
                          300 * (c.partial_sum_fixed + c.partial_sum_per_token * tq) +
                          c.layer_fixed;
  EXPECT_NEAR(model.layer_seconds(work), expected, 1e-15 * expected + 1e-18);
  EXPECT_DOUBLE_EQ(model.axpy_seconds(tq), c.axpy_fixed + c.axpy_per_token * tq);
  EXPECT_DOUBLE_EQ(model.partial_sum_seconds(tq),
                   c.partial_sum_fixed + c.partial_sum_per_token * tq);
  EXPECT_DOUBLE_EQ(model.dense_seconds(300, 1000, 512), 2.0 * 300 * 1000 * 512 / c.dense_flops);
}

TEST(CostModel, UniformWorkDealsWholeFeaturesRoundRobin) {
  // 10 features on 4 lanes: the busiest lane has 3 features of 100 * 0.2 non-zeros.
  const LayerWork w = uniform_layer_work(make_geometry(4, 1), 100, 10, 64, 0.8);
  EXPECT_NEAR(w.max_lane_nnz, 3 * 20.0, 1e-9);
  // More lanes than features: one feature per busy lane.
  EXPECT_NEAR(uniform_layer_work(make_geometry(64, 1), 100, 10, 64, 0.5).max_lane_nnz, 50.0, 1e-9);
  EXPECT_DOUBLE_EQ(uniform_layer_work(make_geometry(4, 1), 100, 10, 64, 1.0).max_lane_nnz, 0.0);
}

TEST(CostModel, AccelerationIsMonotoneInSparsity) {
  const CostModel cpu(cpu_like_constants());
  const CostModel wafer = WaferSystem::wse2().cost_model();
  std::vector<double> sparsities;
  for (double density = 1.0; density > 1e-6; density *= 0.7) sparsities.push_back(1 - density);
  for (const auto& [model, geometry] :
       {std::pair{cpu, make_geometry(2, 1)}, std::pair{wafer, make_geometry(878, 968)}}) {
    const auto curve = model.acceleration_curve(geometry, 4096, 1024, 8192, sparsities);
    ASSERT_EQ(curve.size(), sparsities.size());
    for (std::size_t i = 1; i < curve.size(); ++i)
      EXPECT_GT(curve[i], curve[i - 1]) << "sparsity " << sparsities[i];
  }
}

TEST(CostModel, SaturationIsTheAnalyticalLimit) {
  const CostConstants c = cpu_like_constants();
  const CostModel model(c);
  const Geometry g = make_geometry(3, 2, 1000);
  const std::int64_t outputs = 2048, inputs = 777, tokens = 2500;
  // Passes of 1000, 1000, 500 tokens; fullest block 500, 500, 250 tokens.
  const double partial_sums = outputs * (3 * c.partial_sum_fixed + 1250 * c.partial_sum_per_token);
  const double dense = 2.0 * outputs * inputs * tokens / c.dense_flops;
  const double limit = dense / (partial_sums + c.layer_fixed);
  const double saturation = model.saturation_acceleration(g, outputs, inputs, tokens);
  EXPECT_NEAR(saturation, limit, 1e-12 * limit);
  const double nearly = model.acceleration(g, outputs, inputs, tokens, 1 - 1e-9);
  EXPECT_LT(nearly, saturation);
  EXPECT_NEAR(nearly, saturation, 1e-4 * saturation);
  EXPECT_LT(model.acceleration(g, outputs, inputs, tokens, 0.999), nearly);

  // No fixed costs at all: nothing limits the acceleration.
  CostConstants free = c;
  free.partial_sum_fixed = free.partial_sum_per_token = free.layer_fixed = 0;
  EXPECT_TRUE(std::isinf(CostModel(free).saturation_acceleration(g, outputs, inputs, tokens)));
}

TEST(CostModel, RefusesBadInput) {
  const CostModel model(cpu_like_constants());
  EXPECT_THROW(model.layer_seconds(make_work(0, 10, 10, make_geometry(1, 1), 0)), ShapeError);
  EXPECT_THROW(model.layer_seconds(make_work(10, 10, 10, make_geometry(0, 1), 0)), ArgumentError);
  EXPECT_THROW(model.layer_seconds(make_work(10, 10, 10, make_geometry(1, 0), 0)), ArgumentError);
  EXPECT_THROW(model.layer_seconds(make_work(10, 10, 10, make_geometry(1, 1, -5), 0)),
               ArgumentError);
  EXPECT_THROW(model.layer_seconds(make_work(10, 10, 10, make_geometry(1, 1), 101)), ShapeError);
  EXPECT_THROW(model.layer_seconds(make_work(10, 10, 10, make_geometry(1, 1), -1)), ShapeError);
  EXPECT_THROW(model.acceleration(make_geometry(1, 1), 10, 10, 10, 1.5), ArgumentError);
  EXPECT_THROW(model.acceleration(make_geometry(1, 1), 10, 10, 10, std::nan("")), ArgumentError);
  CostConstants negative = cpu_like_constants();
  negative.partial_sum_fixed = -1e-9;
  EXPECT_THROW(CostModel{negative}, ArgumentError);
  CostConstants no_dense = cpu_like_constants();
  no_dense.dense_flops = 0;
  EXPECT_THROW(CostModel(no_dense).dense_seconds(10, 10, 10), ArgumentError);
}

// ---- calibration ---------------------------------------------------------------------

// Runs over a spread of shapes, token counts, geometries and sparsities, timed by the
// model with `truth` and perturbed by up to +-noise (relative, deterministic).
std::vector<MeasuredRun> synthetic_runs(const CostConstants& truth, double noise,
                                        unsigned seed = 7) {
  const CostModel model(truth);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> jitter(-noise, noise);
  std::vector<MeasuredRun> runs;
  for (const std::int64_t outputs : {64, 512, 4096})
    for (const std::int64_t tokens : {16, 256, 4096})
      for (const double sparsity : {0.0, 0.9, 0.999, 0.9999})
        for (const std::int32_t lanes : {1, 4}) {
          // Long token vectors in one pass and in tiles, so the per-token and per-pass
          // terms are told apart.
          const std::int32_t tile = (tokens == 4096 && lanes == 1) ? 1024 : 0;
          const Geometry g = make_geometry(lanes, tokens >= 256 ? 2 : 1, tile);
          MeasuredRun run;
          run.work = uniform_layer_work(g, outputs, 1024, tokens, sparsity);
          run.seconds = model.layer_seconds(run.work) * (1 + jitter(rng));
          runs.push_back(run);
        }
  return runs;
}

TEST(Calibration, RecoversKnownConstantsFromNoisyTimings) {
  const CostConstants truth = cpu_like_constants();
  CalibrationOptions options;
  options.held.dense_flops = truth.dense_flops;
  const CalibrationResult fit = calibrate(synthetic_runs(truth, 0.01), options);
  const auto expected = truth.terms();
  const auto got = fit.constants.terms();
  for (int t = 0; t < kCostTerms; ++t)
    EXPECT_NEAR(got[t], expected[t], 0.03 * expected[t]) << cost_term_name(t);
  EXPECT_EQ(fit.constants.dense_flops, truth.dense_flops);
  EXPECT_TRUE(fit.held_at_zero.empty());
  EXPECT_GT(fit.r_squared, 0.999);
  EXPECT_LT(fit.rms_relative_residual, 0.01);
  ASSERT_EQ(fit.relative_residuals.size(), fit.runs.size());
  for (std::size_t i = 0; i < fit.runs.size(); ++i) {
    EXPECT_LT(std::abs(fit.relative_residuals[i]), 0.025);
    EXPECT_NEAR(fit.relative_residuals[i],
                (fit.predicted_seconds[i] - fit.runs[i].seconds) / fit.runs[i].seconds, 1e-12);
  }
  EXPECT_GE(fit.condition_number, 1.0);
}

TEST(Calibration, ExactDataGivesExactConstants) {
  const CostConstants truth = cpu_like_constants();
  const CalibrationResult fit = calibrate(synthetic_runs(truth, 0.0));
  const auto expected = truth.terms();
  for (int t = 0; t < kCostTerms; ++t)
    EXPECT_NEAR(fit.constants.terms()[t], expected[t], 1e-8 * expected[t]) << cost_term_name(t);
  EXPECT_NEAR(fit.r_squared, 1.0, 1e-12);
}

TEST(Calibration, NegativeConstantIsFixedAtZero) {
  // Timings made with a negative per-token partial-sum cost (still positive times): the
  // unconstrained fit goes negative, the active set pins it at zero and refits the rest.
  CostConstants truth = cpu_like_constants();
  truth.partial_sum_per_token = 0;
  std::vector<MeasuredRun> runs = synthetic_runs(truth, 0.0);
  for (auto& run : runs) {
    const auto terms = cost_terms(run.work);
    run.seconds -= 2e-11 * terms[3];
    ASSERT_GT(run.seconds, 0);
  }
  const CalibrationResult fit = calibrate(runs);
  ASSERT_EQ(fit.held_at_zero.size(), 1u);
  EXPECT_EQ(fit.held_at_zero[0], "partial_sum_per_token_seconds");
  EXPECT_EQ(fit.constants.partial_sum_per_token, 0.0);
  for (const double v : fit.constants.terms()) EXPECT_GE(v, 0.0);
  EXPECT_NO_THROW(CostModel{fit.constants});
}

TEST(Calibration, HeldTermsAreNotFitted) {
  const CostConstants truth = cpu_like_constants();
  CalibrationOptions options;
  options.fit = {false, true, false, true, true};
  options.held = truth;
  const CalibrationResult fit = calibrate(synthetic_runs(truth, 0.0), options);
  EXPECT_EQ(fit.constants.axpy_fixed, truth.axpy_fixed);
  EXPECT_EQ(fit.constants.partial_sum_fixed, truth.partial_sum_fixed);
  EXPECT_NEAR(fit.constants.axpy_per_token, truth.axpy_per_token, 1e-8 * truth.axpy_per_token);
}

TEST(Calibration, RefusesTooFewRuns) {
  auto runs = synthetic_runs(cpu_like_constants(), 0.0);
  runs.resize(4);
  try {
    calibrate(runs);
    FAIL() << "4 runs for 5 constants were accepted";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("at least"), std::string::npos) << e.what();
  }
  EXPECT_THROW(calibrate({}), ArgumentError);
  // Fewer constants to fit: fewer runs suffice.
  CalibrationOptions two;
  two.fit = {false, true, false, false, true};
  EXPECT_NO_THROW(calibrate({runs[0], runs[3]}, two));
}

TEST(Calibration, RefusesRunsThatCannotSeparateTheConstants) {
  // Every run has the same tokens per block and one pass: a0 and a1 (and b0 and b1) only
  // ever appear in a fixed ratio.
  const CostModel model(cpu_like_constants());
  std::vector<MeasuredRun> runs;
  for (const std::int64_t outputs : {64, 256, 1024, 4096})
    for (const double sparsity : {0.0, 0.5, 0.9}) {
      MeasuredRun run;
      run.work = uniform_layer_work(make_geometry(2, 1), outputs, 512, 128, sparsity);
      run.seconds = model.layer_seconds(run.work);
      runs.push_back(run);
    }
  try {
    calibrate(runs);
    FAIL() << "an unidentifiable fit was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot tell apart"), std::string::npos) << e.what();
  }
}

TEST(Calibration, RefusesBadMeasurements) {
  auto runs = synthetic_runs(cpu_like_constants(), 0.0);
  runs[3].seconds = 0;
  EXPECT_THROW(calibrate(runs), ArgumentError);
  runs[3].seconds = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(calibrate(runs), ArgumentError);
  runs = synthetic_runs(cpu_like_constants(), 0.0);
  runs[5].work.geometry.lanes = 0;
  EXPECT_THROW(calibrate(runs), ArgumentError);
}

TEST(Calibration, SerialisesToJson) {
  const CalibrationResult fit = calibrate(synthetic_runs(cpu_like_constants(), 0.01));
  const std::string json = fit.to_json();
  for (const char* key :
       {"\"constants\"", "\"axpy_fixed_seconds\"", "\"layer_fixed_seconds\"", "\"dense_flops\"",
        "\"r_squared\"", "\"points\"", "\"relative_residual\"", "\"held_at_zero\": []"})
    EXPECT_NE(json.find(key), std::string::npos) << key;
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  EXPECT_EQ(json.find("nan"), std::string::npos);
  const auto parsed = nlohmann::json::parse(json);
  EXPECT_EQ(parsed["points"].size(), fit.runs.size());
  EXPECT_EQ(parsed["constants"]["dense_flops"], fit.constants.dense_flops);
}

// ---- the wafer-scale system ---------------------------------------------------------

TEST(Wafer, ParametersHaveSourcesAndAreConsistent) {
  const WaferSystem s = WaferSystem::wse2();
  const auto table = s.parameters();
  EXPECT_GE(table.size(), 15u);
  for (const auto& [name, v] : table) {
    EXPECT_FALSE(v.source.empty()) << name;
    EXPECT_FALSE(v.unit.empty()) << name;
    EXPECT_GT(v.value, 0) << name;
  }
  EXPECT_EQ(s.cores.value, 850000);
  EXPECT_EQ(s.peak_flops.value, 5.8e15);
  EXPECT_EQ(s.partial_sum_cycles.value, 4);
  // One fp32 FMAC per core per cycle does not reach the published peak; the derived
  // token-lane rate does, by construction.
  EXPECT_NEAR(s.fp32_scalar_peak_flops(), 1.87e15, 0.01e15);
  EXPECT_NEAR(s.token_lanes_per_core_cycle(), 3.10, 0.01);
  EXPECT_NEAR(s.clock_for_peak_from_fpus(), 0.853e9, 0.001e9);
  EXPECT_NEAR(2 * s.cores.value * s.clock_hz.value * s.token_lanes_per_core_cycle(),
              s.peak_flops.value, 1e-6 * s.peak_flops.value);
  // Dense work on the engine (every weight streamed, no partial sums) is the baseline.
  const CostModel model = s.cost_model();
  const Geometry g = s.geometry_for(12288, 1 << 20);
  EXPECT_EQ(static_cast<std::int64_t>(g.lanes) * g.blocks <= 850000, true);
  EXPECT_NEAR(model.constants().axpy_per_token * s.cores.value,
              2 * s.cores.value * s.cores.value / s.peak_flops.value, 1e-20);
}

TEST(Wafer, GeometryKeepsTheBusiestRowMinimal) {
  const WaferSystem s = WaferSystem::wse2();
  // 1024 features: 2 per row at best, so 512 rows and the other cores on tokens.
  const Geometry g1024 = s.geometry_for(1024, 1 << 22);
  EXPECT_EQ(g1024.lanes, 512);
  EXPECT_EQ(g1024.blocks, 850000 / 512);
  // 12288 features: 14 per row at best (12288 / 922 = 13.3) on 878 rows.
  EXPECT_EQ(s.geometry_for(12288, 1 << 22).lanes, 878);
  // Fewer features than rows, few tokens.
  const Geometry small = s.geometry_for(100, 7);
  EXPECT_EQ(small.lanes, 100);
  EXPECT_EQ(small.blocks, 7);
}

TEST(Wafer, KaplanCriticalBatch) {
  const KaplanScaling k;
  const TransformerShape gpt3 = gpt3_175b();
  EXPECT_NEAR(gpt3.parameters(), 1.739e11, 0.001e11);
  EXPECT_NEAR(k.loss(gpt3.parameters()), 1.605, 0.005);
  EXPECT_NEAR(k.critical_batch_tokens(gpt3), 2.1e7, 0.05e7);
  // Bigger models reach lower loss and so larger critical batches.
  const auto family = gpt3_family();
  ASSERT_EQ(family.size(), 8u);
  EXPECT_EQ(family.front().d_model, 768);
  EXPECT_EQ(family.back().d_model, 12288);
  for (std::size_t i = 1; i < family.size(); ++i)
    EXPECT_GT(k.critical_batch_tokens(family[i]), k.critical_batch_tokens(family[i - 1]));
}

// The predictions' behaviour, whatever the parameters' values: every curve rises with
// sparsity towards its saturation, which is dense time over the fixed per-output and
// per-layer costs at the tokens the engine holds.
TEST(Wafer, AccelerationRisesWithSparsityToDenseOverFixedCost) {
  const WaferSystem s = WaferSystem::wse2();
  const CostModel model = s.cost_model();
  const auto sparsities = standard_sparsities();
  for (const double bytes : {34.0, 2.0}) {
    ActivationMemory memory;
    memory.bytes_per_token_layer_per_d_model = bytes;
    for (const TransformerShape& shape : gpt3_family()) {
      for (const std::int32_t engines : {1, kSeedClusterEngines}) {
        const auto c = wafer_ffn_acceleration(s, shape, engines, sparsities, {}, memory);
        for (std::size_t i = 1; i < c.accelerations.size(); ++i)
          EXPECT_GT(c.accelerations[i], c.accelerations[i - 1]) << shape.name;
        EXPECT_GT(c.saturation, c.accelerations.back()) << shape.name;
        const std::int64_t outputs = 4 * shape.d_model;
        const double dense = model.dense_seconds(outputs, shape.d_model, c.tokens_per_engine);
        const double fixed =
            outputs * model.constants().partial_sum_fixed + model.constants().layer_fixed;
        EXPECT_NEAR(c.saturation, dense / fixed, 1e-9 * c.saturation) << shape.name;
        const double nearly =
            model.acceleration(c.geometry, outputs, shape.d_model, c.tokens_per_engine, 1 - 1e-9);
        EXPECT_NEAR(nearly, c.saturation, 1e-3 * c.saturation) << shape.name;
      }
    }
  }
}

// An engine holds no more tokens than its memory does: the cap binds where the batch
// share is larger, holds the bytes within the memory, and moves with the bytes assumed.
TEST(Wafer, MemoryCapsTheTokensAnEngineHolds) {
  const WaferSystem s = WaferSystem::wse2();
  const double memory_bytes = s.memory_bytes.value;
  for (const TransformerShape& shape : gpt3_family()) {
    for (const std::int32_t engines : {1, 4, kSeedClusterEngines, 1024}) {
      const auto c = wafer_ffn_acceleration(s, shape, engines, {0.9});
      const double share = c.batch_tokens / engines;
      EXPECT_LE(c.tokens_per_engine, c.token_capacity);
      EXPECT_LE(c.activation_bytes, memory_bytes) << shape.name;
      EXPECT_NEAR(static_cast<double>(c.tokens_per_engine),
                  std::min(share, static_cast<double>(c.token_capacity)), 1.0)
          << shape.name << " " << engines;
      EXPECT_DOUBLE_EQ(c.activation_bytes_per_token_layer,
                       ActivationMemory{}.bytes_per_token_layer_per_d_model * shape.d_model);
    }
  }
  // GPT-3 on one engine: the critical batch (~2e7 tokens) is far beyond 40 GB.
  const auto gpt3 = wafer_ffn_acceleration(s, gpt3_175b(), 1, {0.9});
  EXPECT_LT(gpt3.tokens_per_engine, gpt3.batch_tokens / 100);
  // The default assumes what lets GPT-3 train on one engine at all: a 2048-token sequence
  // fits. Korthikanti's 34 bytes would not hold one.
  EXPECT_GE(gpt3.tokens_per_engine, 2048);
  ActivationMemory korthikanti;
  korthikanti.bytes_per_token_layer_per_d_model = 34;
  EXPECT_LT(wafer_ffn_acceleration(s, gpt3_175b(), 1, {0.9}, {}, korthikanti).tokens_per_engine,
            2048);
  ActivationMemory lean;
  lean.bytes_per_token_layer_per_d_model = ActivationMemory{}.bytes_per_token_layer_per_d_model / 8;
  const auto leaner = wafer_ffn_acceleration(s, gpt3_175b(), 1, {0.9}, {}, lean);
  EXPECT_NEAR(static_cast<double>(leaner.tokens_per_engine), 8.0 * gpt3.tokens_per_engine, 8);
  EXPECT_GT(leaner.saturation, gpt3.saturation);
  ActivationMemory nothing;
  nothing.bytes_per_token_layer_per_d_model = 0;
  EXPECT_THROW(wafer_ffn_acceleration(s, gpt3_175b(), 1, {0.9}, {}, nothing), ArgumentError);
}

// Sharing a batch over more engines leaves each fewer (or as many) tokens: its
// saturation never rises.
TEST(Wafer, MoreEnginesNeverRaiseSaturation) {
  const WaferSystem s = WaferSystem::wse2();
  for (const double bytes : {34.0, 2.0, 0.01}) {
    ActivationMemory memory;
    memory.bytes_per_token_layer_per_d_model = bytes;
    for (const TransformerShape& shape : gpt3_family()) {
      double previous = std::numeric_limits<double>::infinity();
      for (std::int32_t engines = 1; engines <= 1024; engines *= 2) {
        const auto c = wafer_ffn_acceleration(s, shape, engines, {0.9}, {}, memory);
        EXPECT_LE(c.saturation, previous * (1 + 1e-12)) << shape.name << " " << engines;
        previous = c.saturation;
      }
    }
  }
  // Tens of thousands of non-zeros per engine row for 12288 x 49152 at 90%.
  const double per_row = s.nnz_per_engine_row(49152, 12288, 0.9);
  EXPECT_GE(per_row, 20000);
  EXPECT_LE(per_row, 100000);
}

TEST(Wafer, ClusterScalingIsLinearLongerForBiggerModels) {
  const WaferSystem s = WaferSystem::wse2();
  std::vector<std::int32_t> engines;
  for (std::int32_t n = 1; n <= 1024; n *= 2) engines.push_back(n);
  double previous_final_speedup = 0;
  for (const TransformerShape& shape :
       {TransformerShape{"1.3B", 24, 2048}, TransformerShape{"13B", 40, 5120}, gpt3_175b()}) {
    // Korthikanti's activations, so that one engine holds a small share of each model's
    // batch (with the leaner default the 1.3B model's engine holds so much of it that a
    // second engine gains less).
    ActivationMemory held;
    held.bytes_per_token_layer_per_d_model = 34;
    const auto points = predict_cluster_scaling(s, shape, 0.9, engines, {}, held);
    ASSERT_EQ(points.size(), engines.size());
    EXPECT_DOUBLE_EQ(points[0].speedup, 1.0);
    EXPECT_GT(points[1].speedup, 1.9);  // two engines: nearly twice as fast
    for (const auto& p : points) {
      EXPECT_LE(p.speedup, p.engines * (1 + 1e-9));
      EXPECT_GE(p.step_seconds, p.compute_seconds * (1 - 1e-12));
      EXPECT_GE(p.step_seconds, p.stream_seconds * (1 - 1e-12));
    }
    EXPECT_GT(points.back().speedup, previous_final_speedup) << shape.name;
    previous_final_speedup = points.back().speedup;
  }
  EXPECT_THROW(predict_cluster_scaling(s, gpt3_175b(), 0.9, {0}), ArgumentError);
}

}  // namespace
}  // namespace sluice

namespace sluice {
namespace {

TEST(Calibration, RecoversTheStreamSpillTermWhenStreamsOutgrowTheCache) {
  CostConstants truth;
  truth.axpy_fixed = 2e-9;
  truth.axpy_per_token = 6e-11;
  truth.partial_sum_fixed = 1e-8;
  truth.partial_sum_per_token = 1.3e-10;
  truth.layer_fixed = 5e-5;
  truth.stream_spill = 1.5e-9;
  truth.dense_flops = 2e11;
  std::vector<MeasuredRun> runs;
  for (std::int64_t tokens : {64, 128, 256}) {
    for (std::int32_t tile : {32, 64}) {
      for (double nnz : {1e5, 1e6, 3e6, 8e6, 16e6}) {
        MeasuredRun run;
        run.work = make_work(4096, 4096, tokens, make_geometry(1, 2, tile), nnz);
        run.work.cache_bytes = 32 << 20;
        const auto terms = cost_terms(run.work);
        for (int t = 0; t < kCostTerms; ++t) run.seconds += terms[t] * truth.terms()[t];
        runs.push_back(run);
      }
    }
  }
  // Below the cache the term is zero; above, it grows with the spilled packets.
  EXPECT_EQ(cost_terms(runs[0].work)[5], 0.0);
  EXPECT_GT(cost_terms(runs[4].work)[5], 0.0);
  CalibrationOptions options;
  options.fit.fill(true);
  options.fit[6] = false;  // no run packs tiles here
  const CalibrationResult fit = calibrate(runs, options);
  const auto expected = truth.terms();
  for (int t = 0; t < kCostTerms; ++t) {
    EXPECT_NEAR(fit.constants.terms()[t], expected[t], 1e-6 * expected[t]) << cost_term_name(t);
  }
}

}  // namespace
}  // namespace sluice
