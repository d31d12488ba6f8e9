// `sluice sweep` end to end on the real binary: a tiny sweep writes whole CSV and JSON
// files with one row per sparsity, bad arguments exit 2, an unwritable --out exits 1 and
// leaves no partial file behind.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "sweep_paths.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using Outcome = sluice::testing::CliOutcome;

/// Runs the CLI; `merge_stderr` false keeps only stdout (stderr is discarded).
Outcome run(const std::string& args, bool merge_stderr = true) {
  return sluice::testing::run_cli(SLUICE_CLI_PATH, args, merge_stderr);
}

using sluice::testing::read_file;

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, separator)) parts.push_back(part);
  return parts;
}

std::size_t count(const std::string& text, const std::string& word) {
  std::size_t n = 0;
  for (auto at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) ++n;
  return n;
}

/// Files in `dir` whose name marks an unfinished write.
std::vector<std::string> temporary_files(const fs::path& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& entry : fs::recursive_directory_iterator(dir, ec))
    if (entry.path().filename().string().find(".tmp.") != std::string::npos)
      found.push_back(entry.path().string());
  return found;
}

class CliSweep : public sluice::testing::TempDirTest {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
    TempDirTest::SetUp();
  }
};

constexpr const char* kTiny = "sweep --shape 64x48 --tokens 16 --threads 2 --repeat 1 --seed 3 ";

TEST_F(CliSweep, TinySweepWritesCsvAndJsonWithOneRowPerSparsity) {
  const fs::path out = dir_ / "nested" / "out";  // parents are created
  const Outcome o = run(std::string(kTiny) + "--sparsities 0,0.5,0.9 --out " + out.string());
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("residual"), std::string::npos) << o.output;

  const auto lines = split(read_file(out / "sweep.csv"), '\n');
  ASSERT_EQ(lines.size(), 4u);
  const auto header = split(lines[0], ',');
  for (const char* column : {"sparsity", "nnz", "measured_ms", "predicted_ms",
                             "measured_acceleration", "predicted_acceleration", "residual"})
    EXPECT_NE(std::find(header.begin(), header.end(), column), header.end()) << column;
  const double expected_sparsity[] = {0, 0.5, 0.9};
  const long expected_nnz_max[] = {64 * 48, 64 * 48 / 2 + 64, 64 * 48 / 10 + 64};
  for (std::size_t r = 1; r < lines.size(); ++r) {
    const auto cells = split(lines[r], ',');
    ASSERT_EQ(cells.size(), header.size()) << lines[r];
    EXPECT_DOUBLE_EQ(std::stod(cells[0]), expected_sparsity[r - 1]);
    const long nnz = std::stol(cells[2]);
    EXPECT_GT(nnz, 0);
    EXPECT_LE(nnz, expected_nnz_max[r - 1]);
    for (const std::size_t c : {3u, 4u, 6u, 7u}) EXPECT_GT(std::stod(cells[c]), 0) << lines[r];
    // residual = (predicted - measured) / measured, as printed.
    const double measured = std::stod(cells[3]), predicted = std::stod(cells[4]);
    EXPECT_NEAR(std::stod(cells[8]), (predicted - measured) / measured, 1e-9);
  }

  const std::string json = read_file(out / "sweep.json");
  for (const char* key :
       {"\"points\"", "\"fit\"", "\"measured_ms\"", "\"predicted_ms\"", "\"measured_acceleration\"",
        "\"predicted_acceleration\"", "\"residual\"", "\"constants\"", "\"r_squared\"",
        "\"held_at_zero\"", "\"nnz\"", "\"dense_ms\"", "\"dense_best_ms\"", "\"dense_best_kind\"",
        "\"acceleration_vs_best\""})
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in\n" << json;
  EXPECT_EQ(count(json, "\"sparsity\""), 3u) << json;
  EXPECT_TRUE(temporary_files(out).empty());
}

TEST_F(CliSweep, JsonOnStdoutMatchesTheFile) {
  const fs::path out = dir_ / "out";
  const Outcome o = run(std::string(kTiny) + "--sparsities 0,0.75 --json --out " + out.string(),
                        /*merge_stderr=*/false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.output, read_file(out / "sweep.json"));
  EXPECT_EQ(o.output.front(), '{');
  EXPECT_EQ(count(o.output, "\"sparsity\""), 2u);
}

TEST_F(CliSweep, TrainingStepSweepRuns) {
  const fs::path out = dir_ / "out";
  const Outcome o =
      run(std::string(kTiny) + "--training --sparsities 0.5,0.9 --json --out " + out.string(),
          /*merge_stderr=*/false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("\"training_step\""), std::string::npos) << o.output;
  EXPECT_EQ(split(read_file(out / "sweep.csv"), '\n').size(), 3u);
  // The backward streams as training's does: by output where a bf16 stream by input
  // cannot address the layer's outputs (it was refused).
  const Outcome tall =
      run("sweep --shape 70000x3 --tokens 4 --repeat 1 --precision bf16 "
          "--training --sparsities 0.9 --out " +
          out.string());
  EXPECT_EQ(tall.exit_code, 0) << tall.output;
}

// --path both times each point on the dense path too, and fits the path model to it.
TEST_F(CliSweep, BothPathsTimeEachPointAndFitThePathModel) {
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const fs::path out = dir_ / precision;
    const Outcome o = run(std::string(kTiny) + "--sparsities 0,0.5,0.9 --path both --precision " +
                              precision + " --json --out " + out.string(),
                          /*merge_stderr=*/false);
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(count(o.output, "\"dense_path_ms\""), 3u) << o.output;
    for (const char* key : {"\"path_fit\"", "\"dense_fitted\": true", "\"sparse_fitted\": true",
                            "\"densify_per_packet\"", "\"crossover_sparsity\"",
                            "\"dense_path_acceleration_vs_best\""}) {
      EXPECT_NE(o.output.find(key), std::string::npos) << key << " missing in\n" << o.output;
    }
    EXPECT_NE(o.output.find(std::string("\"precision\": \"") + precision), std::string::npos);
  }
  const Outcome dense = run(std::string(kTiny) + "--sparsities 0.5 --path dense --training --out " +
                            (dir_ / "dense").string());
  ASSERT_EQ(dense.exit_code, 0) << dense.output;
  EXPECT_NE(dense.output.find("dense_path_ms"), std::string::npos) << dense.output;
  EXPECT_EQ(run("sweep --path fastest --out " + (dir_ / "never").string()).exit_code, 2);
  EXPECT_EQ(run("sweep --precision fp16 --out " + (dir_ / "never").string()).exit_code, 2);
}

// The fit recovers the constants points were made from, and the crossover they imply; the
// streamed product's fixed term stays as held, or is dropped where the points take less.
TEST(SweepPathFit, RecoversTheConstantsOfItsPoints) {
  using namespace sluice;
  PathCosts truth = PathCosts::measured_with(Bf16Unit::avx512_bf16);
  truth.sparse_per_nnz_token[1] = 5e-11;
  truth.sparse_per_nnz[1] = 4e-10;
  truth.dense_per_mac[1] = 3e-12;
  truth.densify_per_slot[1] = 4e-10;
  truth.densify_per_packet[1] = 9e-10;
  PathCosts held = PathCosts::measured_with(Bf16Unit::none);
  held.sparse_per_nnz[1] = truth.sparse_per_nnz[1];
  const std::int64_t out = 512, in = 256, tokens = 64;
  const int threads = 2;
  std::vector<cli::PathPoint> points;
  for (const double density : {1.0, 0.5, 0.2, 0.05}) {
    const double nnz = density * out * in;
    points.push_back({nnz, truth.sparse_seconds(nnz, tokens, Precision::bf16, threads),
                      truth.dense_seconds(out, in, nnz, tokens, Precision::bf16, threads)});
  }
  const double matmul = static_cast<double>(out) * in * tokens * truth.dense_per_mac[1] / threads;
  const cli::PathFit f =
      cli::fit_path_costs(held, out, in, tokens, threads, Precision::bf16, matmul, points);
  ASSERT_TRUE(f.sparse_fitted);
  ASSERT_TRUE(f.dense_fitted);
  EXPECT_NEAR(f.costs.sparse_per_nnz_token[1], 5e-11, 1e-16);
  EXPECT_EQ(f.costs.sparse_per_nnz[1], 4e-10);
  EXPECT_NEAR(f.costs.dense_per_mac[1], 3e-12, 1e-17);
  EXPECT_NEAR(f.costs.densify_per_slot[1], 4e-10, 1e-15);
  EXPECT_NEAR(f.costs.densify_per_packet[1], 9e-10, 1e-15);
  EXPECT_EQ(f.costs.dense_per_mac[0], held.dense_per_mac[0]);  // fp32 not measured
  EXPECT_NEAR(f.crossover, truth.crossover_sparsity(tokens, Precision::bf16), 1e-9);
  EXPECT_NEAR(f.builtin_crossover, held.crossover_sparsity(tokens, Precision::bf16), 1e-12);
  EXPECT_LT(f.rms_dense_residual, 1e-9);
  // A held fixed term larger than the streamed points' whole time is dropped.
  held.sparse_per_nnz[1] = 1e-6;
  const cli::PathFit dropped =
      cli::fit_path_costs(held, out, in, tokens, threads, Precision::bf16, matmul, points);
  EXPECT_EQ(dropped.costs.sparse_per_nnz[1], 0);
  EXPECT_GT(dropped.costs.sparse_per_nnz_token[1], 5e-11);
  // Only streamed points: the dense terms stay held.
  for (auto& p : points) p.dense_seconds = 0;
  const cli::PathFit sparse_only =
      cli::fit_path_costs(held, out, in, tokens, threads, Precision::bf16, 0, points);
  EXPECT_FALSE(sparse_only.dense_fitted);
  EXPECT_EQ(sparse_only.costs.densify_per_packet[1], held.densify_per_packet[1]);
}

TEST(SweepPathFit, TilesFasterThanTheWholeMatmulSetTheMultiplyAddRate) {
  // Where the dense path's tiles beat oneDNN's whole matmul timed beside them, the fit
  // takes the tiles' rate for the multiply-adds rather than a densifying cost below zero.
  using namespace sluice;
  PathCosts truth = PathCosts::measured_with(Bf16Unit::none);
  truth.dense_per_mac[0] = 4e-12;
  truth.densify_per_slot[0] = 0;
  truth.densify_per_packet[0] = 2e-10;
  const PathCosts held = PathCosts::measured_with(Bf16Unit::amx);
  const std::int64_t out = 512, in = 256, tokens = 64;
  std::vector<cli::PathPoint> points;
  for (const double density : {1.0, 0.5, 0.2}) {
    const double nnz = density * out * in;
    points.push_back({nnz, 0, truth.dense_seconds(out, in, nnz, tokens, Precision::fp32, 1)});
  }
  const double slower_matmul = 1.25 * static_cast<double>(out) * in * tokens * 4e-12;
  const cli::PathFit f =
      cli::fit_path_costs(held, out, in, tokens, 1, Precision::fp32, slower_matmul, points);
  ASSERT_TRUE(f.dense_fitted);
  EXPECT_FALSE(f.sparse_fitted);
  EXPECT_NEAR(f.costs.dense_per_mac[0], 4e-12, 1e-18);
  EXPECT_EQ(f.costs.densify_per_slot[0], 0);
  EXPECT_NEAR(f.costs.densify_per_packet[0], 2e-10, 1e-16);
  EXPECT_LT(f.rms_dense_residual, 1e-9);
  // What --save-path-costs keeps: the fitted precision's measured terms, the rest as given.
  const PathCosts base = PathCosts::measured_with(Bf16Unit::avx512_bf16);
  const PathCosts saved = cli::with_fitted_terms(base, f, Precision::fp32);
  EXPECT_EQ(saved.dense_per_mac[0], f.costs.dense_per_mac[0]);
  EXPECT_EQ(saved.densify_per_packet[0], f.costs.densify_per_packet[0]);
  EXPECT_EQ(saved.sparse_per_nnz_token[0], base.sparse_per_nnz_token[0]);  // not timed
  EXPECT_EQ(saved.dense_per_mac[1], base.dense_per_mac[1]);
}

// --save-path-costs writes the fit into a file SLUICE_PATH_COSTS then makes --path auto
// choose by; a corrupt file is refused before the sweep measures, and left as it was.
TEST_F(CliSweep, SavedPathCostsSteerTheAutomaticPath) {
  const fs::path costs = dir_ / "costs.json";
  const Outcome saved =
      run(std::string(kTiny) + "--sparsities 0,0.5 --path both --precision bf16 " + "--out " +
          (dir_ / "o").string() + " --save-path-costs " + costs.string());
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  const sluice::PathCosts read = sluice::PathCosts::read(costs, sluice::PathCosts{});
  EXPECT_GT(read.sparse_per_nnz_token[1], 0);

  // A file whose streamed product is dear makes a 90% sparse layer dense, and one whose
  // dense kernel is dear makes a dense layer streamed.
  auto with = [&](double sparse, double dense) {
    sluice::PathCosts c = read;
    c.sparse_per_nnz_token = {sparse, sparse};
    c.dense_per_mac = {dense, dense};
    std::ofstream(costs) << c.to_json();
    return "env SLUICE_PATH_COSTS=" + costs.string() + " " + SLUICE_CLI_PATH;
  };
  const std::string spmm = "spmm --shape 64x48 --tokens 32 --repeat 1 --json --sparsity ";
  const auto dear_sparse = sluice::testing::run_cli(with(1, 1e-15), spmm + "0.9", false);
  ASSERT_EQ(dear_sparse.exit_code, 0) << dear_sparse.output;
  EXPECT_NE(dear_sparse.output.find("\"path\": \"dense\""), std::string::npos)
      << dear_sparse.output;
  EXPECT_NE(dear_sparse.output.find("\"path_costs\": \"SLUICE_PATH_COSTS=" + costs.string()),
            std::string::npos)
      << dear_sparse.output;
  const auto dear_dense = sluice::testing::run_cli(with(1e-15, 1), spmm + "0", false);
  ASSERT_EQ(dear_dense.exit_code, 0) << dear_dense.output;
  EXPECT_NE(dear_dense.output.find("\"path\": \"sparse\""), std::string::npos) << dear_dense.output;

  std::ofstream(costs) << "{\"format\": \"sluice path costs\", \"version\": 1, \"bf16\": 7}";
  const std::string corrupt = read_file(costs);
  const auto refused_run = sluice::testing::run_cli(
      "env SLUICE_PATH_COSTS=" + costs.string() + " " + SLUICE_CLI_PATH, spmm + "0.5");
  EXPECT_EQ(refused_run.exit_code, 1) << refused_run.output;
  EXPECT_NE(refused_run.output.find(costs.string()), std::string::npos) << refused_run.output;
  const Outcome not_measured = run(std::string(kTiny) + "--sparsities 0.5 --path both --out " +
                                   (dir_ / "p").string() + " --save-path-costs " + costs.string());
  EXPECT_EQ(not_measured.exit_code, 1) << not_measured.output;
  EXPECT_NE(not_measured.output.find("\"bf16\" is not an object"), std::string::npos)
      << not_measured.output;
  EXPECT_EQ(read_file(costs), corrupt);
  EXPECT_EQ(run(std::string(kTiny) + "--sparsities 0.5 --out " + (dir_ / "q").string() +
                " --save-path-costs " + (dir_ / "no-such-dir" / "c.json").string())
                .exit_code,
            2);
  EXPECT_FALSE(fs::exists(dir_ / "q" / "sweep.json"));
  // A pipe would be read until a writer came (a hang) and then replaced: refused.
  ASSERT_EQ(::mkfifo((dir_ / "pipe").c_str(), 0600), 0);
  const Outcome piped = run(std::string(kTiny) + "--sparsities 0.5 --out " + (dir_ / "r").string() +
                            " --save-path-costs " + (dir_ / "pipe").string());
  EXPECT_EQ(piped.exit_code, 2) << piped.output;
  EXPECT_NE(piped.output.find("is not a file (a device or pipe)"), std::string::npos)
      << piped.output;
  EXPECT_TRUE(fs::is_fifo(dir_ / "pipe"));
}

TEST_F(CliSweep, BadArgumentsExitWithTwo) {
  const std::string out = " --out " + (dir_ / "never").string();
  for (const std::string& args :
       {std::string("--sparsities 1"), std::string("--sparsities 0.5,1.5"),
        std::string("--sparsities -0.1"), std::string("--sparsities nan"),
        std::string("--sparsities ''"), std::string("--sparsities 0,,0.5"),
        std::string("--sparsities 0.5,"), std::string("--sparsities ,0.5"),
        std::string("--no-such-flag"), std::string("--shape 0x8"), std::string("--shape 8"),
        std::string("--tokens 0"), std::string("--repeat 0"), std::string("--threads 0")}) {
    const Outcome o = run("sweep --shape 16x16 --tokens 4 --repeat 1 " + args + out);
    EXPECT_EQ(o.exit_code, 2) << args << "\n" << o.output;
  }
  EXPECT_FALSE(fs::exists(dir_ / "never"));  // refused before anything was written
}

TEST_F(CliSweep, UnwritableOutExitsWithOneAndLeavesNoPartialFile) {
  // --out below a regular file cannot be created.
  std::ofstream(dir_ / "a-file") << "x";
  Outcome o =
      run(std::string(kTiny) + "--sparsities 0.5 --out " + (dir_ / "a-file" / "out").string());
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("a-file"), std::string::npos) << o.output;

  // sweep.json cannot replace a directory of that name: exit 1, the directory is untouched
  // and no temporary file is left.
  const fs::path out = dir_ / "out";
  fs::create_directories(out / "sweep.json" / "keep");
  o = run(std::string(kTiny) + "--sparsities 0.5 --out " + out.string());
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("sweep.json"), std::string::npos) << o.output;
  EXPECT_TRUE(fs::is_directory(out / "sweep.json" / "keep"));
  EXPECT_TRUE(temporary_files(out).empty());
}

// Without gnuplot the plot is not drawn, and a plot of an earlier run must not stay beside
// this run's CSV as if it were its own, nor be listed as written.
TEST_F(CliSweep, WithoutGnuplotAnEarlierPlotIsRemovedNotReported) {
  const fs::path out = dir_ / "out";
  fs::create_directories(out);
  std::ofstream(out / "sweep.png") << "a plot of another sweep";
  const Outcome o = sluice::testing::run_cli(
      "env PATH=" + (dir_ / "no-programs-here").string() + " " + SLUICE_CLI_PATH,
      std::string(kTiny) + "--sparsities 0.5,0.9 --out " + out.string());
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("gnuplot not on PATH"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("sweep.png"), std::string::npos) << o.output;
  EXPECT_FALSE(fs::exists(out / "sweep.png"));
  EXPECT_TRUE(fs::exists(out / "sweep.csv"));
}

}  // namespace
