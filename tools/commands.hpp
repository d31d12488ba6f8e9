#pragma once
// The `sluice` command line: each subcommand lives in its own file and registers
// itself here. A command returns its exit code; it throws UsageError for bad
// arguments (exit 2) and sluice::Error for bad data (exit 1).
#include <CLI/CLI.hpp>
#include <functional>
#include <stdexcept>
#include <string>

namespace sluice::cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Command = std::function<int()>;

/// Each adds its subcommand to `app` and returns what runs it.
Command add_spmm_command(CLI::App& app);
Command add_predict_command(CLI::App& app);
Command add_train_command(CLI::App& app);
Command add_sweep_command(CLI::App& app);
Command add_generate_command(CLI::App& app);

}  // namespace sluice::cli
