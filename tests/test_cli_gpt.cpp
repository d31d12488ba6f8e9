// `sluice train --model gpt` and `sluice generate` end to end on the real binary, on a small
// generated text (no download needed): the JSON keys, a resumed run, a model store, seeded
// generation, and the arguments and data that must be refused. `--steps` for the MLP as well.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "test_support.hpp"

namespace {

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

class CliGpt : public sluice::testing::TempDirTest {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
    TempDirTest::SetUp();
    std::ofstream out(dir_ / "text.txt", std::ios::binary);
    const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat.\n"};
    std::uint64_t x = 7;
    for (int i = 0; i < 3000; ++i) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      out << words[(x >> 33) % 6];
    }
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string gpt() const {
    return "train --model gpt --text " + path("text.txt") +
           " --context 16 --d-model 32 --heads 2 --blocks 1 --batch 4 ";
  }
};

TEST_F(CliGpt, TrainsReportsResumesAndGenerates) {
  const std::string ckpt = path("gpt.ckpt");
  const json j = run_json(gpt() + "--steps 30 --lr 0.003 --checkpoint " + ckpt);
  for (const char* key : {"val_loss", "val_bits_per_byte", "train_loss", "tokens_per_s",
                          "engine_busy", "steps", "parameters", "nonzeros", "train_seconds"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j.value("steps", 0), 30);
  const double bits = j.value("val_bits_per_byte", 99.0);
  EXPECT_NEAR(bits, j.value("val_loss", 0.0) / std::log(2.0), 1e-9);
  EXPECT_LT(bits, 6.0);  // below a uniform byte (8 bits): it learnt something
  EXPECT_GT(j.value("parameters", 0), j.value("nonzeros", 0));
  EXPECT_GT(j.value("tokens_per_s", 0.0), 0.0);

  const json resumed = run_json(gpt().substr(0, gpt().find(" --context")) + " --batch 4 --resume " +
                                ckpt + " --steps 5");
  EXPECT_EQ(resumed.value("steps", 0), 5);
  EXPECT_EQ(resumed.value("steps_total", 0), 35);
  EXPECT_EQ(resumed.value("d_model", 0), 32);

  const std::string gen = "generate --checkpoint " + ckpt + " --prompt 'the ' --bytes 40 ";
  const Outcome a = run(gen + "--seed 3", false);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output.size(), 4U + 40U + 1U);
  EXPECT_EQ(a.output.rfind("the ", 0), 0U);
  EXPECT_EQ(run(gen + "--seed 3", false).output, a.output);
  EXPECT_EQ(run(gen + "--temperature 0 --seed 1", false).output,
            run(gen + "--temperature 0 --seed 2", false).output);

  // Any byte can be sampled: raw (and through a pipe, by default) as generated; escaped, no
  // control byte reaches a terminal, and UTF-8 passes as it is.
  const std::string hot = "generate --checkpoint " + ckpt + " --bytes 2000 --temperature 100 ";
  const std::string raw = run(hot + "--controls raw", false).output;
  EXPECT_EQ(raw.size(), 2001U);
  EXPECT_EQ(run(hot, false).output, raw);
  auto controls = [](const std::string& text) {
    return std::count_if(text.begin(), text.end(), [](char c) {
      const auto b = static_cast<unsigned char>(c);
      return (b < 0x20 && b != '\n' && b != '\t') || b == 0x7F;
    });
  };
  EXPECT_GT(controls(raw), 0);
  const std::string escaped = run(hot + "--controls escape", false).output;
  EXPECT_EQ(controls(escaped), 0);
  EXPECT_NE(escaped.find("\\x"), std::string::npos);
  // ESC, C1's CSI in UTF-8, the euro sign, a stray byte, a surrogate, an emoji.
  const std::string mixed =
      "\"$(printf 'a\\033b\\302\\233c\\342\\202\\254d\\377\\355\\240\\200e\\360\\237\\230\\200')\"";
  EXPECT_EQ(
      run("generate --checkpoint " + ckpt + " --bytes 0 --controls escape --prompt " + mixed, false)
          .output,
      "a\\x1bb\\xc2\\x9bc\xe2\x82\xac"
      "d\\xff\\xed\\xa0\\x80"
      "e\xf0\x9f\x98\x80\n");
  expect_exit(run(gen + "--controls some"), 2, "--controls");
}

TEST_F(CliGpt, BadArgumentsExit2AndBadDataExit1) {
  expect_exit(run(gpt() + "--steps 1 --layers 4,5"), 2, "--layers is not for --model gpt");
  expect_exit(run("train --model gpt --text " + path("text.txt") + " --d-model 30 --heads 4"), 2,
              "not a multiple of heads");
  expect_exit(run("train --dataset synthetic --context 16 --steps 1"), 2,
              "--context needs --model gpt");
  expect_exit(run(gpt() + "--steps 1 --fabric mpi --engines 2"), 2,
              "--engines cannot be given with --fabric mpi");
  expect_exit(run(gpt() + "--steps 1 --model transformer"), 2, "transformer");
  // A step that no machine holds is refused before anything is built (it was killed for
  // memory after a minute): its activations, and its model.
  const std::string text = "train --model gpt --steps 1 --text " + path("text.txt");
  expect_exit(run(text + " --context 4096 --batch 16777216"), 2,
              "on batches of 16777216 sequences needs");
  expect_exit(run(text + " --context 1 --batch 1 --d-model 16384 --blocks 256"), 2,
              "d_model=16384 heads=4 blocks=256 on batches of 1 sequences needs");
  expect_exit(run("generate --prompt x"), 2, "--checkpoint FILE or --model-store DIR");
  expect_exit(run("generate --checkpoint x --model-store y"), 2, "excludes");
  expect_exit(run("generate --checkpoint x --temperature -1"), 2, "temperature");

  expect_exit(run("train --model gpt --text " + path("missing.txt") + " --steps 1"), 1,
              "missing.txt");
  { std::ofstream(dir_ / "empty.txt"); }
  expect_exit(run("train --model gpt --text " + path("empty.txt") + " --steps 1"), 1, "empty.txt");
  // An MLP checkpoint is no GPT, nor a GPT's an MLP: wrong flags for good data, named.
  const std::string mlp = path("mlp.ckpt");
  ASSERT_EQ(
      run("train --dataset synthetic --layers 64,8,10 --steps 2 --checkpoint " + mlp).exit_code, 0);
  expect_exit(run("generate --checkpoint " + mlp), 2,
              "holds an MLP (layers 64,8,10), not a GPT: sluice generate samples");
  expect_exit(run(gpt() + "--steps 1 --resume " + mlp), 2,
              "holds an MLP (layers 64,8,10), not a GPT: train it without --model gpt");
  const std::string gpt_ckpt = path("gpt.ckpt");
  ASSERT_EQ(run(gpt() + "--steps 1 --checkpoint " + gpt_ckpt).exit_code, 0);
  expect_exit(run("train --epochs 1 --resume " + gpt_ckpt), 2,
              "holds a gpt vocab=256 context=16 d_model=32 heads=2 blocks=1, not an MLP: train "
              "it with --model gpt");
}

// --precision bf16: the projections stream in bf16, as the JSON and the progress say; the
// model trains, resumes in fp32 (a run's precision, not the model's), and one precision for
// every projection is all the GPT takes.
TEST_F(CliGpt, ProjectionsStreamInBf16) {
  const std::string ckpt = path("bf16.ckpt");
  const Outcome o = run(gpt() + "--steps 20 --lr 0.003 --precision bf16 --checkpoint " + ckpt);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("projections streamed in bf16"), std::string::npos) << o.output;
  const json fp32 = run_json(gpt() + "--steps 20 --lr 0.003");
  const json bf16 = run_json(gpt() + "--steps 20 --lr 0.003 --precision bf16");
  EXPECT_EQ(bf16.value("precision", ""), "bf16");
  EXPECT_EQ(fp32.value("precision", ""), "fp32");
  EXPECT_NE(bf16.value("val_loss", 0.0), fp32.value("val_loss", 0.0));
  EXPECT_NEAR(bf16.value("val_loss", 0.0), fp32.value("val_loss", 0.0), 0.02);
  EXPECT_LT(bf16.value("val_bits_per_byte", 99.0), 6.0);
  const json resumed = run_json("train --model gpt --text " + path("text.txt") +
                                " --batch 4 --steps 2 --precision fp32 --resume " + ckpt);
  EXPECT_EQ(resumed.value("steps_total", 0), 22);
  expect_exit(run(gpt() + "--steps 1 --precision bf16,fp32"), 2,
              "the GPT's projections stream in one precision, fp32 or bf16");
  expect_exit(run(gpt() + "--steps 1 --precision fp16"), 2, "--precision 'fp16'");
}

// --model-store: the GPT in files under a budget smaller than the model, its disk keys in
// the JSON, and 3 + 2 steps resumed from the store ending as 5 in one run in RAM (the
// decay planned to step 5 in both); what a store cannot do is refused.
TEST_F(CliGpt, TrainsInAModelStoreAndResumesIt) {
  // Two blocks at half density: the store (1.9 MB) is twice the budget, which holds the
  // largest layer's working set (the byte table's).
  const std::string text = "train --model gpt --text " + path("text.txt") + " --batch 4 ";
  const std::string shape = "--context 16 --d-model 64 --heads 2 --blocks 2 --sparsity 0.5 ";
  const std::string store = " --model-store " + path("store") + " --model-memory-budget 800000";
  const json first = run_json(text + shape + "--steps 3 --decay-steps 5" + store);
  for (const char* key : {"model_store_bytes", "disk_read_bytes_per_s", "disk_write_bytes_per_s",
                          "disk_wait_seconds", "peak_rss_bytes"}) {
    EXPECT_TRUE(first.contains(key)) << key;
  }
  EXPECT_GT(first.value("model_store_bytes", 0), 2 * 800000);
  EXPECT_GT(first.value("disk_read_bytes_per_s", 0.0), 0.0);  // evicted layers read back
  const json resumed = run_json(text + "--steps 2" + store);
  EXPECT_EQ(resumed.value("steps_total", 0), 5);
  EXPECT_EQ(resumed.value("d_model", 0), 64);
  const json straight =
      run_json(text + shape + "--steps 5 --decay-steps 5 --checkpoint " + path("straight.ckpt"));
  EXPECT_EQ(resumed.value("val_loss", 0.0), straight.value("val_loss", 1.0));
  // generate reads a store as it reads a checkpoint: the same model, the same text.
  const std::string sample = " --prompt 'the ' --bytes 60 --seed 3";
  const Outcome from_store = run(
      "generate --model-store " + path("store") + " --model-memory-budget 800000" + sample, false);
  ASSERT_EQ(from_store.exit_code, 0) << from_store.output;
  EXPECT_EQ(from_store.output.size(), 4U + 60U + 1U);
  EXPECT_EQ(from_store.output,
            run("generate --checkpoint " + path("straight.ckpt") + sample, false).output);
  // ... and creates none where there is none.
  expect_exit(run("generate --model-store " + path("none")), 1, "no model store");
  EXPECT_FALSE(std::filesystem::exists(path("none")));

  // A run that cannot start builds nothing: the next one makes the store's model.
  const std::string later = " --model-store " + path("later") + " --model-memory-budget 800000";
  expect_exit(
      run("train --model gpt --text " + path("missing.txt") + " " + shape + "--steps 1" + later), 1,
      "missing.txt");
  EXPECT_FALSE(std::filesystem::exists(path("later")));
  EXPECT_EQ(run_json(text + shape + "--steps 1" + later).value("steps_total", 0), 1);

  expect_exit(run(text + shape + "--steps 1" + store), 2, "fixes them");
  expect_exit(run(text + "--steps 1 --resume x" + store), 2, "its own checkpoint");
  expect_exit(
      run(text + "--steps 1 --model-store " + path("small") + " --model-memory-budget 100000"), 2,
      "too small");
  ASSERT_EQ(run("train --dataset synthetic --layers 64,8,10 --steps 2 --model-store " + path("mlp"))
                .exit_code,
            0);
  expect_exit(run(text + "--steps 1 --model-store " + path("mlp")), 2, "not a GPT");
  expect_exit(run("generate --model-store " + path("mlp")), 2, "not a GPT");
}

// A text that never ends (a device, a pipe left open) is refused once it passes the most a
// corpus may hold (here a quarter of RLIMIT_AS at 1 GB), not read until memory runs out.
TEST_F(CliGpt, ATextThatNeverEndsIsRefused) {
  if (sluice::testing::kUnderSanitizer) GTEST_SKIP() << "a sanitizer cannot start under RLIMIT_AS";
  const Outcome o =
      sluice::testing::run_cli(std::string("prlimit --as=1000000000 ") + SLUICE_CLI_PATH,
                               "train --model gpt --steps 1 --text /dev/zero");
  expect_exit(o, 1, "/dev/zero: more than 250000000 bytes (0.25 GB), the most read of one input");
}

// --dynamic on the GPT: the JSON keys, updates counted, and 3 + 3 resumed steps planned as
// the first half of 6 (--horizon-steps 6) end with the checkpoint of 6 in one run, byte
// for byte (the schedule is kept by the checkpoint).
TEST_F(CliGpt, DynamicSparsityReportsAndResumesItsSchedule) {
  for (const std::string rule : {"set", "rigl"}) {
    SCOPED_TRACE(rule);
    const std::string dyn = "--dynamic " + rule + " --update-every 2 --drop 0.4 ";
    const std::string whole = path(rule + "_whole.ckpt"), half = path(rule + "_half.ckpt"),
                      resumed = path(rule + "_resumed.ckpt");
    const json j = run_json(gpt() + dyn + "--steps 6 --checkpoint " + whole);
    EXPECT_EQ(j.value("dynamic", ""), rule);
    EXPECT_EQ(j.value("mask_updates", -1), 2);  // after steps 2 and 4 (< 0.75 * 6)
    EXPECT_GT(j.value("mask_update_seconds", 0.0), 0.0);
    EXPECT_EQ(j.value("mask_score_seconds", 0.0) > 0, rule == "rigl");
    run_json(gpt() + dyn + "--steps 3 --horizon-steps 6 --checkpoint " + half);
    const Outcome o =
        run("train --model gpt --text " + path("text.txt") +
                " --batch 4 --steps 3 --json --resume " + half + " --checkpoint " + resumed,
            true);
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_NE(o.output.find("dynamic sparsity " + rule +
                            ": every 2 steps, drop 0.4 until 0.75 "
                            "of a horizon of 6 steps"),
              std::string::npos)
        << o.output;
    EXPECT_EQ(sluice::testing::read_file(resumed), sluice::testing::read_file(whole));
  }
  expect_exit(run(gpt() + "--max-seconds 1 --dynamic set"), 2, "--steps or --horizon-steps");
  expect_exit(run(gpt() + "--steps 2 --dynamic set --horizon-epochs 3"), 2,
              "--horizon-epochs is not for --model gpt");
  expect_exit(run(gpt() + "--steps 2 --drop 0.2"), 2, "--drop needs --dynamic set or rigl");
}

// The learning-rate decay: its keys, and 3 + 3 resumed steps planned as the first half of 6
// (--decay-steps 6) end with the checkpoint of 6 in one run, byte for byte (the decay is
// kept by the checkpoint); without the plan the first run decays over its own 3 steps.
TEST_F(CliGpt, TheCosineDecayIsReportedAndKeptByTheCheckpoint) {
  const std::string whole = path("whole.ckpt"), half = path("half.ckpt"),
                    resumed = path("resumed.ckpt"), short_plan = path("short.ckpt");
  const json j = run_json(gpt() + "--steps 6 --warmup-steps 2 --checkpoint " + whole);
  EXPECT_EQ(j.value("lr_schedule", ""), "cosine");
  EXPECT_EQ(j.value("warmup_steps", -1), 2);
  EXPECT_EQ(j.value("decay_steps", -1), 6);
  run_json(gpt() + "--steps 3 --warmup-steps 2 --decay-steps 6 --checkpoint " + half);
  const std::string resume = "train --model gpt --text " + path("text.txt") + " --batch 4 ";
  const Outcome o =
      run(resume + "--steps 3 --json --resume " + half + " --checkpoint " + resumed, true);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_NE(o.output.find("learning rate: the checkpoint's, cosine, warmup 2 steps, to 0.1x at "
                          "step 6"),
            std::string::npos)
      << o.output;
  EXPECT_EQ(sluice::testing::read_file(resumed), sluice::testing::read_file(whole));
  run_json(gpt() + "--steps 3 --warmup-steps 2 --checkpoint " + short_plan);
  run_json(resume + "--steps 3 --resume " + short_plan + " --checkpoint " + short_plan);
  EXPECT_NE(sluice::testing::read_file(short_plan), sluice::testing::read_file(whole));

  const json constant = run_json(gpt() + "--steps 2 --lr-schedule constant");
  EXPECT_EQ(constant.value("lr_schedule", ""), "constant");
  EXPECT_EQ(constant.value("decay_steps", -1), 0);
  expect_exit(run(gpt() + "--max-seconds 1 --lr-schedule cosine"), 2,
              "needs --steps, --horizon-steps or --decay-steps: where the decay ends");
  expect_exit(run(gpt() + "--steps 2 --lr-schedule constant --decay-steps 4"), 2,
              "--decay-steps needs --lr-schedule cosine");
  expect_exit(run(gpt() + "--steps 5 --warmup-steps 10"), 2, "must come after the warmup");
  expect_exit(run(gpt() + "--steps 5 --lr-schedule linear"), 2, "linear");
}

TEST_F(CliGpt, StepsAndMaxSecondsLimitTheMlpToo) {
  const json j = run_json("train --dataset synthetic --layers 64,16,10 --batch 64 --steps 7");
  EXPECT_EQ(j.value("steps", 0), 7);
  EXPECT_EQ(j.value("epochs", -1), 0);  // 7 steps of 64 are less than one pass over 3200
  const json t = run_json("train --dataset synthetic --layers 64,16,10 --max-seconds 0.5");
  EXPECT_GE(t.value("steps", 0), 1);
  EXPECT_LT(t.value("train_seconds", 99.0), 5.0);
  // A limit no step fits in says so, as the GPT's does (not "0 of 0 steps were skipped").
  expect_exit(run("train --dataset synthetic --layers 64,16,10 --max-seconds 1e-9"), 2,
              "no step was trained: --max-seconds is too small");
}

}  // namespace
