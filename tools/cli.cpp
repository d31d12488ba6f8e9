// The `sluice` command line as a function (tools/cli.hpp).
#include "cli.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "core/excerpt.hpp"
#include "interrupt.hpp"
#include "number_options.hpp"
#include "sluice/error.hpp"

namespace {
// A message that echoes an argument or a cell whole (CLI11's do) is cut to a line.
std::string shorten(const char* message) {
  return sluice::detail::shorten_words(message);
}

/// CLI11's words for a flag given twice or without its value, said plainly.
std::string plain(const std::string& message) {
  static const std::regex twice("^(--[A-Za-z0-9-]+): At Most 1 required but received ([0-9]+)$");
  static const std::regex bare("^(--[A-Za-z0-9-]+): 1 required (.+) missing$");
  std::smatch m;
  if (std::regex_match(message, m, twice)) {
    return m[1].str() + " is given " + m[2].str() + " times: give it once";
  }
  if (std::regex_match(message, m, bare)) return m[1].str() + " needs a value: " + m[2].str();
  return message;
}

/// `code`, unless what the command wrote on stdout did not all reach it (a full disk, a
/// closed file): then 1, said on stderr, so that a script does not take a lost result for
/// a good one.
int with_output_written(int code) {
  std::cout.flush();
  if (std::cout && std::fflush(stdout) == 0 && !std::ferror(stdout)) return code;
  const int error = errno;
  std::cerr << "sluice: could not write the output"
            << (error != 0 ? std::string(": ") + std::strerror(error) : std::string()) << "\n";
  return code == 0 ? 1 : code;
}
}  // namespace

namespace sluice::cli {

int run_cli(int argc, const char* const* argv, CliMode mode) {
  CLI::App app{"sluice: sparse neural-network layers by weight streaming"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, Command>> commands;
  auto add = [&](Command (*adder)(CLI::App&)) {
    const auto before = app.get_subcommands({}).size();
    Command run = adder(app);
    commands.emplace_back(app.get_subcommands({}).at(before), std::move(run));
  };
  add(add_spmm_command);
  add(add_predict_command);
  add(add_train_command);
  add(add_sweep_command);
  add(add_generate_command);
  strict_integer_options(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // CLI11 calls a mistyped command a missing one; name it and what there is instead.
    if (argc > 1 && argv[1][0] != '-' && app.get_subcommands().empty()) {
      std::cerr << "sluice: unknown command " << sluice::detail::excerpt(argv[1])
                << "; the commands are";
      for (const auto& [sub, run] : commands) std::cerr << " " << sub->get_name();
      std::cerr << " (sluice --help)\n";
      return 2;
    }
    if (argc == 1) {  // `sluice` alone: what there is (the list of commands is short)
      std::cerr << app.help();
      return 2;
    }
    // A pointer to the help, not the help: a command's is longer than a terminal, and the
    // message would scroll out of sight above it.
    std::string help = "sluice --help";
    for (const CLI::App* sub : app.get_subcommands())
      help = "sluice " + sub->get_name() + " --help";
    std::cerr << "sluice: " << plain(shorten(e.what())) << "\n(" << help << " lists the options)\n";
    return 2;
  }
  try {
    for (auto& [sub, run] : commands) {
      if (!sub->parsed()) continue;
      if (run.check) run.check();
      return mode == CliMode::run ? with_output_written(run.run()) : 0;
    }
    return 2;
  } catch (const Interrupted& e) {
    std::cerr << "sluice: " << shorten(e.what()) << "\n";
    return interrupted_exit_code();
  } catch (const UsageError& e) {
    std::cerr << "sluice: " << shorten(e.what()) << "\n";
    return 2;
  } catch (const sluice::ArgumentError& e) {  // shapes too
    std::cerr << "sluice: " << shorten(e.what()) << "\n";
    return 2;
  } catch (const sluice::UnsupportedError& e) {  // asked of this machine or build
    std::cerr << "sluice: " << shorten(e.what()) << "\n";
    return 2;
  } catch (const sluice::Error& e) {
    std::cerr << "sluice: " << shorten(e.what()) << "\n";
    return 1;
  } catch (const std::bad_alloc&) {
    std::cerr << "sluice: out of memory (the sizes asked for need more than this machine "
                 "can give)\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "sluice: internal error: " << shorten(e.what()) << "\n";
    return 1;
  }
}

}  // namespace sluice::cli
