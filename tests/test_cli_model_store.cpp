// `sluice train --model-store DIR` end to end on the real binary: a store created, then
// resumed, trains bit for bit as one run and as the model in RAM; a budget too small is a
// usage error that leaves no store behind, as any refused first run; a model larger than the
// process may have trains in one; a corrupt store file is refused naming the file and the byte, and
// nothing in the store changes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using Outcome = sluice::testing::CliOutcome;
using nlohmann::json;

Outcome run(const std::string& args, bool merge_stderr = true) {
  return sluice::testing::run_cli(SLUICE_CLI_PATH, args, merge_stderr);
}

json run_json(const std::string& args) {
  const Outcome o = run(args + " --json", /*merge_stderr=*/false);
  EXPECT_EQ(o.exit_code, 0) << args << "\n" << o.output;
  if (o.exit_code != 0) return json::object();
  return json::parse(o.output);
}

void expect_exit(const Outcome& o, int code, const std::string& words) {
  EXPECT_EQ(o.exit_code, code) << o.output;
  EXPECT_NE(o.output.find(words), std::string::npos) << "expected '" << words << "' in:\n"
                                                     << o.output;
}

/// Every file of a directory, by name.
std::map<std::string, std::string> files(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    out[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

using CliModelStore = sluice::testing::CliDirTest;

const std::string kTrain = "train --dataset synthetic --layers 64,24,10 --optimizer adam ";

TEST_F(CliModelStore, ACreatedThenResumedStoreTrainsAsOneRunAndAsTheModelInRam) {
  const json ram = run_json(kTrain + "--epochs 2");
  const json whole = run_json(kTrain + "--epochs 2 --model-store " + path("whole"));
  const json first = run_json(kTrain + "--epochs 1 --model-store " + path("split"));
  const Outcome resumed = run(kTrain + "--epochs 1 --json --model-store " + path("split"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming model store " + path("split") + " after 1 epochs"),
            std::string::npos)
      << resumed.output;
  const json second = json::parse(resumed.output.substr(resumed.output.find('{')));
  for (const char* key : {"test_loss", "test_accuracy", "final_loss", "seed", "epochs_total"}) {
    EXPECT_EQ(whole[key], ram[key]) << key;
    EXPECT_EQ(second[key], whole[key]) << key;
  }
  EXPECT_EQ(first["epochs_total"], 1);
  EXPECT_EQ(second["optimizer"], "adam");
  EXPECT_EQ(files(path("whole")), files(path("split")));  // the same bytes, file by file

  // The disk fields are measured, not made up; the model in RAM has none.
  for (const char* key : {"model_store_bytes", "disk_read_bytes_per_s", "disk_write_bytes_per_s",
                          "disk_wait_seconds"}) {
    EXPECT_FALSE(ram.contains(key)) << key;
    ASSERT_TRUE(second.contains(key)) << key;
  }
  std::uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(path("split"))) bytes += fs::file_size(e.path());
  EXPECT_EQ(second["model_store_bytes"].get<std::uint64_t>(), bytes);
  EXPECT_GT(second["disk_read_bytes_per_s"].get<double>(), 0);  // the open reads every file
  EXPECT_GT(second["disk_write_bytes_per_s"].get<double>(), 0);
  EXPECT_GE(second["disk_wait_seconds"].get<double>(), 0);
  EXPECT_GT(second["peak_rss_bytes"].get<double>(), 0);
}

// Under a budget whose cache (what the trainer's streams leave of 280 kB) is below the
// model (a 116 kB store) the transposed patterns would be read from disk every step: the
// backward streams by output, and trains as the model in RAM does in that order. In RAM
// the default is by input.
TEST_F(CliModelStore, ABudgetBelowTheModelStreamsTheBackwardByOutput) {
  const std::string train =
      "train --dataset synthetic --layers 64,128,128,128,10 --threads 1 --epochs 1 ";
  const json store = run_json(train + "--model-memory-budget 280000 --model-store " + path("s"));
  const json ram = run_json(train + "--backward-order by_output");
  EXPECT_EQ(store["backward_order"], "by_output");
  EXPECT_EQ(ram["backward_order"], "by_output");
  for (const char* key : {"test_loss", "final_loss"}) EXPECT_EQ(store[key], ram[key]) << key;
  EXPECT_EQ(run_json(train)["backward_order"], "by_input");
  expect_exit(run(train + "--backward-order sideways"), 2, "--backward-order");
}

TEST_F(CliModelStore, AResumedStoreKeepsItsMaskUpdateSchedule) {
  const std::string rigl = kTrain + "--dynamic rigl --update-every 2 --drop 0.5 ";
  const json whole = run_json(rigl + "--epochs 2 --model-store " + path("whole"));
  run_json(rigl + "--epochs 1 --horizon-epochs 2 --model-store " + path("split"));
  const Outcome resumed = run(kTrain + "--epochs 1 --json --model-store " + path("split"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("dynamic sparsity rigl: every 2 steps"), std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("(the store's)"), std::string::npos) << resumed.output;
  const json second = json::parse(resumed.output.substr(resumed.output.find('{')));
  EXPECT_GT(second["mask_updates"].get<int>(), 0);
  for (const char* key : {"test_loss", "test_accuracy", "final_loss", "dynamic"}) {
    EXPECT_EQ(second[key], whole[key]) << key;
  }
  EXPECT_EQ(files(path("whole")), files(path("split")));  // masks and manifest alike
}

// A store exists to train a model larger than the memory the process can have: the
// memory check counts its RAM budget, not the model in RAM (which refused it, here under
// RLIMIT_AS at 1.2 GB, with a model of 1.27 GB in RAM). The same model without a store is
// still refused. A resumed store is checked too, with what it holds.
TEST_F(CliModelStore, AModelLargerThanTheProcessMayHaveTrainsInAStore) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer cannot start under RLIMIT_AS";
  const std::string limited = std::string("prlimit --as=1200000000 ") + SLUICE_CLI_PATH;
  const std::string model =
      "train --dataset synthetic --layers 64,2560,2560,2560,2560,10 --sparsity 0 --steps 1 ";
  const std::string store = "--model-memory-budget 536870912 --model-store " + path("big");
  const Outcome in_store = sluice::testing::run_cli(limited, model + store);
  EXPECT_EQ(in_store.exit_code, 0) << in_store.output;
  const Outcome resumed =
      sluice::testing::run_cli(limited, "train --dataset synthetic --steps 1 " + store);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  expect_exit(sluice::testing::run_cli(limited, model), 2, "more than the 1.2 GB of RLIMIT_AS");
  // A small model's store holds no more than the model, whatever its budget (2 GiB here).
  const Outcome small =
      sluice::testing::run_cli(limited, kTrain + "--epochs 1 --model-store " + path("small"));
  EXPECT_EQ(small.exit_code, 0) << small.output;
}

TEST_F(CliModelStore, ABudgetTooSmallIsAUsageErrorThatLeavesNoModel) {
  const std::string store = path("small");
  expect_exit(run(kTrain + "--epochs 1 --model-store " + store + " --model-memory-budget 4096"), 2,
              "--model-memory-budget 4096 is too small: layer 0 (24x64");
  EXPECT_FALSE(fs::exists(store));
  // A run with room creates its model.
  EXPECT_EQ(run_json(kTrain + "--epochs 1 --model-store " + store)["epochs_total"], 1);
  // Reopened with too little room, the trained store is refused and left as it was.
  const auto before = files(store);
  expect_exit(run(kTrain + "--epochs 1 --model-store " + store + " --model-memory-budget 4096"), 2,
              "is too small");
  EXPECT_EQ(files(store), before);
}

// A first run refused once its store is open (here: layers that do not fit the data) takes
// away what it made, directories and all, and nothing else: a directory that was there
// stays with the user's files in it. The next run then builds the model, not resumes an
// empty one.
TEST_F(CliModelStore, ARefusedFirstRunLeavesNoStore) {
  const std::string misfit = "train --dataset synthetic --layers 10,24,3 --epochs 1 ";
  expect_exit(run(misfit + "--model-store " + path("made/deeper/store")), 2,
              "does not fit the data");
  EXPECT_FALSE(fs::exists(path("made")));
  fs::create_directory(path("mine"));
  std::ofstream(path("mine/notes.txt")) << "the user's";
  expect_exit(run(misfit + "--model-store " + path("mine")), 2, "does not fit the data");
  EXPECT_EQ(files(path("mine")), (std::map<std::string, std::string>{{"notes.txt", "the user's"}}));
  EXPECT_EQ(run_json(kTrain + "--epochs 1 --model-store " + path("mine"))["epochs_total"], 1);
  // Once it holds a model, a refused run leaves the store as it was.
  const auto before = files(path("mine"));
  expect_exit(run(misfit + "--model-store " + path("mine")), 2, "differs from the layers");
  EXPECT_EQ(files(path("mine")), before);
}

// A budget that holds the largest layer's working set but not the streams and gradients
// training holds beside the store would leave the process over it: refused before the
// store is built, naming the least budget, which then trains.
TEST_F(CliModelStore, ABudgetWithoutRoomForTheStepsStreamsIsAUsageError) {
  const std::string store = path("tight");
  const std::string train =
      "train --dataset synthetic --layers 64,128,128,128,10 --threads 1 --epochs 1 --engines 2 ";
  const Outcome refused = run(train + "--model-memory-budget 100000 --model-store " + store);
  expect_exit(refused, 2, "layer 1's working set (");
  EXPECT_FALSE(fs::exists(store));
  const std::string least = "need at least ";
  const std::size_t at = refused.output.find(least);
  ASSERT_NE(at, std::string::npos) << refused.output;
  const std::int64_t budget = std::stoll(refused.output.substr(at + least.size()));
  EXPECT_GT(budget, 100000);
  expect_exit(run(train + "--model-memory-budget " + std::to_string(budget - 1) +
                  " --model-store " + store),
              2, least + std::to_string(budget));
  const json trained = run_json(train + "--model-memory-budget " + std::to_string(budget) +
                                " --model-store " + store);
  EXPECT_EQ(trained["epochs_total"], 1);
  // Resumed under a budget that holds a layer but not the streams: refused by the executor,
  // before a step, and the store is left as it was.
  const auto before = files(store);
  expect_exit(run(train + "--model-memory-budget 100000 --model-store " + store), 2,
              "needs a budget of at least");
  EXPECT_EQ(files(store), before);
}

TEST_F(CliModelStore, ACorruptStoreFileIsRefusedNamingFileAndByteAndNothingChanges) {
  const std::string store = path("store");
  run_json(kTrain + "--epochs 1 --model-store " + store);
  auto good = files(store);
  for (const auto& [name, bytes] : good) {
    if (name.find(".state") == std::string::npos) continue;
    std::string bad = bytes;
    bad[bad.size() / 2] = static_cast<char>(bad[bad.size() / 2] ^ 0x10);
    std::ofstream(fs::path(store) / name, std::ios::binary | std::ios::trunc) << bad;
    auto corrupt = files(store);
    const Outcome o = run(kTrain + "--epochs 1 --model-store " + store);
    expect_exit(o, 1, name);
    EXPECT_NE(o.output.find("byte"), std::string::npos) << o.output;
    EXPECT_EQ(files(store), corrupt) << "a refused store changed";
    std::ofstream(fs::path(store) / name, std::ios::binary | std::ios::trunc) << bytes;
  }
  EXPECT_EQ(run_json(kTrain + "--epochs 1 --model-store " + store)["epochs_total"], 2);
}

TEST_F(CliModelStore, OptionsTheStoreMakesMeaninglessAreRefused) {
  const std::string store = " --model-store " + path("s");
  expect_exit(run(kTrain + "--epochs 1 --resume x.ckpt" + store), 2, "--model-store cannot");
  expect_exit(run(kTrain + "--epochs 1 --checkpoint x.ckpt" + store), 2, "--model-store cannot");
  expect_exit(run(kTrain + "--epochs 1 --model-memory-budget 100000000"), 2,
              "--model-memory-budget needs --model-store");
  expect_exit(run(kTrain + "--epochs 1 --model-memory-budget 0" + store), 2,
              "--model-memory-budget");
  run_json(kTrain + "--epochs 1" + store);
  expect_exit(run(kTrain + "--epochs 1 --sparsity 0.5" + store), 2, "its masks fix it");
  expect_exit(run("train --dataset synthetic --layers 64,32,10 --epochs 1" + store), 2,
              "differs from the layers 64,24,10 of model store");
}

}  // namespace
