#pragma once
// Output files of the subcommands: whole-or-nothing writes, and PNG plots through gnuplot
// when it is installed (the CSV next to a plot is always written first).
#include <CLI/CLI.hpp>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace sluice::cli {

/// Creates `dir` (and its parents) unless it exists; IoError when it cannot be a directory.
void create_output_directory(const std::filesystem::path& dir);

/// Whether an output may be renamed over `path` (or removed as an earlier run's): nothing
/// is there, or a file. A pipe or a device (as root, /dev/null) would be replaced.
bool replaceable(const std::filesystem::path& path);

/// Writes `content` to `path` through a temporary file and a rename, so a reader never
/// sees a partial file. IoError (and no file left behind) when that fails.
void write_atomically(const std::filesystem::path& path, const std::string& content);

/// Writes every (path, content) through temporary files, renamed into place only once all
/// are written: a run that fails part-way leaves none of its files (and the files of an
/// earlier run as they were). IoError naming the file when that fails.
void write_all_atomically(const std::vector<std::pair<std::filesystem::path, std::string>>& files);

/// A validator for an option naming a file: refuses an empty path (an unset shell
/// variable) and control characters (a newline would end a line of a plot script).
CLI::Validator path_argument();

/// True when `program` is an executable file in a directory of $PATH.
bool on_path(const std::string& program);

/// `text` quoted for /bin/sh.
std::string shell_quote(const std::string& text);
/// `text` as a gnuplot single-quoted string (a quote is escaped by doubling it). A control
/// character (a newline would end the command and start another) is a UsageError.
std::string gnuplot_quote(const std::string& text);

/// A plot gnuplot draws into `tmp_path`; it is renamed to `final_path` only on success.
struct PlotFile {
  std::filesystem::path final_path;
  std::filesystem::path tmp_path;
};
/// dir/name, drawn first into dir/name.tmp.<pid>.
PlotFile plot_file(const std::filesystem::path& dir, const std::string& name);

/// Runs gnuplot on `script` (which must `set output` to each file's tmp_path) and renames
/// the plots into place when gnuplot succeeded; otherwise (or with no gnuplot on PATH)
/// removes them and any earlier plots of the same names, and tells stderr, prefixed by
/// `who` ("sluice predict"). Returns whether the plots were made.
bool run_gnuplot(const std::string& script, const std::filesystem::path& dir,
                 const std::vector<PlotFile>& files, const std::string& who);

}  // namespace sluice::cli
