#include "lr_decay_option.hpp"

#include <algorithm>
#include <ostream>
#include <sstream>

#include "number_options.hpp"
#include "sluice/error.hpp"

namespace sluice::cli {
namespace {

/// Warmup steps when --warmup-steps is not given: enough to get Adam's moments settled
/// before the full rate, never a large part of a short run.
constexpr std::int64_t kDefaultWarmup = 50;

bool given(const CLI::Option* option) {
  return option != nullptr && option->count() > 0;
}

std::string describe(const LearningRateDecay& d) {
  std::string text = decay_name(d);
  if (d.warmup_steps > 0) text += ", warmup " + std::to_string(d.warmup_steps) + " steps";
  if (d.decay_steps > 0) {
    std::ostringstream fraction;  // the stored one: a library user may have set another
    fraction << d.final_fraction;
    text += ", to " + fraction.str() + "x at step " + std::to_string(d.decay_steps);
  }
  return text;
}

}  // namespace

void add_decay_options(CLI::App& cmd, DecayOptions& o) {
  o.schedule_option = cmd.add_option("--lr-schedule", o.schedule,
                                     "cosine (warmup, then half a cosine down to 0.1x --lr at "
                                     "--decay-steps) or constant (after the warmup); the GPT's "
                                     "default is cosine, an MLP's a constant rate without warmup")
                          ->check(CLI::IsMember({"cosine", "constant"}));
  o.warmup_option = cmd.add_option("--warmup-steps", o.warmup_steps,
                                   "Steps of linear warmup (default 50, or a tenth of the "
                                   "decay's steps if fewer; 0: none)")
                        ->check(number_range(std::int64_t{0}, std::int64_t{1} << 40));
  o.decay_option = cmd.add_option("--decay-steps", o.decay_steps,
                                  "The step, counted from the model's first, where the "
                                  "cosine ends (default: where --steps ends)")
                       ->check(number_range(std::int64_t{1}, std::int64_t{1} << 40));
}

bool decay_flags_given(const DecayOptions& o) {
  return given(o.schedule_option) || given(o.warmup_option) || given(o.decay_option);
}

const char* decay_name(const LearningRateDecay& decay) {
  return decay.decay_steps > 0 ? "cosine" : "constant";
}

LearningRateDecay resolve_decay(const LearningRateDecay& stored, const DecayOptions& o,
                                bool resuming, const std::string& whose, std::int64_t first_step,
                                std::int64_t planned_end, const std::string& end_flags,
                                std::ostream& progress) {
  if (resuming && !decay_flags_given(o)) {
    progress << "learning rate: " << whose << ", " << describe(stored) << "\n";
    return stored;
  }
  const bool cosine = o.schedule == "cosine";
  if (!cosine && given(o.decay_option)) {
    throw UsageError("--decay-steps needs --lr-schedule cosine: a constant rate has no decay");
  }
  LearningRateDecay d;
  if (cosine) {
    d.decay_steps = given(o.decay_option) ? o.decay_steps : planned_end;
    if (d.decay_steps == 0 && given(o.schedule_option)) {
      throw UsageError("--lr-schedule cosine needs " + end_flags +
                       " or --decay-steps: where the decay ends");
    }
  }
  const std::int64_t span = d.decay_steps > 0 ? d.decay_steps - first_step : 0;
  d.warmup_steps = given(o.warmup_option)
                       ? o.warmup_steps
                       : (span > 0 ? std::min(kDefaultWarmup, span / 10) : kDefaultWarmup);
  if (d.decay_steps > 0 && d.decay_steps <= d.warmup_steps) {
    throw UsageError("--decay-steps " + std::to_string(d.decay_steps) +
                     " must come after the warmup's end at step " + std::to_string(d.warmup_steps) +
                     (first_step > 0
                          ? " (the checkpoint is at step " + std::to_string(first_step) + ")"
                          : std::string()));
  }
  progress << "learning rate: " << describe(d)
           << (cosine && d.decay_steps == 0
                   ? " (no " + end_flags + " or --decay-steps to decay over)"
                   : "")
           << "\n";
  return d;
}

}  // namespace sluice::cli
