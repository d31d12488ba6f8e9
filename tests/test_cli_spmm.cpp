// `sluice spmm` on the real binary: what its report and exit code promise a script — a
// check judged on the size of what was summed (underflow is not an error), a thread
// count that ran, and a dense baseline too large for the machine refused up front.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <thread>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using Outcome = sluice::testing::CliOutcome;

Outcome run(const std::string& args, bool merge_stderr = true) {
  return sluice::testing::run_cli(SLUICE_CLI_PATH, args, merge_stderr);
}

/// The number after `"key": ` in a JSON text; NaN when the key is missing.
double json_number(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\": ");
  if (at == std::string::npos) return std::nan("");
  return std::stod(json.substr(at + key.size() + 4));
}

class CliSpmm : public sluice::testing::TempDirTest {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
    TempDirTest::SetUp();
  }
};

// A weight below fp32's normal range: its products are denormal or zero in any fp32
// kernel. Judged against the size of the products alone that read as a 100% error (and
// a check that reports 1.0 and passes is a check nobody can use).
TEST_F(CliSpmm, CheckJudgesUnderflowAsUnderflow) {
  const fs::path file = dir_ / "denormal.mtx";
  std::ofstream(file) << "%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1 1e-45\n"
                      << "2 3 0.5\n";
  const Outcome o = run(
      "spmm --matrix " + file.string() + " --tokens 5 --repeat 1 --check --backward --json", false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_LT(json_number(o.output, "max_rel_error"), 1e-5) << o.output;
  EXPECT_LT(json_number(o.output, "max_rel_error_bwd"), 1e-5) << o.output;
}

// A script that runs many files reads which one each result is (null for a random W), and
// the table says it too.
TEST_F(CliSpmm, TheMatrixFileIsNamed) {
  const fs::path file = dir_ / "named.mtx";
  std::ofstream(file) << "%%MatrixMarket matrix coordinate real general\n3 3 1\n1 1 2\n";
  const Outcome o = run("spmm --matrix " + file.string() + " --tokens 2 --repeat 1 --json", false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("\"matrix\": \"" + file.string() + "\""), std::string::npos) << o.output;
  const Outcome table = run("spmm --matrix " + file.string() + " --tokens 2 --repeat 1");
  EXPECT_NE(table.output.find("sluice spmm: " + file.string() + ": 3 x 3 weights"),
            std::string::npos)
      << table.output;
  const Outcome random = run("spmm --shape 8x8 --sparsity 0.5 --tokens 2 --repeat 1 --json", false);
  EXPECT_NE(random.output.find("\"matrix\": null"), std::string::npos) << random.output;
}

TEST_F(CliSpmm, CheckPassesOnOrdinaryLayersInEveryPrecisionAndOrder) {
  for (const char* precision : {"fp32", "bf16"}) {
    for (const char* order : {"by_input", "by_output"}) {
      const Outcome o = run(std::string("spmm --shape 70x45 --sparsity 0.3,0.9 --tokens 19 ") +
                            "--repeat 1 --check --backward --precision " + precision +
                            " --backward-order " + order);
      EXPECT_EQ(o.exit_code, 0) << precision << " " << order << "\n" << o.output;
      EXPECT_EQ(o.output.find("check failed"), std::string::npos) << o.output;
    }
  }
  EXPECT_EQ(run("spmm --shape 8x8 --sparsity 0.5 --backward --backward-order sideways").exit_code,
            2);
}

// The default order is training's: by input where the layer can be streamed so, else by
// output (a bf16 stream by input addresses 65535 outputs); asked by input, such a layer is
// refused. The JSON says which order ran.
TEST_F(CliSpmm, TheBackwardOrderFollowsWhatTheLayerCanStream) {
  const std::string bf16 =
      "spmm --sparsity 0.9 --tokens 3 --repeat 1 --check --backward --precision bf16 --json ";
  const Outcome tall = run(bf16 + "--shape 70000x3", false);
  ASSERT_EQ(tall.exit_code, 0) << tall.output;
  EXPECT_NE(tall.output.find("\"backward_order\": \"by_output\""), std::string::npos);
  EXPECT_LT(json_number(tall.output, "max_rel_error_bwd"), 1e-5) << tall.output;
  const Outcome square = run(bf16 + "--shape 30x30", false);
  EXPECT_NE(square.output.find("\"backward_order\": \"by_input\""), std::string::npos);
  EXPECT_EQ(run(bf16 + "--shape 70000x3 --backward-order by_input").exit_code, 2);
}

TEST_F(CliSpmm, ReportsTheThreadsThatRan) {
  const Outcome o =
      run("spmm --shape 40x40 --sparsity 0.5 --tokens 8 --repeat 1 --threads 4096 --json");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--threads 4096, but this process can run"), std::string::npos)
      << o.output;
  const double threads = json_number(o.output, "threads");
  EXPECT_GE(threads, 1);
  EXPECT_LE(threads, std::thread::hardware_concurrency()) << o.output;
}

// 10^5 non-zeros are nothing for sluice, but oneDNN's W with its zeros would be 360 GB:
// refused before anything is allocated, naming the size.
TEST_F(CliSpmm, RefusesADenseBaselineLargerThanMemory) {
  const Outcome o = run("spmm --shape 300000x300000 --sparsity 0.999999 --tokens 1 --repeat 1");
  EXPECT_EQ(o.exit_code, 2) << o.output;
  EXPECT_NE(o.output.find("dense baseline of a 300000x300000 layer needs 360.0 GB"),
            std::string::npos)
      << o.output;
}

// --sparsity 0 makes W as dense as the baseline: the guard counts W's non-zeros, X and Y
// from the shape, before W is generated (it was checked after, so this W was made first).
TEST_F(CliSpmm, ChecksMemoryBeforeGeneratingW) {
  const Outcome o = run("spmm --shape 200000x200000 --sparsity 0 --tokens 1 --repeat 1");
  EXPECT_EQ(o.exit_code, 2) << o.output;
  EXPECT_NE(o.output.find("dense baseline of a 200000x200000 layer needs"), std::string::npos)
      << o.output;
}

// X and Y are not all a timing holds: the baseline's and the products' copies of them, and
// the dense path's packed X, are counted before anything is allocated (100000 tokens of a
// 10x4096 layer are 1.6 GB in fp32, under RLIMIT_AS at 2 GiB; the run would take about
// 2.4 GB streamed, more on the dense path, and was killed for memory).
TEST_F(CliSpmm, TheProductsCopiesOfXAndYAreBudgeted) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer cannot start under RLIMIT_AS";
  const std::string limited = std::string("prlimit --as=2147483648 ") + SLUICE_CLI_PATH;
  const std::string spmm = "spmm --shape 10x4096 --tokens 100000 --sparsity 0.9 --repeat 1 ";
  const Outcome sparse = sluice::testing::run_cli(limited, spmm + "--path sparse");
  EXPECT_EQ(sparse.exit_code, 2) << sparse.output;
  EXPECT_NE(sparse.output.find("X and Y at 100000 tokens), more than"), std::string::npos)
      << sparse.output;
  const Outcome dense = sluice::testing::run_cli(limited, spmm + "--path dense");
  EXPECT_EQ(dense.exit_code, 2) << dense.output;
  EXPECT_NE(dense.output.find("at 100000 tokens, on the dense path), more than"), std::string::npos)
      << dense.output;
}

// A list of sparsities is timed one W at a time: six dense 2000x2000 layers (32 MB of
// non-zeros each, more again in the engine's stream) peak where one does.
TEST_F(CliSpmm, MemoryDoesNotGrowWithTheSparsityList) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer's quarantine keeps freed W";
  const std::string common = "spmm --shape 2000x2000 --tokens 1 --repeat 1 --json --sparsity ";
  const Outcome one = run(common + "0", false);
  const Outcome six = run(common + "0,0,0,0,0,0", false);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(six.exit_code, 0) << six.output;
  const double single = json_number(one.output, "peak_rss_bytes");
  const double list = json_number(six.output.substr(six.output.rfind("\"out\"")), "peak_rss_bytes");
  EXPECT_LT(list, single + 64e6) << "one W: " << single << " bytes, six: " << list;
}

// The dense path multiplies a layer of fewer rows than a tile as a short tile, and its
// result buffer is as short: a 3-row layer at 524288 tokens holds about 16 MB of X and Y
// (the buffer was 256 rows of every token, 537 MB).
TEST_F(CliSpmm, TheDensePathsResultBufferIsAsShortAsTheLayer) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer's shadow memory is resident";
  const Outcome o =
      run("spmm --shape 3x5 --tokens 524288 --sparsity 0 --path dense --repeat 1 --json", false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_LT(json_number(o.output, "peak_rss_bytes"), 400e6) << o.output;
}

// A short .mtx may declare 2^31 - 1 rows: their 16 GiB of row offsets are compared with
// what this process may have (here RLIMIT_AS at 4 GiB) before any is allocated, and the
// message says what they would need and which limit binds. (A .smtx lists its offsets, so
// its size bounds them: a short one is refused for the bytes that do not follow.)
TEST_F(CliSpmm, DeclaredRowsAreBudgetedBeforeTheyAreAllocated) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer cannot start under RLIMIT_AS";
  const fs::path mtx = dir_ / "big.mtx";
  std::ofstream(mtx) << "%%MatrixMarket matrix coordinate real general\n2147483647 1 0\n";
  const Outcome o =
      sluice::testing::run_cli(std::string("prlimit --as=4294967296 ") + SLUICE_CLI_PATH,
                               "spmm --tokens 1 --repeat 1 --matrix " + mtx.string());
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find(mtx.string() + ":2:"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("row offsets needs 17179869184 bytes"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("RLIMIT_AS"), std::string::npos) << o.output;
  const fs::path smtx = dir_ / "big.smtx";
  std::ofstream(smtx) << "2147483647, 1, 0\n";
  const Outcome short_smtx = run("spmm --tokens 1 --repeat 1 --matrix " + smtx.string());
  EXPECT_EQ(short_smtx.exit_code, 1) << short_smtx.output;
  EXPECT_NE(short_smtx.output.find("bytes follow"), std::string::npos) << short_smtx.output;
}

// A fixed geometry is bounded by the problem: lanes by the inputs and threads, blocks by
// the tokens and threads, shares by the threads (4096 lanes and shares of a 64x40 layer
// took seconds for microseconds of work). Within the bounds it runs.
TEST_F(CliSpmm, AFixedGeometryIsBoundedByTheProblem) {
  const std::string common = "spmm --shape 64x40 --sparsity 0.5 --tokens 8 --repeat 1 --threads 1 ";
  for (const char* flags : {"--lanes 4096", "--lanes 2", "--blocks 2", "--shares 4096"}) {
    const Outcome o = run(common + flags);
    EXPECT_EQ(o.exit_code, 2) << flags << "\n" << o.output;
    EXPECT_NE(o.output.find(std::string(flags) + ": at most 1 here"), std::string::npos)
        << o.output;
  }
  const Outcome few = run("spmm --shape 64x3 --sparsity 0.5 --tokens 2 --repeat 1 --lanes 4");
  EXPECT_EQ(few.exit_code, 2) << few.output;
  EXPECT_NE(few.output.find("the 3 inputs"), std::string::npos) << few.output;
  const fs::path file = dir_ / "w.smtx";
  std::ofstream(file) << "2, 3, 2\n0 1 2\n0 2\n";
  const Outcome matrix = run("spmm --tokens 1 --repeat 1 --blocks 2 --matrix " + file.string());
  EXPECT_EQ(matrix.exit_code, 2) << matrix.output;
  EXPECT_NE(matrix.output.find("the 1 tokens"), std::string::npos) << matrix.output;
  EXPECT_EQ(run(common + "--lanes 1 --blocks 1 --shares 1 --check").exit_code, 0);
}

// Options that describe a random W mean nothing with a matrix file; silently ignoring one
// would time another layer than the user asked for.
TEST_F(CliSpmm, OptionsForARandomWAreRefusedWithAMatrixFile) {
  const fs::path file = dir_ / "w.smtx";
  std::ofstream(file) << "2, 3, 2\n0 1 2\n0 2\n";
  for (const char* option : {"--distribution powerlaw", "--sparsity 0.5", "--shape 4x4"}) {
    const Outcome o = run("spmm --matrix " + file.string() + " --tokens 2 --repeat 1 " + option);
    EXPECT_EQ(o.exit_code, 2) << option << "\n" << o.output;
    EXPECT_NE(o.output.find("excludes"), std::string::npos) << o.output;
  }
  EXPECT_EQ(run("spmm --matrix " + file.string() + " --tokens 2 --repeat 1").exit_code, 0);
}

TEST_F(CliSpmm, AnEmptyMatrixFileIsRefused) {
  const fs::path file = dir_ / "empty.smtx";
  std::ofstream(file) << "0, 0, 0\n0\n\n";
  const Outcome o = run("spmm --matrix " + file.string() + " --tokens 2 --repeat 1");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("0x0 matrix: nothing to time"), std::string::npos) << o.output;
}

}  // namespace

namespace {

/// The string after `"key": "` in a JSON text; empty when the key is missing.
std::string json_string(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\": \"");
  if (at == std::string::npos) return {};
  const auto begin = at + key.size() + 5;
  return json.substr(begin, json.find('"', begin) - begin);
}

// Every acceleration is reported against the dense product of the same precision and
// against the fastest dense of any; the fastest is no slower than the same-precision one,
// and each ratio is the one its times give.
TEST_F(CliSpmm, ReportsDenseOfTheSamePrecisionAndTheBest) {
  for (const char* precision : {"fp32", "bf16"}) {
    const Outcome o =
        run(std::string("spmm --shape 96x80 --sparsity 0.9 --tokens 24 --repeat 1 --backward "
                        "--json --precision ") +
                precision,
            false);
    ASSERT_EQ(o.exit_code, 0) << o.output;
    const double sparse = json_number(o.output, "sparse_ms");
    const double dense = json_number(o.output, "dense_ms");
    const double best = json_number(o.output, "dense_best_ms");
    EXPECT_GT(best, 0) << o.output;
    EXPECT_LE(best, dense) << o.output;
    EXPECT_NEAR(json_number(o.output, "acceleration"), dense / sparse, 1e-6 * dense / sparse);
    EXPECT_NEAR(json_number(o.output, "acceleration_vs_best"), best / sparse, 1e-6 * best / sparse);
    const std::string kind = json_string(o.output, "dense_best_kind");
    EXPECT_TRUE(kind == "onednn_sgemm_f32" || kind == "onednn_matmul_f32" ||
                kind == "onednn_matmul_bf16")
        << o.output;
    const std::string same = json_string(o.output, "dense_kind");
    EXPECT_EQ(same, std::string(precision) == "fp32" || same == "onednn_matmul_f32"
                        ? "onednn_matmul_f32"
                        : "onednn_matmul_bf16")
        << o.output;
    const double backward = json_number(o.output, "backward_ms");
    EXPECT_EQ(json_number(o.output, "backward_dense_ms"),
              json_number(o.output, "dense_backward_ms"));
    EXPECT_LE(json_number(o.output, "backward_dense_best_ms"),
              json_number(o.output, "backward_dense_ms"));
    EXPECT_NEAR(json_number(o.output, "backward_acceleration_vs_best"),
                json_number(o.output, "backward_dense_best_ms") / backward, 1e-3);
    EXPECT_FALSE(json_string(o.output, "backward_dense_best_kind").empty()) << o.output;
  }
}

}  // namespace
