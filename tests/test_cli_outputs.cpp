// The output files of `sluice sweep` and `sluice predict`: a path cannot smuggle commands
// into the gnuplot script, a run that fails leaves none of its files, and the plot script
// has one temporary name. Standard output that cannot be written fails every command.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using Outcome = sluice::testing::CliOutcome;
using sluice::testing::read_file;

Outcome run(const std::string& args) {
  return sluice::testing::run_cli(SLUICE_CLI_PATH, args);
}

class CliOutputs : public sluice::testing::TempDirTest {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
    TempDirTest::SetUp();
  }
  /// A `gnuplot` on a PATH of its own that records the script it is given, and runs it
  /// through the real gnuplot when there is one.
  std::string fake_gnuplot_path() {
    const fs::path bin = dir_ / "bin";
    fs::create_directories(bin);
    const fs::path fake = bin / "gnuplot";
    std::ofstream(fake) << "#!/bin/sh\necho \"$1\" >> " << (dir_ / "scripts").string()
                        << "\ncp \"$1\" " << (dir_ / "last.gp").string() << "\nexit 0\n";
    fs::permissions(fake, fs::perms::owner_all);
    return "env PATH=" + bin.string() + ":/usr/bin:/bin ";
  }
};

constexpr const char* kTiny = "sweep --shape 64x48 --tokens 16 --threads 1 --repeat 1 --seed 3 ";

TEST_F(CliOutputs, APathWithANewlineIsRefusedBeforeAnyScriptIsWritten) {
  const std::string evil = "'out\nsystem(\"touch " + (dir_ / "pwned").string() + "\")\n#'";
  const std::string cli = fake_gnuplot_path() + SLUICE_CLI_PATH;
  Outcome o = sluice::testing::run_cli(cli, std::string(kTiny) + "--sparsities 0.5 --out " + evil);
  EXPECT_EQ(o.exit_code, 2) << o.output;
  EXPECT_NE(o.output.find("control character"), std::string::npos) << o.output;
  o = sluice::testing::run_cli(cli, "predict --out " + evil);
  EXPECT_EQ(o.exit_code, 2) << o.output;
  EXPECT_FALSE(fs::exists(dir_ / "pwned"));
  EXPECT_FALSE(fs::exists(dir_ / "scripts")) << "gnuplot ran";
}

TEST_F(CliOutputs, ThePlotScriptHasOneTemporarySuffixAndQuotesThePath) {
  const fs::path out = dir_ / "it's here";
  const Outcome o = sluice::testing::run_cli(
      fake_gnuplot_path() + SLUICE_CLI_PATH,
      std::string(kTiny) + "--sparsities 0.5 --out \"" + out.string() + "\"");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const std::string scripts = read_file(dir_ / "scripts");
  ASSERT_FALSE(scripts.empty()) << o.output;
  EXPECT_EQ(scripts.find(".tmp."), scripts.rfind(".tmp.")) << scripts;
  EXPECT_NE(read_file(dir_ / "last.gp").find("it''s here"), std::string::npos);
}

// A sweep of one sparsity has one x and one time: gnuplot must not warn of an empty range,
// and the fit's R^2 is said to be undefined rather than printed as nan.
TEST_F(CliOutputs, ASweepOfOneSparsityPlotsWithoutWarnings) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  for (const char* sparsity : {"0.5", "0"}) {
    const fs::path out = dir_ / (std::string("out") + sparsity);
    const Outcome o =
        run(std::string(kTiny) + "--sparsities " + sparsity + " --out " + out.string());
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.output.find("Warning:"), std::string::npos) << o.output;
    EXPECT_EQ(o.output.find("nan"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("R^2 undefined"), std::string::npos) << o.output;
    EXPECT_TRUE(fs::exists(out / "sweep.png"));
  }
}

TEST_F(CliOutputs, AFailedSweepLeavesNoneOfItsFilesAndTheEarlierOnes) {
  const fs::path out = dir_ / "out";
  fs::create_directories(out / "sweep.json" / "keep");  // sweep.json cannot be replaced
  std::ofstream(out / "sweep.csv") << "an earlier sweep";
  const Outcome o = run(std::string(kTiny) + "--sparsities 0.5 --out " + out.string());
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_EQ(read_file(out / "sweep.csv"), "an earlier sweep");
  EXPECT_TRUE(fs::is_directory(out / "sweep.json" / "keep"));
  for (const auto& entry : fs::directory_iterator(out)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  }
}

TEST_F(CliOutputs, AFailedPredictLeavesNoneOfItsFiles) {
  const fs::path out = dir_ / "out";
  fs::create_directories(out / "saturation.csv" / "keep");
  const Outcome o = run("predict --out " + out.string());
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_FALSE(fs::exists(out / "acceleration.csv"));
}

// An output file is written beside its path and renamed over it: a pipe (or a device, as
// root) of that name would be replaced, so it is refused, and left as it was.
TEST_F(CliOutputs, AnOutputThatIsNotAFileIsRefusedNotReplaced) {
  const fs::path out = dir_ / "out";
  fs::create_directories(out);
  ASSERT_EQ(::mkfifo((out / "saturation.csv").c_str(), 0600), 0);
  const Outcome o = run("predict --out " + out.string());
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("saturation.csv: it is not a file (a device or pipe)"), std::string::npos)
      << o.output;
  EXPECT_TRUE(fs::is_fifo(out / "saturation.csv"));
  EXPECT_FALSE(fs::exists(out / "acceleration.csv"));
  // A plot is no different (whether gnuplot draws it or, missing, the old one is removed).
  const fs::path plots = dir_ / "plots";
  fs::create_directories(plots);
  ASSERT_EQ(::mkfifo((plots / "acceleration.png").c_str(), 0600), 0);
  EXPECT_EQ(run("predict --out " + plots.string()).exit_code, 0);
  EXPECT_TRUE(fs::is_fifo(plots / "acceleration.png"));
  EXPECT_TRUE(fs::is_regular_file(plots / "acceleration.csv"));
}

// A result that does not reach standard output (a full disk) is exit 1, said on stderr:
// a script must not take a lost result for a good one.
TEST_F(CliOutputs, OutputThatCannotBeWrittenIsAFailure) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const std::string to_full =
      std::string("sh -c 'exec \"$0\" \"$@\" >/dev/full' ") + SLUICE_CLI_PATH;
  for (const char* args : {"predict --json", "spmm --shape 16x16 --tokens 4 --repeat 1",
                           "train --dataset synthetic --layers 64,8,10 --epochs 1 --json"}) {
    const Outcome o = sluice::testing::run_cli(to_full, args);
    EXPECT_EQ(o.exit_code, 1) << args << "\n" << o.output;
    EXPECT_NE(o.output.find("sluice: could not write the output: No space left on device"),
              std::string::npos)
        << args << "\n"
        << o.output;
    EXPECT_EQ(run(args).exit_code, 0) << args;  // the same written where it can be
  }
}

}  // namespace
