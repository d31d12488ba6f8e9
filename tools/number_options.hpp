#pragma once
// Numbers on the command line, read strictly and reported briefly: an integer flag takes
// decimal digits only (no "12abc", "0x10", "1e3" or a value that wraps past its type), and
// a range is printed as [0, 4096] or [0, 1.8e+308], never as 300 digits of DBL_MAX.
#include <CLI/CLI.hpp>

namespace sluice::cli {

/// A number in [low, high] (as CLI::Range, with a compact message).
CLI::Validator number_range(double low, double high);
/// A number >= 0 / > 0 (as CLI::NonNegativeNumber / CLI::PositiveNumber).
CLI::Validator non_negative_number();
CLI::Validator positive_number();

/// A byte budget no larger than the memory this process can have (physical memory, the
/// cgroup's limit, RLIMIT_AS): a budget above it promises what cannot be kept.
CLI::Validator within_available_memory();

/// Every integer option of `app` and its subcommands takes decimal digits only (a '-'
/// only where the type is signed), refusing a value its type cannot hold. Called once the
/// commands have added their options.
void strict_integer_options(CLI::App& app);

}  // namespace sluice::cli
