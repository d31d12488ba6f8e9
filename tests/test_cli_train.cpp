// `sluice train` end to end on the real binary: what a resumed run keeps (optimizer,
// seed, data order), runs that must fail and keep the older checkpoint, checkpoints that
// load but cannot be trained, and the CLI killed in the middle of a checkpoint save.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <thread>

#include "core/crc32.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/model_memory.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using Outcome = sluice::testing::CliOutcome;
using nlohmann::json;

Outcome run(const std::string& args, bool merge_stderr = true) {
  return sluice::testing::run_cli(SLUICE_CLI_PATH, args, merge_stderr);
}

using sluice::testing::read_file;

void expect_exit(const Outcome& o, int code, const std::string& words) {
  EXPECT_EQ(o.exit_code, code) << o.output;
  EXPECT_NE(o.output.find(words), std::string::npos) << "expected '" << words << "' in:\n"
                                                     << o.output;
}

/// The --json object of a run that must succeed.
json run_json(const std::string& args) {
  const Outcome o = run(args + " --json", /*merge_stderr=*/false);
  EXPECT_EQ(o.exit_code, 0) << args << "\n" << o.output;
  if (o.exit_code != 0) return json::object();
  return json::parse(o.output);
}

using CliTrain = sluice::testing::CliDirTest;

const std::string kTrain = "train --dataset synthetic --layers 64,24,10 ";

// An MLP trains at a constant rate unless a decay flag asks for one; the decay is saved with
// the model, kept by a resumed run and replaced by a flag.
TEST_F(CliTrain, AnMlpDecaysItsLearningRateWhenAFlagAsks) {
  const std::string run6 = kTrain + "--batch 64 --steps 6 --lr 0.01 ";
  const json constant = run_json(run6);
  EXPECT_EQ(constant.value("lr_schedule", ""), "constant");
  EXPECT_EQ(constant.value("warmup_steps", -1), 0);
  EXPECT_EQ(constant.value("decay_steps", -1), 0);
  const std::string ckpt = path("decay.ckpt");
  const json cosine = run_json(run6 + "--warmup-steps 2 --checkpoint " + ckpt);
  EXPECT_EQ(cosine.value("lr_schedule", ""), "cosine");
  EXPECT_EQ(cosine.value("warmup_steps", -1), 2);
  EXPECT_EQ(cosine.value("decay_steps", -1), 6);  // where --steps ends
  EXPECT_NE(cosine.value("final_loss", 0.0), constant.value("final_loss", 0.0));
  const json by_epochs = run_json(kTrain + "--batch 64 --epochs 2 --lr-schedule cosine");
  EXPECT_EQ(by_epochs.value("decay_steps", -1), by_epochs.value("steps", 0));

  const Outcome resumed = run("train --dataset synthetic --steps 2 --json --resume " + ckpt);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("learning rate: the checkpoint's, cosine, warmup 2 steps"),
            std::string::npos)
      << resumed.output;
  const json replaced =
      run_json("train --dataset synthetic --steps 2 --lr-schedule constant --resume " + ckpt);
  EXPECT_EQ(replaced.value("lr_schedule", ""), "constant");
  EXPECT_EQ(replaced.value("decay_steps", -1), 0);
  expect_exit(run(kTrain + "--max-seconds 1 --lr-schedule cosine"), 2,
              "needs --epochs, --steps or --decay-steps: where the decay ends");
  expect_exit(run(run6 + "--lr-schedule constant --decay-steps 4"), 2,
              "--decay-steps needs --lr-schedule cosine");
}

TEST_F(CliTrain, ResumeKeepsTheCheckpointsOptimizerUnlessAFlagChangesIt) {
  const std::string ckpt = path("sgd.ckpt");
  json j = run_json(kTrain + "--epochs 1 --optimizer sgd --lr 0.01 --checkpoint " + ckpt);
  EXPECT_EQ(j["optimizer"], "sgd");
  EXPECT_EQ(j["learning_rate"], 0.01);

  j = run_json(kTrain + "--epochs 1 --resume " + ckpt);
  EXPECT_EQ(j["optimizer"], "sgd");
  EXPECT_EQ(j["learning_rate"], 0.01);

  // --lr alone changes the rate, not the optimizer (nor its momentum and state).
  Outcome o = run(kTrain + "--epochs 1 --lr 0.005 --json --resume " + ckpt);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--lr replaces its learning rate 0.01"), std::string::npos) << o.output;
  j = json::parse(o.output.substr(o.output.find('{')));
  EXPECT_EQ(j["optimizer"], "sgd");
  EXPECT_EQ(j["learning_rate"], 0.005);

  o = run(kTrain + "--epochs 1 --optimizer adamw --json --resume " + ckpt);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("--optimizer replaces the checkpoint's sgd"), std::string::npos)
      << o.output;
  j = json::parse(o.output.substr(o.output.find('{')));
  EXPECT_EQ(j["optimizer"], "adamw");
  EXPECT_EQ(j["learning_rate"], 0.01);
}

// Two epochs, a checkpoint, two more from it: the same model, bit for bit, as four in one
// run, with the optimizer of the checkpoint and no --seed on the resumed run.
void expect_resume_equals_uninterrupted(const std::string& train, const fs::path& dir) {
  const std::string whole = (dir / "whole.ckpt").string(), half = (dir / "half.ckpt").string(),
                    resumed = (dir / "resumed.ckpt").string();
  const json four = run_json(train + " --seed 5 --epochs 4 --checkpoint " + whole);
  run_json(train + " --seed 5 --epochs 2 --checkpoint " + half);
  const json two_more =
      run_json(train + " --epochs 2 --resume " + half + " --checkpoint " + resumed);
  EXPECT_EQ(four["final_loss"], two_more["final_loss"]);
  EXPECT_EQ(four["test_loss"], two_more["test_loss"]);
  EXPECT_EQ(two_more["seed"], 5);
  EXPECT_EQ(two_more["epochs_total"], 4);
  EXPECT_TRUE(read_file(whole) == read_file(resumed))
      << "the resumed checkpoint differs from the uninterrupted one";
}

TEST_F(CliTrain, ResumedTwoPlusTwoEpochsEqualFourOnSyntheticData) {
  expect_resume_equals_uninterrupted(kTrain + "--batch 64 --optimizer sgd --lr 0.02", dir_);
}

TEST_F(CliTrain, ResumedTwoPlusTwoEpochsEqualFourOnACsvSplit) {
  // Real data: the split comes from the seed too, so a resumed run must not see test
  // samples in training. 2 engines, Adam.
  std::string text;
  for (int r = 0; r < 300; ++r) {
    text += std::to_string(r % 7) + "," + std::to_string((r * 13) % 11) + "," +
            std::to_string(r % 5) + "," + std::to_string((r / 3) % 3) + "\n";
  }
  std::ofstream(dir_ / "d.csv") << text;
  expect_resume_equals_uninterrupted(
      "train --dataset " + path("d.csv") + " --layers 3,16,3 --engines 2 --batch 16", dir_);
}

/// The JSON object at the end of a run's merged output.
json json_of(const Outcome& o) {
  const std::size_t at = o.output.find('{');
  if (at == std::string::npos) return json::object();
  return json::parse(o.output.substr(at));
}

const std::string kBatch64 = kTrain + "--batch 64 ";
const std::string kDynamic =
    kBatch64 + "--optimizer sgd --lr 0.02 --sparsity 0.8 --update-every 2 --drop 0.5 ";

// 2 epochs planned as the first half of 4 (--horizon-epochs 4), then 2 more from the
// checkpoint with no schedule flags: the checkpoint's schedule, so the same masks and
// weights, bit for bit, as 4 epochs in one run.
void expect_dynamic_resume_equals_uninterrupted(const std::string& rule, const fs::path& dir) {
  const std::string train = kDynamic + "--dynamic " + rule;
  const std::string whole = (dir / (rule + "-whole.ckpt")).string(),
                    half = (dir / (rule + "-half.ckpt")).string(),
                    resumed = (dir / (rule + "-resumed.ckpt")).string();
  const json four = run_json(train + " --epochs 4 --checkpoint " + whole);
  const json two = run_json(train + " --epochs 2 --horizon-epochs 4 --checkpoint " + half);
  const Outcome o =
      run(kBatch64 + "--epochs 2 --json --resume " + half + " --checkpoint " + resumed);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_CONTAINS(o.output, "dynamic sparsity " + rule + ": every 2 steps, drop 0.5 until 0.75");
  EXPECT_CONTAINS(o.output, "(the checkpoint's)");
  const json two_more = json_of(o);
  EXPECT_EQ(two_more["dynamic"], rule);
  EXPECT_GT(two["mask_updates"].get<int>(), 0);
  EXPECT_GT(two_more["mask_updates"].get<int>(), 0);
  EXPECT_EQ(two["mask_updates"].get<int>() + two_more["mask_updates"].get<int>(),
            four["mask_updates"].get<int>());
  EXPECT_EQ(four["final_loss"], two_more["final_loss"]);
  EXPECT_EQ(four["test_loss"], two_more["test_loss"]);
  EXPECT_TRUE(read_file(whole) == read_file(resumed))
      << "the resumed checkpoint (masks, weights, schedule) differs from the uninterrupted one";
}

TEST_F(CliTrain, ResumedTwoPlusTwoEpochsOfRiglEqualFour) {
  expect_dynamic_resume_equals_uninterrupted("rigl", dir_);
}

TEST_F(CliTrain, ResumedTwoPlusTwoEpochsOfSetEqualFour) {
  expect_dynamic_resume_equals_uninterrupted("set", dir_);
}

TEST_F(CliTrain, AResumedRunKeepsTheStoredHorizonUnlessAFlagMovesIt) {
  const std::string ckpt = path("short.ckpt");
  run_json(kDynamic + "--dynamic rigl --epochs 2 --checkpoint " + ckpt);  // horizon: 2 epochs
  Outcome o = run(kBatch64 + "--epochs 2 --json --resume " + ckpt);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_CONTAINS(o.output,
                  "the horizon ends before this run does: the masks stay fixed after step 75");
  EXPECT_EQ(json_of(o)["mask_updates"], 0);

  o = run(kBatch64 + "--epochs 2 --json --horizon-epochs 4 --drop 0.25 --resume " + ckpt);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_CONTAINS(o.output,
                  "--drop replaces its 0.5, --horizon-epochs replaces its horizon of 100 steps");
  EXPECT_GT(json_of(o)["mask_updates"].get<int>(), 0);

  o = run(kTrain + "--epochs 1 --json --dynamic none --resume " + ckpt);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(json_of(o)["dynamic"], "none");
  EXPECT_EQ(json_of(o)["mask_updates"], 0);

  const std::string fixed = path("fixed.ckpt");
  run_json(kTrain + "--epochs 1 --checkpoint " + fixed);
  expect_exit(run(kTrain + "--epochs 1 --drop 0.2 --resume " + fixed), 2,
              "--drop needs --dynamic set or rigl");
  expect_exit(run(kTrain + "--epochs 1 --horizon-epochs 3"), 2,
              "--horizon-epochs needs --dynamic set or rigl");
}

TEST_F(CliTrain, AScheduleOutOfRangeInACheckpointIsBadDataNamed) {
  const std::string ckpt = path("schedule.ckpt");
  run_json(kDynamic + "--dynamic set --epochs 1 --checkpoint " + ckpt);
  std::string bytes = read_file(ckpt);
  const std::size_t section = bytes.find("DYNS");
  ASSERT_NE(section, std::string::npos);
  const double drop = 2;  // the payload: u32 rule, i64 update_every, f64 drop, ...
  std::memcpy(bytes.data() + section + 16 + 12, &drop, 8);
  const std::uint32_t crc =
      sluice::crc32(std::as_bytes(std::span(bytes.data() + section + 16, 44)));
  std::memcpy(bytes.data() + section + 12, &crc, 4);
  std::ofstream(ckpt, std::ios::binary | std::ios::trunc) << bytes;
  const Outcome o = run(kTrain + "--epochs 1 --resume " + ckpt);
  expect_exit(o, 1, ckpt);
  EXPECT_CONTAINS(o.output, "drop must be in (0, 1]");
}

TEST_F(CliTrain, ResumeRefusesASeedThatIsNotTheCheckpoints) {
  const std::string ckpt = path("m.ckpt");
  run_json(kTrain + "--epochs 1 --seed 3 --checkpoint " + ckpt);
  expect_exit(run(kTrain + "--epochs 1 --seed 4 --resume " + ckpt), 2,
              "--seed 4 differs from the seed 3");
  EXPECT_EQ(run_json(kTrain + "--epochs 1 --seed 3 --resume " + ckpt)["seed"], 3);
}

TEST_F(CliTrain, ARunWhoseEveryStepWasSkippedFailsAndKeepsTheOlderCheckpoint) {
  const fs::path ckpt = dir_ / "good.ckpt";
  sluice::HostModelMemory older;
  older.add_layer(sluice::CsrMatrix::random(4, 4, 0.5, 3));
  older.save(ckpt);
  const std::string before = read_file(ckpt);
  const Outcome o = run(kTrain + "--epochs 1 --lr 1e300 --checkpoint " + ckpt.string());
  expect_exit(o, 1, "no progress");
  EXPECT_NE(o.output.find("steps were skipped"), std::string::npos) << o.output;
  EXPECT_EQ(read_file(ckpt), before);
}

TEST_F(CliTrain, EmptyPathsAndBadNumbersAreBadArguments) {
  expect_exit(run(kTrain + "--epochs 1 --resume ''"), 2, "--resume");
  expect_exit(run(kTrain + "--epochs 1 --checkpoint ''"), 2, "--checkpoint");
  expect_exit(run(kTrain + "--epochs 1 --checkpoint " + "'a\nb'"), 2, "control character");
  expect_exit(run(kTrain + "--epochs 1 --seed -1"), 2, "--seed");
  expect_exit(run(kTrain + "--epochs 1 --data " + path("x.csv")), 2, "--data");
}

TEST_F(CliTrain, ACheckpointWithNoNetworkIsBadDataNamed) {
  const std::string empty = path("empty.ckpt");
  sluice::HostModelMemory none;
  none.save(empty);
  expect_exit(run(kTrain + "--epochs 1 --resume " + empty), 1, empty);

  const std::string broken = path("broken.ckpt");
  sluice::HostModelMemory m;
  m.add_layer(sluice::CsrMatrix::random(24, 64, 0.5, 1));
  m.add_layer(sluice::CsrMatrix::random(10, 23, 0.5, 2));  // takes 23, given 24
  m.save(broken);
  const Outcome o = run(kTrain + "--epochs 1 --resume " + broken);
  expect_exit(o, 1, broken);
  EXPECT_NE(o.output.find("layer 1 takes 23 inputs"), std::string::npos) << o.output;

  // An input scaling for other inputs than the model's (a file written by another tool).
  const std::string misscaled = path("misscaled.ckpt");
  sluice::HostModelMemory scaled;
  scaled.add_layer(sluice::CsrMatrix::random(24, 64, 0.5, 1));
  scaled.add_layer(sluice::CsrMatrix::random(10, 24, 0.5, 2));
  scaled.input_mean = scaled.input_scale = {1.0, 1.0};
  scaled.save(misscaled);
  expect_exit(run(kTrain + "--epochs 1 --resume " + misscaled), 1,
              "checkpoint " + misscaled + " keeps the scaling of 2 inputs for a model of 64");
}

// Saving renames a new file over --checkpoint: one that is the user's data (a slip of the
// flags) or a pipe or device is refused before training, and left as it was; a checkpoint,
// or an empty file, is replaced as asked.
TEST_F(CliTrain, ACheckpointPathThatHoldsSomethingElseIsRefused) {
  const std::string data = path("data.csv");
  std::string text;
  for (int r = 0; r < 40; ++r) text += std::to_string(r % 5) + "," + std::to_string(r % 2) + "\n";
  std::ofstream(data) << text;
  const std::string train = "train --dataset " + data + " --layers 1,4,2 --epochs 1 --checkpoint ";
  expect_exit(run(train + data), 2,
              "--checkpoint " + data +
                  " is a file but not a sluice checkpoint, which saving would "
                  "replace");
  ASSERT_EQ(::mkfifo(path("pipe").c_str(), 0600), 0);
  expect_exit(run(train + path("pipe")), 2, "is not a file (a device or pipe)");
  EXPECT_TRUE(std::filesystem::is_fifo(path("pipe")));
  std::ofstream(path("empty.ckpt")).close();
  ASSERT_EQ(run(train + path("empty.ckpt")).exit_code, 0);
  EXPECT_TRUE(sluice::ModelMemory::is_checkpoint(path("empty.ckpt")));
  EXPECT_EQ(run(train + path("empty.ckpt")).exit_code, 0);
  std::ifstream in(data);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text);
}

TEST_F(CliTrain, AFileNameThatIsNotUtf8GivesValidJson) {
  std::string text;
  for (int r = 0; r < 60; ++r) text += std::to_string(r % 7) + "," + std::to_string(r % 2) + "\n";
  const std::string name = path("caf\xe9.csv");  // Latin-1
  std::ofstream(name) << text;
  const Outcome o = run("train --dataset '" + name + "' --layers 1,4,2 --epochs 1 --json",
                        /*merge_stderr=*/false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  json j;
  ASSERT_NO_THROW(j = json::parse(o.output)) << o.output;
  EXPECT_NE(j["dataset"].get<std::string>().find("caf\xef\xbf\xbd.csv"), std::string::npos);
}

// A resumed run not told what to train on trains on what the model was trained on (a CSV
// by its absolute path, wherever either run was started; a GPT's text too), not on the
// default data set; data no longer there is refused, naming it and the flag.
TEST_F(CliTrain, AResumedRunTrainsOnWhatTheModelWasTrainedOn) {
  fs::create_directory(path("data"));
  std::string rows;
  for (int r = 0; r < 60; ++r) rows += std::to_string(r % 5) + "," + std::to_string(r % 2) + "\n";
  std::ofstream(path("data/two.csv")) << rows;
  const std::string ckpt = path("m.ckpt");
  const Outcome first = sluice::testing::run_cli(
      "env -C " + path("data") + " " + SLUICE_CLI_PATH,
      "train --dataset two.csv --layers 1,4,2 --epochs 1 --checkpoint " + ckpt);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const Outcome resumed = run("train --epochs 1 --resume " + ckpt);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("training on " + path("data/two.csv") + ", as checkpoint"),
            std::string::npos)
      << resumed.output;
  EXPECT_EQ(run_json("train --epochs 1 --resume " + ckpt).value("dataset", ""),
            path("data/two.csv"));
  fs::remove(path("data/two.csv"));
  expect_exit(run("train --epochs 1 --resume " + ckpt), 1,
              "checkpoint " + ckpt + " was trained on '" + path("data/two.csv") +
                  "', which is not there now: pass --dataset");
  // Built-in data by name: synthetic stays synthetic (the default would be digits, where
  // its file is found).
  ASSERT_EQ(run(kTrain + "--epochs 1 --checkpoint " + ckpt).exit_code, 0);
  EXPECT_EQ(run_json("train --epochs 1 --resume " + ckpt).value("dataset", ""), "synthetic");
  // A GPT's text.
  std::ofstream(path("data/text.txt")) << std::string(5000, 'x') + std::string(5000, 'y');
  const std::string gpt = "train --model gpt --steps 2 --context 8 --d-model 8 --blocks 1 ";
  ASSERT_EQ(run(gpt + "--text " + path("data/text.txt") + " --checkpoint " + ckpt).exit_code, 0);
  EXPECT_EQ(run_json("train --model gpt --steps 1 --resume " + ckpt).value("text", ""),
            path("data/text.txt"));
}

// A CSV whose labels are class names (iris's species) trains, says which class each name
// is, and its JSON lists them by class; resumed, the same names are the same classes.
TEST_F(CliTrain, ClassNamesInACsvAreClasses) {
  std::string text = "width,height,species\n";
  const char* names[] = {"setosa", "versicolor", "virginica"};  // by height
  for (int r = 89; r >= 0; --r) {  // virginica first: the classes' order is not the file's
    text += std::to_string(r % 7) + "," + std::to_string(r % 3) + "," + names[r % 3] + "\n";
  }
  std::ofstream(path("iris.csv")) << text;
  const std::string train = "train --dataset " + path("iris.csv") + " --epochs 3 --batch 8 ";
  Outcome o =
      run(train + "--layers 2,8,3 --sparsity 0 --lr 0.05 --checkpoint " + path("iris.ckpt"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("(by name, sorted): 'setosa'=0, 'versicolor'=1, 'virginica'=2"),
            std::string::npos)
      << o.output;
  o = run(train + "--json --resume " + path("iris.ckpt"), /*merge_stderr=*/false);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const json j = json::parse(o.output);
  EXPECT_EQ(j["class_names"], json({"setosa", "versicolor", "virginica"}));
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.9);  // the label follows the second column
}

// A model keeps what its inputs and outputs meant: resumed on data that lacks a class, its
// labels are numbered by the model's class names (the data's own sorted names would number
// the rest from 0: every prediction wrong) and its features scaled as the model's training
// set was (the data's own standardisation would shift them: half the predictions wrong).
// A name the model never learnt, or labels by number, are refused by line.
TEST_F(CliTrain, AResumedModelNumbersClassesAndScalesInputsAsItLearntThem) {
  const char* names[] = {"setosa", "versicolor", "virginica"};  // by height
  std::string all = "width,height,species\n", two = all;
  for (int r = 0; r < 120; ++r) {
    const std::string line =
        std::to_string(r % 7) + "," + std::to_string(r % 3) + "," + names[r % 3] + "\n";
    all += line;
    if (r % 3 > 0) two += line;
  }
  std::ofstream(path("all.csv")) << all;
  std::ofstream(path("two.csv")) << two;
  const std::string ckpt = path("named.ckpt");
  const json trained = run_json("train --dataset " + path("all.csv") +
                                " --layers 2,8,3 --sparsity 0 --lr 0.05 --epochs 10 --batch 8 "
                                "--checkpoint " +
                                ckpt);
  ASSERT_GT(trained.value("test_accuracy", 0.0), 0.9);
  const std::string resume = " --epochs 1 --batch 8 --lr 1e-9 --resume " + ckpt;
  const json resumed = run_json("train --dataset " + path("two.csv") + resume);
  EXPECT_EQ(resumed["class_names"], json({"setosa", "versicolor", "virginica"}));
  EXPECT_GT(resumed.value("test_accuracy", 0.0), 0.9);
  std::string rose = two;
  rose.replace(rose.find("versicolor"), 10, "rose");
  std::ofstream(path("rose.csv")) << rose;
  expect_exit(run("train --dataset " + path("rose.csv") + resume), 1,
              "rose.csv:2: class 'rose' is not one of the 3 classes named; classes of "
              "checkpoint " +
                  ckpt + " (by name, as the model learnt them): 'setosa'=0, 'versicolor'=1");
  expect_exit(run("train --dataset synthetic" + resume), 1,
              "synthetic: the labels are class numbers, where the classes are named ('setosa' "
              "is class 0)");
}

/// Runs the CLI with `args` (split on spaces) in a child; returns its pid. Its stdout and
/// stderr go to the files `out` and `err` ("": /dev/null).
pid_t spawn_cli(const std::string& args, const std::string& out = "", const std::string& err = "") {
  std::vector<std::string> words{SLUICE_CLI_PATH};
  std::istringstream in(args);
  for (std::string w; in >> w;) words.push_back(w);
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    const int flags = O_WRONLY | O_CREAT | O_TRUNC;
    ::dup2(::open(out.empty() ? "/dev/null" : out.c_str(), flags, 0644), 1);
    ::dup2(::open(err.empty() ? "/dev/null" : err.c_str(), flags, 0644), 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

/// Waits (a minute at most) for the running child `pid` to have written `words` to `file`;
/// kills it if it does not.
::testing::AssertionResult wrote(pid_t pid, const std::string& file, const std::string& words) {
  for (int waited = 0; waited < 60000; waited += 5) {
    if (read_file(file).find(words) != std::string::npos) return ::testing::AssertionSuccess();
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return ::testing::AssertionFailure() << "the CLI ended without writing '" << words << "':\n"
                                           << read_file(file);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return ::testing::AssertionFailure() << "no '" << words << "' in a minute";
}

/// The exit code of the child `pid`; -signal if a signal ended it.
int exit_code_of(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

// Ctrl-C stops a run at the end of its step instead of losing every step: the model
// trained so far is saved and resumes, the run reports it and exits 130, as a shell
// reports a process SIGINT ended.
TEST_F(CliTrain, CtrlCSavesTheStepsTrainedSoFar) {
  const std::string ckpt = path("m.ckpt");
  const std::string out = path("out.json");
  const std::string err = path("err.txt");
  const pid_t pid = spawn_cli(
      "train --dataset synthetic --layers 64,32,10 --epochs 100000 --json --checkpoint " + ckpt,
      out, err);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wrote(pid, err, "epoch   2"));
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  EXPECT_EQ(exit_code_of(pid), 130) << read_file(err);
  EXPECT_NE(read_file(err).find("interrupted (SIGINT) after "), std::string::npos)
      << read_file(err);
  const json j = json::parse(read_file(out));
  EXPECT_TRUE(j.at("interrupted").get<bool>());
  sluice::HostModelMemory saved;
  ASSERT_NO_THROW(saved.load(ckpt));
  EXPECT_EQ(saved.step(), j.at("steps").get<std::int64_t>());
  EXPECT_GT(saved.step(), 0);
  EXPECT_FALSE(run_json("train --dataset synthetic --epochs 1 --resume " + ckpt)
                   .at("interrupted")
                   .get<bool>());
}

// SIGTERM (what a scheduler sends at a job's time limit) likewise, for a GPT in a store:
// the store commits the step it was in and resumes there.
TEST_F(CliTrain, SigtermCommitsAStoresStepAndExits143) {
  const std::string store = path("store");
  const std::string out = path("out.txt");
  const std::string err = path("err.txt");
  const std::string text = path("text.txt");
  std::ofstream(text) << std::string(20000, 'a') + std::string(20000, 'b');
  const pid_t pid = spawn_cli("train --model gpt --text " + text +
                                  " --context 16 --d-model 16 --blocks 1 --steps 100000000 "
                                  "--model-store " +
                                  store,
                              out, err);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wrote(pid, out, "gpt: "));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  EXPECT_EQ(exit_code_of(pid), 143) << read_file(err);
  EXPECT_NE(read_file(out).find("interrupted (SIGTERM) after "), std::string::npos)
      << read_file(out);
  const json j = run_json("train --model gpt --text " + text + " --steps 1 --model-store " + store);
  EXPECT_GT(j.value("steps_total", 0), 1);  // went on from the step it committed
}

TEST_F(CliTrain, KillingTheCliDuringACheckpointSaveKeepsTheOlderOne) {
  // A model big enough that its save takes a while (tens of MB, fsynced), trained for a
  // moment; the CLI is killed as soon as its temporary file appears.
  const std::string ckpt = path("m.ckpt");
  const std::string train =
      "train --dataset synthetic --layers 64,2048,1024,10 --sparsity 0.5 --epochs 1 --batch 512 "
      "--checkpoint " +
      ckpt;
  ASSERT_EQ(run(train).exit_code, 0);
  const std::string older = read_file(ckpt);
  int caught = 0;
  for (int attempt = 0; attempt < 6 && caught == 0; ++attempt) {
    const pid_t pid = spawn_cli(train);
    ASSERT_GT(pid, 0);
    const fs::path tmp = ckpt + ".tmp." + std::to_string(pid);
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (fs::exists(tmp)) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        // Caught in the act only if the kill came before the rename: on a busy machine the
        // save can finish between seeing its file and the signal.
        caught += WIFSIGNALED(status) && fs::exists(tmp) ? 1 : 0;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    // Whatever the moment, the path holds a whole checkpoint that loads.
    sluice::HostModelMemory loaded;
    EXPECT_NO_THROW(loaded.load(ckpt));
    if (caught > 0) {
      EXPECT_TRUE(read_file(ckpt) == older) << "the killed save replaced the checkpoint";
      // The next save removes the dead process's leftover.
      ASSERT_EQ(run(train).exit_code, 0);
      EXPECT_FALSE(fs::exists(tmp)) << "a dead saver's temporary file was not cleaned up";
      EXPECT_NO_THROW(loaded.load(ckpt));
    }
  }
  EXPECT_GT(caught, 0) << "no save was caught in the act in 6 tries";
}

}  // namespace

namespace {

// One label of 10^6 among labels 0..2 implies a million-class output layer (3.7 GB to
// train): budgeted before it is built, against what the process may have (RLIMIT_AS at
// 2 GiB here), and refused as bad data naming the file and the label's line. The same file
// without that line trains under the same limit.
TEST_F(CliTrain, AStrayLabelsModelIsBudgetedNamingItsLine) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer cannot start under RLIMIT_AS";
  std::string rows;
  for (int i = 0; i < 40; ++i) {
    rows += std::to_string(i % 7) + ",0.5," + std::to_string(i % 5) + ",1," +
            std::to_string(i % 3) + "\n";
  }
  std::ofstream(path("good.csv")) << rows;
  std::ofstream(path("stray.csv")) << "a,b,c,d,label\n" << rows << "\n0.1,0.2,0.3,0.4,1000000\n";
  const std::string limited = std::string("prlimit --as=2147483648 ") + SLUICE_CLI_PATH;
  const Outcome good =
      sluice::testing::run_cli(limited, "train --epochs 1 --dataset " + path("good.csv"));
  EXPECT_EQ(good.exit_code, 0) << good.output;
  const Outcome stray =
      sluice::testing::run_cli(limited, "train --epochs 1 --dataset " + path("stray.csv"));
  expect_exit(stray, 1, path("stray.csv") + ":43: label 1000000 implies 1000001 classes");
  EXPECT_NE(stray.output.find("RLIMIT_AS"), std::string::npos) << stray.output;
}

// A step holds no more tokens than the training set has: a --batch beyond it is budgeted
// as the set (it was counted whole, and 10^7 tokens of a 4096-wide model refused).
TEST_F(CliTrain, ABatchBeyondTheDataIsBudgetedAsTheData) {
  const Outcome o = sluice::testing::run_cli(
      SLUICE_CLI_PATH,
      "train --dataset synthetic --layers 64,4096,4096,10 --batch 16777216 --steps 1");
  EXPECT_EQ(o.exit_code, 0) << o.output;
}

}  // namespace
