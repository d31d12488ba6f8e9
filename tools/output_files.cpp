#include "output_files.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "commands.hpp"
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

namespace {

fs::path temporary_name(const fs::path& path) {
  return path.string() + ".tmp." + std::to_string(::getpid());
}

// Writes `content` to `path` (created or truncated); IoError, and nothing left, on failure.
void write_whole(const fs::path& path, const std::string& content) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) throw IoError("cannot create " + path.string() + ": " + std::strerror(errno));
  file << content;
  file.close();
  if (!file) {
    std::error_code ignored;
    fs::remove(path, ignored);
    throw IoError("cannot write " + path.string());
  }
}

}  // namespace

bool replaceable(const fs::path& path) {
  std::error_code ec;
  return !fs::exists(path, ec) || fs::is_regular_file(path, ec);
}

void write_atomically(const fs::path& path, const std::string& content) {
  write_all_atomically({{path, content}});
}

void write_all_atomically(const std::vector<std::pair<fs::path, std::string>>& files) {
  // What would make a rename fail once others are done is refused before writing any.
  for (const auto& file : files) {
    std::error_code ec;
    if (fs::is_directory(file.first, ec)) {
      throw IoError("cannot write " + file.first.string() + ": a directory has that name");
    }
    if (!replaceable(file.first)) {
      throw IoError("cannot write " + file.first.string() +
                    ": it is not a file (a device or pipe), which writing would replace");
    }
  }
  std::vector<fs::path> written;
  auto remove_written = [&written] {
    std::error_code ignored;
    for (const auto& tmp : written) fs::remove(tmp, ignored);
  };
  try {
    for (const auto& [path, content] : files) {
      write_whole(temporary_name(path), content);
      written.push_back(temporary_name(path));
    }
  } catch (...) {
    remove_written();
    throw;
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::error_code ec;
    fs::rename(written[i], files[i].first, ec);
    if (ec) {
      written.erase(written.begin(), written.begin() + static_cast<long>(i));
      remove_written();
      throw IoError("cannot rename " + temporary_name(files[i].first).string() + " to " +
                    files[i].first.string() + ": " + ec.message());
    }
  }
}

CLI::Validator path_argument() {
  return CLI::Validator(
      [](std::string& path) -> std::string {
        if (path.empty()) return "an empty path (is a shell variable unset?)";
        for (const char c : path) {
          const auto byte = static_cast<unsigned char>(c);
          if (byte < 0x20 || byte == 0x7f) {
            return "the path has a control character (byte " + std::to_string(byte) + ")";
          }
        }
        return {};
      },
      "PATH");
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
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      throw UsageError("a path or title for gnuplot has a control character (byte " +
                       std::to_string(byte) + ")");
    }
    out += (c == '\'') ? std::string("''") : std::string(1, c);
  }
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
    for (const auto& f : files) {
      if (replaceable(f.final_path)) fs::remove(f.final_path, ignored);
    }
    std::cerr << who << ": gnuplot not on PATH; the CSV files are written, the plots are not\n";
    return false;
  }
  // Written in place (not through write_atomically): it is a temporary file already.
  const fs::path script_path = dir / ("plot.gp.tmp." + std::to_string(::getpid()));
  write_whole(script_path, script);
  const std::string command = "gnuplot " + shell_quote(script_path.string()) + " 1>&2";
  const int status = std::system(command.c_str());
  fs::remove(script_path, ignored);
  bool made = status == 0;
  for (const auto& f : files) {
    if (!replaceable(f.final_path)) {
      std::cerr << who << ": " << f.final_path.string()
                << " is not a file (a device or pipe); the plot is not put there\n";
      fs::remove(f.tmp_path, ignored);
      made = false;
    } else if (status == 0 && fs::exists(f.tmp_path, ignored)) {
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
