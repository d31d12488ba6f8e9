#pragma once
// The `sluice` command line as a function: parse the arguments, check them, run the
// command, and map what went wrong to an exit code (2 bad arguments, 1 bad data or a failed
// check). main() calls it; the fuzz target calls it without running anything.
namespace sluice::cli {

enum class CliMode {
  run,    ///< parse, check and run the command
  check,  ///< parse and check only: no file read or written, no work done
};

/// The exit code of `sluice argv[1] ...` (argv[0] is the program).
int run_cli(int argc, const char* const* argv, CliMode mode = CliMode::run);

}  // namespace sluice::cli
