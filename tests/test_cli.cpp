// The `sluice` command line refuses every malformed input with a message and exit code
// 1 (bad data) or 2 (bad arguments): never a signal, a hang or a partial output file.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using Outcome = sluice::testing::CliOutcome;

Outcome run(const std::string& args) {
  return sluice::testing::run_cli(SLUICE_CLI_PATH, args);
}

class Cli : public sluice::testing::TempDirTest {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
    TempDirTest::SetUp();
  }
  std::string file(const std::string& name, const std::string& content) {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }
};

void expect_exit(const Outcome& o, int code, const std::string& words) {
  EXPECT_EQ(o.exit_code, code) << o.output;
  EXPECT_NE(o.output.find(words), std::string::npos) << "expected '" << words << "' in:\n"
                                                     << o.output;
}

TEST_F(Cli, BadArgumentsExitWithTwo) {
  expect_exit(run("spmm --no-such-flag"), 2, "no-such-flag");
  expect_exit(run("spmm --shape 0x5 --sparsity 0.5 --tokens 4"), 2, "--shape");
  expect_exit(run("spmm --shape 5x-3 --sparsity 0.5 --tokens 4"), 2, "--shape");
  expect_exit(run("spmm --shape axb --sparsity 0.5 --tokens 4"), 2, "--shape");
  expect_exit(run("spmm --shape 8x8 --sparsity 1 --tokens 4"), 2, "[0, 1)");
  expect_exit(run("spmm --shape 8x8 --sparsity -0.1 --tokens 4"), 2, "sparsity");
  expect_exit(run("spmm --shape 8x8 --sparsity nan --tokens 4"), 2, "sparsity");
  expect_exit(run("spmm --shape 8x8 --sparsity 0.5 --tokens 0"), 2, "tokens");
  expect_exit(run("spmm --shape 8x8 --sparsity 0.5 --tokens -4"), 2, "tokens");
  expect_exit(run("spmm --shape 8x8 --sparsity 0.5 --threads 0"), 2, "threads");
  expect_exit(run("no-such-command"), 2, "unknown command 'no-such-command'");
  expect_exit(run(""), 2, "Subcommands:");  // `sluice` alone lists the commands
}

// A mistake is said in a line or two that stay in sight, not above a command's help that
// fills more than a terminal.
TEST_F(Cli, AMistakeIsSaidBriefly) {
  for (const char* args : {"train --epoch 3", "train --dynamic --checkpoint x", "sweep --bogus"}) {
    const Outcome o = run(args);
    EXPECT_EQ(o.exit_code, 2) << o.output;
    const std::string command = std::string(args).substr(0, std::string(args).find(' '));
    EXPECT_NE(o.output.find("sluice " + command + " --help lists the options"), std::string::npos)
        << o.output;
    EXPECT_LT(o.output.size(), 200U) << o.output;
  }
  expect_exit(run("train --epochs 1 --epochs 2"), 2, "--epochs is given 2 times: give it once");
  expect_exit(run("train --epochs"), 2, "--epochs needs a value: INT:NUMBER in [1, 100000]");
}

// Integer flags take decimal digits only, within 64 bits: no trailing garbage, no other
// base or exponent, no wrap past 2^64 (CLI11 read "0x10" as 16 and 2^64 as something).
TEST_F(Cli, IntegerFlagsAreStrictDecimal) {
  const std::string train = "train --dataset synthetic --layers 64,8,10 --epochs 1 ";
  for (const char* value : {"12abc", "0x10", "1e3", "+5", "-1", "2.5", "''"}) {
    expect_exit(run(train + "--seed " + value), 2, "--seed: ");
  }
  expect_exit(run(train + "--seed 18446744073709551616"), 2, "does not fit in 64 bits");
  expect_exit(run(train + "--prefetch-bytes 99999999999999999999"), 2, "--prefetch-bytes");
  expect_exit(run(train + "--memory-budget 1e9"), 2, "not a whole number");
  expect_exit(run("spmm --shape 8x8 --sparsity 0.5 --tokens 4x"), 2, "--tokens");
  EXPECT_EQ(run(train + "--steps 1 --seed 18446744073709551615").exit_code, 0);
}

// A byte budget above what this process can have promises memory that is not there.
TEST_F(Cli, AMemoryBudgetAboveAvailableMemoryIsRefused) {
  const std::string train = "train --dataset synthetic --layers 64,8,10 --epochs 1 ";
  expect_exit(run(train + "--memory-budget 100000000000000000"), 2, "physical memory");
  expect_exit(run(train + "--model-store " + (dir_ / "store").string() +
                  " --model-memory-budget 100000000000000000"),
              2, "--model-memory-budget");
}

// Messages stay a line: a megabyte argument or cell is cut to ~40 characters with "…",
// a NUL in a cell is shown, not left to cut the message, and a range prints whole numbers
// in full and others as %g (CLI11 printed DBL_MAX's 309 digits).
TEST_F(Cli, MessagesShowValuesBriefly) {
  const std::string huge(100000, '9');
  Outcome o = run("train --dataset synthetic --epochs 1 --threads " + huge);
  EXPECT_EQ(o.exit_code, 2) << o.output.substr(0, 300);
  EXPECT_NE(o.output.find("9999…"), std::string::npos) << o.output.substr(0, 300);
  EXPECT_EQ(o.output.find(std::string(100, '9')), std::string::npos);
  o = run("train --dataset synthetic --epochs 1 --lr -1");
  expect_exit(o, 2, "--lr: '-1' is not a number > 0");
  EXPECT_EQ(o.output.find("179769"), std::string::npos) << o.output;
  expect_exit(run("train --dataset synthetic --epochs 1 --batch 0"), 2,
              "--batch: '0' is not a number in [1, 16777216]");
  o = run("x" + std::string(5000, 'y'));
  expect_exit(o, 2, "unknown command 'xyyy");
  EXPECT_LT(o.output.size(), 300U) << o.output;
  o = run("train --dataset " + file("huge.csv", "1,2\n3," + huge + "x,1\n"));
  expect_exit(o, 1, "huge.csv:2: column 2 is not a finite number: '9999");
  EXPECT_LT(o.output.size(), 300U) << o.output;
  const std::string nul = "1,2\n3," + std::string("4\0x", 3) + ",1\n";
  expect_exit(run("train --dataset " + file("nul.csv", nul)), 1, "'4\\x00x'");
}

TEST_F(Cli, BadMatrixFilesExitWithOne) {
  const std::string mm = "%%MatrixMarket matrix coordinate real general\n";
  expect_exit(run("spmm --tokens 4 --matrix " + file("empty.smtx", "")), 1, "empty.smtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("trunc.smtx", "3, 4, 3\n0 1 2 3\n0 1")), 1,
              "trunc.smtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("mono.smtx", "3, 4, 3\n0 2 1 3\n0 1 2\n")), 1,
              "mono.smtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("range.smtx", "2, 4, 2\n0 1 2\n0 4\n")), 1,
              "range.smtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("dup.smtx", "1, 4, 2\n0 2\n1 1\n")), 1,
              "dup.smtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("nan.mtx", mm + "2 2 1\n1 1 nan\n")), 1,
              "nan.mtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("inf.mtx", mm + "2 2 1\n1 1 inf\n")), 1,
              "inf.mtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("word.mtx", mm + "2 2 1\n1 x 1.0\n")), 1,
              "word.mtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("zero.mtx", mm + "0 2 0\n")), 1, "zero.mtx");
  expect_exit(run("spmm --tokens 4 --matrix " + (dir_ / "missing.smtx").string()), 1,
              "missing.smtx");
  expect_exit(run("spmm --tokens 4 --matrix " + file("m.txt", "3, 4, 3\n")), 1, "m.txt");
  // A data set's name misspelt is no file: the message says what --dataset takes.
  expect_exit(run("train --epochs 1 --dataset digitz"), 1,
              "cannot open digitz: no such file (--dataset takes digits, synthetic or a CSV file)");
}

TEST_F(Cli, RandomBytesAreRefusedNotCrashedOn) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 6; ++trial) {
    std::string bytes(64 + rng() % 512, '\0');
    for (auto& b : bytes) b = static_cast<char>(rng());
    const std::string ext = trial % 2 == 0 ? ".smtx" : ".mtx";
    const Outcome o =
        run("spmm --tokens 4 --matrix " + file("r" + std::to_string(trial) + ext, bytes));
    EXPECT_EQ(o.exit_code, 1) << o.output;
  }
}

TEST_F(Cli, AGoodRunChecksAndPrintsJson) {
  const Outcome o =
      run("spmm --shape 64x48 --sparsity 0.9 --tokens 17 --repeat 1 --check --backward --json");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  for (const char* key :
       {"\"out\": 64", "\"in\": 48", "\"tokens\": 17", "\"nnz\"", "\"sparsity\"", "\"threads\"",
        "\"isa\"", "\"geometry\"", "\"sparse_ms\"", "\"dense_ms\"", "\"useful_gflops\"",
        "\"acceleration\"", "\"balance\"", "\"max_rel_error\"", "\"backward_ms\"",
        "\"bwd_data_ms\"", "\"bwd_weight_ms\"", "\"max_rel_error_bwd\"", "\"peak_rss_bytes\""}) {
    EXPECT_NE(o.output.find(key), std::string::npos) << key << " missing in\n" << o.output;
  }
}

TEST_F(Cli, Bf16ReportsTheGeometryTheLayerRunsWith) {
  // Dense enough, lanes hold X in bf16 on twice as wide tiles; too sparse to pack, the
  // layer runs on fp32 tiles and the report says so.
  auto geometry = [&](const char* sparsity) {
    const Outcome o = run(std::string("spmm --shape 64x48 --tokens 200 --threads 1 --repeat 1 "
                                      "--precision bf16 --json --sparsity ") +
                          sparsity);
    EXPECT_EQ(o.exit_code, 0) << o.output;
    const auto at = o.output.find("\"geometry\": \"");
    return at == std::string::npos
               ? std::string()
               : o.output.substr(at + 13, o.output.find('"', at + 13) - at - 13);
  };
  EXPECT_EQ(geometry("0.5"), "1x1/128");
  EXPECT_EQ(geometry("0.99"), "1x1/64");
}

TEST_F(Cli, Bf16RunsCheckAtFp32ToleranceAndTrain) {
  const Outcome o =
      run("spmm --shape 64x48 --sparsity 0.9 --tokens 37 --repeat 1 --check --backward --json "
          "--precision bf16");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("\"precision\": \"bf16\""), std::string::npos) << o.output;
  for (const char* key : {"\"max_rel_error\": ", "\"max_rel_error_bwd\": "}) {
    const auto at = o.output.find(key);
    ASSERT_NE(at, std::string::npos) << key;
    EXPECT_LT(std::stod(o.output.substr(at + std::strlen(key))), 1e-5) << key << o.output;
  }
  expect_exit(run("spmm --shape 8x8 --sparsity 0.5 --precision fp16"), 2, "precision");

  const Outcome t =
      run("train --dataset synthetic --layers 64,32,10 --epochs 1 --precision bf16,fp32 --json");
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("\"precision\": \"bf16,fp32\""), std::string::npos) << t.output;
  expect_exit(run("train --dataset synthetic --layers 64,32,10 --epochs 1 --precision bf16,bf16,"
                  "bf16"),
              2, "layers");
  expect_exit(run("train --dataset synthetic --layers 64,32,10 --epochs 1 --precision half"), 2,
              "half");
}

// `sluice train` on tiny data: a CSV of `rows` samples of 3 features, labels 0 and 1.
std::string train_csv(int rows) {
  std::string text;
  for (int r = 0; r < rows; ++r) {
    text += std::to_string(r % 7) + "," + std::to_string(r % 3) + "," + std::to_string(r % 5) +
            "," + std::to_string(r % 2) + "\n";
  }
  return text;
}

bool trained(const Outcome& o) {
  return o.output.find("epoch   1") != std::string::npos;
}

TEST_F(Cli, TrainRefusesAnUnwritableCheckpointBeforeTraining) {
  const std::string train = "train --dataset synthetic --layers 64,32,10 --epochs 1 ";
  Outcome o = run(train + "--checkpoint " + dir_.string());
  expect_exit(o, 2, dir_.string() + " is a directory");
  EXPECT_FALSE(trained(o)) << o.output;
  const std::string missing = (dir_ / "missing" / "m.ckpt").string();
  o = run(train + "--checkpoint " + missing);
  expect_exit(o, 2, missing);
  EXPECT_FALSE(trained(o)) << o.output;
}

TEST_F(Cli, TrainEvaluatesARemainderWithinTheMemoryBudget) {
  // 165 samples: 132 to train in batches of 32 tokens, 33 to test. The budget holds 32
  // training tokens (16 an engine); evaluation in batches of 32 leaves 1 token, fewer than
  // the 2 engines: the last batches share the 33 (17 + 16) rather than one of 33, which
  // the budget would refuse after the training is done.
  const std::string train = "train --dataset " + file("d.csv", train_csv(165)) +
                            " --layers 3,4,2 --epochs 1 --engines 2 --batch 32 ";
  const Outcome probe = run(train + "--memory-budget 1");
  const auto at = probe.output.find(" need ");
  ASSERT_NE(at, std::string::npos) << probe.output;
  const std::string budget = std::to_string(std::stoll(probe.output.substr(at + 6)));
  const fs::path ckpt = dir_ / "m.ckpt";
  const Outcome o = run(train + "--memory-budget " + budget + " --checkpoint " + ckpt.string());
  expect_exit(o, 0, "on 33 samples");
  EXPECT_TRUE(trained(o)) << o.output;
  EXPECT_TRUE(fs::exists(ckpt)) << o.output;
}

TEST_F(Cli, TrainEvaluatesWithinTheMemoryBudget) {
  // 800 test samples at once would need more than the budget; batches of 32 do not.
  const Outcome o =
      run("train --dataset synthetic --layers 64,32,10 --epochs 1 --memory-budget 100000");
  expect_exit(o, 0, "on 800 samples");
}

TEST_F(Cli, TrainReportsSkippedStepsAndRefusesADivergedModel) {
  const fs::path ckpt = dir_ / "good.ckpt";
  std::ofstream(ckpt) << "SLUICECK, an older checkpoint";  // (its magic: one to replace)
  const Outcome o =
      run("train --dataset synthetic --layers 64,32,10 --epochs 1 --lr 1e30 "
          "--checkpoint " +
          ckpt.string());
  expect_exit(o, 1, "diverged");
  EXPECT_NE(o.output.find("steps skipped"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("steps were skipped"), std::string::npos) << o.output;
  std::ifstream in(ckpt);
  const std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "SLUICECK, an older checkpoint");

  const Outcome good = run("train --dataset synthetic --layers 64,32,10 --epochs 1 --json");
  expect_exit(good, 0, "\"skipped_steps\": 0");
}

TEST_F(Cli, TrainRefusesSplitsTooSmallForTheEngines) {
  // 2 samples: none to test on whatever the engines, which is the data's fault (exit 1).
  Outcome o =
      run("train --dataset " + file("two.csv", train_csv(2)) + " --layers 3,4,2 --epochs 1");
  expect_exit(o, 1, "2 to train and 0 to test");
  EXPECT_FALSE(trained(o)) << o.output;
  // 30 samples: 6 to test, fewer than 8 engines, which fewer engines would fix (exit 2).
  o = run("train --dataset " + file("thirty.csv", train_csv(30)) +
          " --layers 3,4,2 --epochs 1 --engines 8 --batch 8");
  expect_exit(o, 2, "6 to test; 8 engines");
  EXPECT_FALSE(trained(o)) << o.output;
}

TEST_F(Cli, TrainRefusesOptionsItWouldIgnore) {
  const std::string ckpt = (dir_ / "m.ckpt").string();
  const std::string train = "train --dataset synthetic --epochs 1 --resume " + ckpt;
  ASSERT_EQ(
      run("train --dataset synthetic --layers 64,32,10 --epochs 1 --checkpoint " + ckpt).exit_code,
      0);
  expect_exit(run(train + " --layers 64,32,10"), 0, "test accuracy");
  // The JSON names the sparsity of the checkpoint's masks, not the default of a new model.
  const std::string half = (dir_ / "half.ckpt").string();
  ASSERT_EQ(run("train --dataset synthetic --layers 64,32,10 --epochs 1 --sparsity 0.5 "
                "--checkpoint " +
                half)
                .exit_code,
            0);
  const Outcome resumed = run("train --dataset synthetic --epochs 1 --json --resume " + half);
  const auto at = resumed.output.find("\"sparsity\": ");
  ASSERT_NE(at, std::string::npos) << resumed.output;
  EXPECT_NEAR(std::stod(resumed.output.substr(at + 12)), 0.5, 0.05) << resumed.output;
  Outcome o = run(train + " --layers 64,16,10");
  expect_exit(o, 2, "--layers 64,16,10 differs from the layers 64,32,10");
  expect_exit(run(train + " --sparsity 0.5"), 2, "--sparsity");
  o = run("train --dataset " + file("d.csv", train_csv(30)) + " --epochs 1 --resume " + ckpt);
  expect_exit(o, 1, "layers 64,32,10 that does not fit the data: 3 features, 2 classes");
  o = run("train --dataset synthetic --epochs 1 --fabric mpi --engines 2");
  expect_exit(o, 2, "--engines cannot be given with --fabric mpi");
}

}  // namespace

TEST_F(Cli, TrainWithDynamicMasks) {
  const Outcome o =
      run("train --dataset synthetic --layers 64,32,10 --epochs 2 --dynamic rigl --update-every 10 "
          "--drop 0.2 --update-until 0.5 --json");
  expect_exit(o, 0, "\"mask_updates\": 9");  // steps 10..90 of 200, before step 100
  EXPECT_NE(o.output.find("\"mask_update_seconds\""), std::string::npos) << o.output;
  expect_exit(run("train --dataset synthetic --epochs 1 --dynamic topk"), 2, "--dynamic");
  expect_exit(run("train --dataset synthetic --epochs 1 --drop 0.2"), 2, "--drop needs --dynamic");
  expect_exit(run("train --dataset synthetic --epochs 1 --dynamic set --drop 0"), 2, "--drop");
  expect_exit(run("train --dataset synthetic --epochs 1 --dynamic set --update-every 0"), 2,
              "--update-every");
  expect_exit(run("train --dataset synthetic --epochs 1 --dynamic set --update-until 2"), 2,
              "--update-until");
}

namespace {

// `predict --json`: the headline is the single-engine case of the largest model, and each
// curve says what its engine holds.
TEST_F(Cli, PredictHeadlinesOneEngineOfTheLargestModel) {
  const Outcome o = run("predict --json");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  for (const char* key : {"\"tokens_per_engine\"", "\"activation_bytes\"", "\"token_capacity\"",
                          "\"saturation_acceleration_cluster\"",
                          "\"activation_bytes_per_token_layer_per_d_model\": 2"}) {
    EXPECT_NE(o.output.find(key), std::string::npos) << key;
  }
  const auto number_after = [&](std::size_t from, const std::string& key) {
    const auto at = o.output.find("\"" + key + "\": ", from);
    return at == std::string::npos ? -1.0 : std::stod(o.output.substr(at + key.size() + 4));
  };
  const auto largest = o.output.find("\"d_model\": 12288");
  ASSERT_NE(largest, std::string::npos);
  EXPECT_EQ(number_after(largest, "engines"), 1);
  EXPECT_DOUBLE_EQ(number_after(largest, "saturation"), number_after(0, "saturation_acceleration"));
  // Korthikanti's activations (attention scores alone recomputed) leave fewer tokens.
  const Outcome fat = run("predict --json --activation-bytes 34");
  ASSERT_EQ(fat.exit_code, 0);
  const auto tokens_of = [&](const std::string& out) {
    const auto at = out.find("\"tokens_per_engine\": ", out.find("\"d_model\": 12288"));
    return std::stod(out.substr(at + 21));
  };
  EXPECT_LT(tokens_of(fat.output), tokens_of(o.output));
  EXPECT_EQ(run("predict --activation-bytes 0").exit_code, 2);
  EXPECT_EQ(run("predict --activation-bytes x").exit_code, 2);
  // Without --scaling the scaling sparsity would change nothing.
  const Outcome alone = run("predict --scaling-sparsity 0.5");
  EXPECT_EQ(alone.exit_code, 2);
  EXPECT_NE(alone.output.find("--scaling-sparsity requires --scaling"), std::string::npos)
      << alone.output;
  EXPECT_EQ(run("predict --scaling --scaling-sparsity 0.5").exit_code, 0);
}

}  // namespace

namespace {

// Training on the dense path computes the same step as on the sparse one (the same sums,
// in another order): the losses agree to rounding.
TEST_F(Cli, TrainOnEitherPathGivesTheSameLoss) {
  auto loss = [&](const char* path) {
    const Outcome o =
        run(std::string("train --dataset synthetic --epochs 1 --json --path ") + path);
    EXPECT_EQ(o.exit_code, 0) << o.output;
    const auto at = o.output.find("\"final_loss\": ");
    return at == std::string::npos ? -1.0 : std::stod(o.output.substr(at + 14));
  };
  const double sparse = loss("sparse"), dense = loss("dense");
  EXPECT_GT(sparse, 0);
  EXPECT_NEAR(dense, sparse, 1e-5 * sparse);
  EXPECT_EQ(run("train --dataset synthetic --epochs 1 --path fast").exit_code, 2);
}

}  // namespace
