#pragma once
// `sluice train --model gpt`: the options cmd_train.cpp parses for it, and the run.
#include <cstdint>
#include <string>

#include "dynamic_schedule.hpp"
#include "lr_decay_option.hpp"
#include "model_store_option.hpp"
#include "sluice/fabric.hpp"

namespace sluice::cli {

struct GptTrainOptions {
  std::string text;  ///< file or directory; empty: $SLUICE_TEXT, else <program dir>/data/fortunes
  std::int64_t context = 128;
  std::int64_t d_model = 256;
  std::int64_t heads = 4;
  std::int64_t blocks = 4;
  double sparsity = 0.9;
  std::int64_t batch = 32;  ///< sequences per step
  std::int64_t steps = 0;   ///< 0: no step limit (then max_seconds must be set)
  double max_seconds = 0;   ///< 0: no time limit
  int engines = 1;
  std::string fabric = "local";  ///< for the report; an MPI fabric is made by the caller
  int threads = 0;
  std::string path = "auto";
  std::string precision = "fp32";  ///< of the projections' streams
  std::string optimizer = "adam";
  // With the cosine decay, 6e-3 gave a lower held-out loss than 3e-3 after 1,540 steps on
  // the default text (docs/gpt.md).
  double lr = 6e-3;
  bool lr_given = false, optimizer_given = false, seed_given = false, shape_given = false;
  std::uint64_t seed = 1;
  std::string checkpoint, resume;
  ModelStoreOptions store;  ///< --model-store: the model in files, resumed if it holds one
  bool json = false;
  ScheduleOptions schedule;  ///< --dynamic and its options (the sparse layers' masks)
  DecayOptions decay;        ///< --lr-schedule, --warmup-steps, --decay-steps
};

/// Trains (or resumes) a GPT on the text and reports on its held-out part; the exit code.
/// On `fabric` when given (rank 0's MpiFabric; o.engines its engines), else on a LocalFabric
/// of o.engines engines.
int run_gpt_training(GptTrainOptions o, Fabric* fabric = nullptr);

}  // namespace sluice::cli
