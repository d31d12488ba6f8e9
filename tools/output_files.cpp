#include "output_files.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "sluice/error.hpp"

namespace sluice::cli {

namespace fs = std::filesystem;

void create_output_directory(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw IoError("cannot create output directory " + dir.string() +
                  (ec ? ": " + ec.message() : std::string(": not a directory")));
}

void write_atomically(const fs::path& path, const std::string& content) {
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    if (!file) throw IoError("cannot create " + tmp.string() + ": " + std::strerror(errno));
    file << content;
    file.close();
    if (!file) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      throw IoError("cannot write " + tmp.string());
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw IoError("cannot rename " + tmp.string() + " to " + path.string() + ": " + ec.message());
  }
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (!path) return false;
  std::stringstream dirs(path);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) dir = ".";
    const fs::path candidate = fs::path(dir) / program;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0) return true;
  }
  return false;
}

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string gnuplot_quote(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += (c == '\'') ? std::string("''") : std::string(1, c);
  return out + "'";
}

PlotFile plot_file(const fs::path& dir, const std::string& name) {
  return {dir / name, dir / (name + ".tmp." + std::to_string(::getpid()))};
}

bool run_gnuplot(const std::string& script, const fs::path& dir, const std::vector<PlotFile>& files,
                 const std::string& who) {
  std::error_code ignored;
  if (!on_path("gnuplot")) {
    // A plot of an earlier run must not sit beside this run's data as if it were its own.
    for (const auto& f : files) fs::remove(f.final_path, ignored);
    std::cerr << who << ": gnuplot not on PATH; the CSV files are written, the plots are not\n";
    return false;
  }
  const fs::path script_path = dir / ("plot.gp.tmp." + std::to_string(::getpid()));
  write_atomically(script_path, script);
  const std::string command = "gnuplot " + shell_quote(script_path.string()) + " 1>&2";
  const int status = std::system(command.c_str());
  fs::remove(script_path, ignored);
  bool made = status == 0;
  for (const auto& f : files) {
    if (status == 0 && fs::exists(f.tmp_path, ignored)) {
      std::error_code ec;
      fs::rename(f.tmp_path, f.final_path, ec);
      if (ec) {
        std::cerr << who << ": cannot rename " << f.tmp_path << ": " << ec.message() << "\n";
        made = false;
      }
    } else {
      fs::remove(f.tmp_path, ignored);
      fs::remove(f.final_path, ignored);  // an earlier run's plot
      made = false;
    }
  }
  if (status != 0)
    std::cerr << who << ": gnuplot failed (status " << status
              << "); the CSV files are written, the plots are not\n";
  return made;
}

}  // namespace sluice::cli
