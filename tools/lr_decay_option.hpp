#pragma once
// `sluice train --lr-schedule cosine|constant --warmup-steps W --decay-steps D`: the
// learning-rate decay of a run (LearningRateDecay, saved with the model), and of a resumed
// run the one its checkpoint keeps unless a flag replaces it. The GPT decays by default; an
// MLP only when one of these flags is given (its rate is otherwise constant, as it was).
//
// Cosine (the default) warms up linearly over W steps, then falls along half a cosine to a
// tenth of --lr at step D, counted from the model's first step: by default where training
// is planned to end (--horizon-steps, the plan --dynamic uses too, else where this run's
// --steps end). Without either (a run bounded by --max-seconds alone) the end is unknown,
// so the default is a warmup and then a constant rate. A resumed run
// keeps its checkpoint's decay, which ends where it was planned to, unless a flag is given;
// then the decay is made anew from the flags. Both W and D count from the model's first
// step, so a warmup a resumed model has passed is no warmup.
#include <cstdint>
#include <iosfwd>
#include <string>

#include "commands.hpp"
#include "sluice/optimizer.hpp"

namespace sluice::cli {

struct DecayOptions {
  std::string schedule = "cosine";  ///< "cosine" or "constant"
  std::int64_t warmup_steps = -1;   ///< -1: 50, or a tenth of the decay's steps if fewer
  std::int64_t decay_steps = 0;     ///< 0: where training is planned to end
  CLI::Option *schedule_option = nullptr, *warmup_option = nullptr, *decay_option = nullptr;
};

void add_decay_options(CLI::App& cmd, DecayOptions& o);
/// Any of the decay's flags given.
bool decay_flags_given(const DecayOptions& o);

/// The decay this run trains under: the stored one (`whose`: "the checkpoint's" or "the
/// store's", for the message) when `resuming` and no flag is given,
/// else made from the flags for training planned to end at step `planned_end` (counted
/// from the model's first step; 0: unknown) of a model now at `first_step`; `end_flags`
/// names the flags that set that end ("--steps, --horizon-steps"). UsageError for flags
/// that cannot make one; what was chosen is said on `progress`.
LearningRateDecay resolve_decay(const LearningRateDecay& stored, const DecayOptions& o,
                                bool resuming, const std::string& whose, std::int64_t first_step,
                                std::int64_t planned_end, const std::string& end_flags,
                                std::ostream& progress);

/// "cosine" or "constant" (warmup or not), for reports.
const char* decay_name(const LearningRateDecay& decay);

}  // namespace sluice::cli
