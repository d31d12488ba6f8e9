#pragma once
// The `sluice` command line: each subcommand lives in its own file and registers
// itself here. A command returns its exit code; it throws UsageError for bad
// arguments (exit 2) and sluice::Error for bad data (exit 1).
#include <CLI/CLI.hpp>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace sluice::cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What runs a subcommand once its arguments are parsed: `check` (may be empty) refuses
/// arguments that do not go together, touching no file and doing no work, then `run` does
/// the work and returns the exit code. The fuzz target of the command line calls only
/// `check`.
struct Command {
  std::function<int()> run;
  std::function<void()> check;

  Command() = default;
  template <typename Run>
  requires std::is_invocable_r_v<int, Run> Command(Run r)
      : run(std::move(r)) {}  // NOLINT: a command without checks of its own
  Command(std::function<void()> c, std::function<int()> r)
      : run(std::move(r)), check(std::move(c)) {}
};

/// Each adds its subcommand to `app` and returns what runs it.
Command add_spmm_command(CLI::App& app);
Command add_predict_command(CLI::App& app);
Command add_train_command(CLI::App& app);
Command add_sweep_command(CLI::App& app);
Command add_generate_command(CLI::App& app);

}  // namespace sluice::cli
