// libFuzzer target: the command line. The input is an argument vector (arguments separated
// by NUL bytes) given to `sluice` as run_cli parses and checks it, without running the
// command (no file read or written, no work): whatever the arguments, no crash, no
// exception past the exit-code mapping, and an exit code of 0, 1 or 2.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cli.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args = {"sluice"};
  std::string current;
  for (std::size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(current);
      current.clear();
    } else {
      current.push_back(static_cast<char>(data[i]));
    }
  }
  if (!current.empty()) args.push_back(current);
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  const int code =
      sluice::cli::run_cli(static_cast<int>(args.size()), argv.data(), sluice::cli::CliMode::check);
  if (code != 0 && code != 1 && code != 2) std::abort();
  return 0;
}
