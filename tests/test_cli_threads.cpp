// How many threads the CLI runs with: the CPUs this process may use, even when the
// standard OpenMP variables pin the main thread (they narrow its affinity mask to one
// place before main), and said when an affinity mask limits them.
#include <gtest/gtest.h>
#include <sched.h>

#include <nlohmann/json.hpp>
#include <string>

#include "test_support.hpp"

namespace {

using Outcome = sluice::testing::CliOutcome;

int cpus_of_this_process() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  return CPU_COUNT(&set);
}

nlohmann::json spmm_json(const std::string& prefix) {
  const Outcome o = sluice::testing::run_cli(
      prefix + SLUICE_CLI_PATH, "spmm --shape 64x64 --sparsity 0.9 --tokens 8 --repeat 1 --json",
      /*merge_stderr=*/false);
  EXPECT_EQ(o.exit_code, 0) << o.output;
  return o.exit_code == 0 ? nlohmann::json::parse(o.output) : nlohmann::json::object();
}

class CliThreads : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
  }
};

TEST_F(CliThreads, OpenMpBindingDoesNotNarrowTheEngine) {
  const nlohmann::json j = spmm_json("env OMP_PROC_BIND=close OMP_PLACES=cores OMP_NUM_THREADS=2 ");
  EXPECT_EQ(j["threads"], cpus_of_this_process()) << j.dump();
  EXPECT_EQ(j["cpus_allowed"], cpus_of_this_process());
  EXPECT_EQ(j["affinity_limited"], false);
}

TEST_F(CliThreads, AnAffinityMaskTheProcessStartedWithIsKeptAndSaid) {
  if (cpus_of_this_process() < 2) GTEST_SKIP() << "needs two CPUs";
  cpu_set_t set;
  CPU_ZERO(&set);
  ::sched_getaffinity(0, sizeof set, &set);
  int first = 0;
  while (!CPU_ISSET(first, &set)) ++first;
  const std::string taskset = "taskset -c " + std::to_string(first) + " ";
  const nlohmann::json j = spmm_json(taskset);
  EXPECT_EQ(j["threads"], 1) << j.dump();
  EXPECT_EQ(j["affinity_limited"], true);
  const Outcome table = sluice::testing::run_cli(
      taskset + SLUICE_CLI_PATH, "spmm --shape 64x64 --sparsity 0.9 --tokens 8 --repeat 1");
  EXPECT_NE(table.output.find("affinity mask: this process may run on 1 of"), std::string::npos)
      << table.output;
}

TEST_F(CliThreads, TooManyThreadsAreCutWithAMessageNotARuntimeWarning) {
  const Outcome o = sluice::testing::run_cli(
      SLUICE_CLI_PATH, "train --dataset synthetic --layers 64,8,10 --epochs 1 --threads 4096");
  EXPECT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.output.find("TBB Warning"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("--threads 4096, but this process can run"), std::string::npos)
      << o.output;
}

}  // namespace
