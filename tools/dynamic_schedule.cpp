#include "dynamic_schedule.hpp"

#include <ostream>

#include "json_writer.hpp"
#include "number_options.hpp"
#include "sluice/error.hpp"

namespace sluice::cli {
namespace {

bool given(const CLI::Option* option) {
  return option != nullptr && option->count() > 0;
}

/// UsageError if a rule of none comes with an option that only a schedule uses.
void refuse_options_without_rule(const ScheduleOptions& o, MaskUpdateRule rule) {
  if (rule != MaskUpdateRule::none) return;
  for (const CLI::Option* option : {o.update_every_option, o.drop_option, o.update_until_option,
                                    o.horizon_option, o.horizon_steps_option}) {
    if (given(option)) throw UsageError(option->get_name() + " needs --dynamic set or rigl");
  }
}

/// The flag that gives the horizon: --horizon-steps or --horizon-epochs.
const char* horizon_flag(const ScheduleOptions& o) {
  return given(o.horizon_steps_option) ? "--horizon-steps" : "--horizon-epochs";
}

/// --horizon-steps, or --horizon-epochs in steps, refused if it would not count exactly.
std::int64_t horizon_steps(const ScheduleOptions& o, std::int64_t steps_per_epoch) {
  if (given(o.horizon_steps_option)) return o.horizon_steps;
  constexpr std::int64_t kMaxSteps = std::int64_t{1} << 53;
  if (steps_per_epoch > 0 && o.horizon_epochs > kMaxSteps / steps_per_epoch) {
    throw UsageError("--horizon-epochs " + std::to_string(o.horizon_epochs) + " of " +
                     std::to_string(steps_per_epoch) + " steps each is more than 2^53 steps");
  }
  return o.horizon_epochs * steps_per_epoch;
}

/// The stored schedule with what the flags replace; `note` says what changed.
DynamicSparsity replace_given(const DynamicSparsity& stored, const ScheduleOptions& o,
                              std::int64_t steps_per_epoch, std::string& note) {
  DynamicSparsity d = stored;
  const MaskUpdateRule rule = parse_mask_update_rule(o.dynamic);
  if (given(o.rule_option) && rule != d.rule) {
    note += std::string(", --dynamic replaces its ") + to_string(d.rule);
    d.rule = rule;
  }
  if (given(o.update_every_option) && o.update_every != d.update_every) {
    note += ", --update-every replaces its " + std::to_string(d.update_every);
    d.update_every = o.update_every;
  }
  if (given(o.drop_option) && o.drop != d.drop) {
    note += ", --drop replaces its " + json_number(d.drop);
    d.drop = o.drop;
  }
  if (given(o.update_until_option) && o.update_until != d.update_until) {
    note += ", --update-until replaces its " + json_number(d.update_until);
    d.update_until = o.update_until;
  }
  if (given(o.horizon_option) || given(o.horizon_steps_option)) {
    const std::int64_t steps = horizon_steps(o, steps_per_epoch);
    if (steps != d.total_steps) {
      note += std::string(", ") + horizon_flag(o) + " replaces its horizon of " +
              std::to_string(d.total_steps) + " steps";
      d.total_steps = steps;
    }
  }
  return d;
}

}  // namespace

void add_schedule_options(CLI::App& cmd, ScheduleOptions& o) {
  o.rule_option = cmd.add_option("--dynamic", o.dynamic,
                                 "Masks that change while training: none, set (grow random "
                                 "positions) or rigl (grow where |dense gradient| is largest)")
                      ->check(CLI::IsMember({"none", "set", "rigl"}));
  o.update_every_option =
      cmd.add_option("--update-every", o.update_every, "Steps between mask updates (--dynamic)")
          ->check(number_range(std::int64_t{1}, std::int64_t{1} << 40));
  o.drop_option =
      cmd.add_option("--drop", o.drop,
                     "Fraction of each layer's weights swapped per update, decayed by a cosine "
                     "(--dynamic)")
          ->check(number_range(0.0, 1.0));
  o.update_until_option =
      cmd.add_option("--update-until", o.update_until,
                     "Fraction of the horizon after which the masks stay fixed (--dynamic)")
          ->check(number_range(0.0, 1.0));
  o.horizon_option =
      cmd.add_option("--horizon-epochs", o.horizon_epochs,
                     "The schedule's horizon in epochs from the model's start, for a run that "
                     "will be resumed (default: where this run ends; kept on resume) (--dynamic)")
          ->check(number_range(std::int64_t{1}, std::int64_t{1} << 40));
  o.horizon_steps_option =
      cmd.add_option("--horizon-steps", o.horizon_steps,
                     "The schedule's horizon in steps from the model's start (as "
                     "--horizon-epochs; the GPT's, which trains by steps) (--dynamic)")
          ->check(number_range(std::int64_t{1}, std::int64_t{1} << 53));
}

void check_schedule_options(const ScheduleOptions& o, bool may_resume) {
  if (!(o.drop > 0)) throw UsageError("--drop must be in (0, 1]: a fraction of the weights");
  if (given(o.horizon_option) && given(o.horizon_steps_option)) {
    throw UsageError("--horizon-epochs and --horizon-steps cannot both be given");
  }
  // Without --dynamic, a resumed run's stored rule decides whether the others mean anything.
  if (may_resume && !given(o.rule_option)) return;
  refuse_options_without_rule(o, parse_mask_update_rule(o.dynamic));
}

DynamicSparsity resolve_schedule(ModelMemory& memory, const ScheduleOptions& o, bool resuming,
                                 std::int64_t steps_per_epoch, std::int64_t run_steps,
                                 const std::string& source, std::ostream& progress) {
  const bool keep = resuming && memory.dynamic.rule != MaskUpdateRule::none;
  DynamicSparsity d;
  std::string note = source;
  if (keep) {
    d = replace_given(memory.dynamic, o, steps_per_epoch, note);
  } else {
    d.rule = parse_mask_update_rule(o.dynamic);
    d.update_every = o.update_every;
    d.drop = o.drop;
    d.update_until = o.update_until;
    d.seed = memory.seed;
    d.total_steps = given(o.horizon_option) || given(o.horizon_steps_option)
                        ? horizon_steps(o, steps_per_epoch)
                        : memory.step() + run_steps;
    note = "new";
  }
  refuse_options_without_rule(o, d.rule);
  d.validate();
  if (resuming && d.rule != MaskUpdateRule::none) {
    progress << "dynamic sparsity " << to_string(d.rule) << ": every " << d.update_every
             << " steps, drop " << json_number(d.drop) << " until " << json_number(d.update_until)
             << " of a horizon of " << d.total_steps << " steps from the model's start (" << note
             << ")";
    if (memory.step() + run_steps > d.total_steps) {
      const double end = d.update_until * static_cast<double>(d.total_steps);
      progress << "; the horizon ends before this run does: the masks stay fixed after step "
               << static_cast<std::int64_t>(end)
               << " (--horizon-epochs or --horizon-steps moves the horizon)";
    }
    progress << "\n";
  }
  memory.dynamic = d;
  return d;
}

}  // namespace sluice::cli
