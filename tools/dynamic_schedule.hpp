#pragma once
// `sluice train --dynamic set|rigl --update-every K --drop D --update-until F
// --horizon-epochs N`: the mask-update schedule of a run, and of a resumed run the one its
// checkpoint (or model store) keeps unless a flag replaces part of it.
//
// The horizon (DynamicSparsity::total_steps, which --drop's cosine and --update-until are
// fractions of) is a plan fixed when the schedule starts, counted from the model's first
// step: by default where the first run ends (its --epochs, or --steps if fewer), else
// --horizon-epochs N epochs from the model's start. --epochs on resume is how many more
// epochs to train (as for the data order), so a run of 2 epochs that will be resumed for
// 2 more is given --horizon-epochs 4 and then matches 4 epochs in one run, bit for bit. A
// resumed run that goes past the stored horizon keeps it (its masks stay fixed after
// update_until of it) unless --horizon-epochs moves it; stderr says which. --horizon-steps
// gives the horizon in steps instead (the GPT's way: it trains by steps, not epochs).
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "commands.hpp"
#include "sluice/dynamic_sparsity.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::cli {

struct ScheduleOptions {
  std::string dynamic = "none";
  std::int64_t update_every = 100;
  double drop = 0.3;
  double update_until = 0.75;
  std::int64_t horizon_epochs = 0;  ///< 0: where the run that starts the schedule ends
  std::int64_t horizon_steps = 0;   ///< the same in steps (a GPT run has no epochs)
  CLI::Option *rule_option = nullptr, *update_every_option = nullptr, *drop_option = nullptr,
              *update_until_option = nullptr, *horizon_option = nullptr,
              *horizon_steps_option = nullptr;
};

void add_schedule_options(CLI::App& cmd, ScheduleOptions& o);
/// UsageError, before anything starts, for a schedule option a run without a schedule
/// would ignore. `may_resume`: a checkpoint or store may hold a schedule the options
/// change, which is checked by resolve_schedule once it is read.
void check_schedule_options(const ScheduleOptions& o, bool may_resume);

/// What this run trains under: `memory.dynamic` changed by the given flags when
/// `resuming` with a stored schedule, else a new schedule from the flags (seed: the
/// model's). `steps_per_epoch` and `run_steps` (this run's planned steps) size the
/// horizon. A resumed run with a schedule says on `progress` what it keeps and what the
/// flags replace (`source`: "the checkpoint's" or "the store's"). Stores the result in
/// `memory.dynamic`.
DynamicSparsity resolve_schedule(ModelMemory& memory, const ScheduleOptions& o, bool resuming,
                                 std::int64_t steps_per_epoch, std::int64_t run_steps,
                                 const std::string& source, std::ostream& progress);

}  // namespace sluice::cli
