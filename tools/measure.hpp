#pragma once
// Small helpers the subcommands share: timing, shapes, number lists.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "sluice/bf16.hpp"
#include "sluice/geometry.hpp"
#include "sluice/product_path.hpp"

namespace sluice::cli {

/// Median wall time of each of `fns` over `repeats` rounds that call them in turn, after
/// one untimed warm-up round. On a machine whose speed drifts (a shared VM), ratios of
/// these medians stay meaningful where separate loops would each catch another phase.
/// With several, each timed call follows an untimed one of the same function, so it finds
/// its data in cache as in a loop of its own (as the baselines are timed): timed straight
/// after another product, a very sparse forward would pay for that product's cache misses.
inline std::vector<double> median_seconds_interleaved(const std::vector<std::function<void()>>& fns,
                                                      int repeats) {
  for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> times(fns.size());
  for (int r = 0; r < repeats; ++r) {
    for (std::size_t f = 0; f < fns.size(); ++f) {
      if (fns.size() > 1) fns[f]();
      const auto t0 = std::chrono::steady_clock::now();
      fns[f]();
      times[f].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<double> medians;
  for (auto& t : times) {
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

/// Median wall time of `repeats` calls of fn, after one untimed warm-up call.
template <typename Fn>
double median_seconds(Fn&& fn, int repeats) {
  return median_seconds_interleaved({std::function<void()>(std::forward<Fn>(fn))}, repeats)[0];
}

/// "4096x1024" -> {4096, 1024}; UsageError unless both are positive integers.
std::pair<std::int64_t, std::int64_t> parse_shape(const std::string& text);

/// "a,b,,c," -> {"a", "b", "", "c", ""}: every item of a comma-separated list, empty ones
/// included (getline would drop a trailing one), so parsers refuse "0.9," as ",0.9".
std::vector<std::string> split_list(const std::string& text);

/// "0,0.5,0.9" -> {0, 0.5, 0.9}; UsageError unless each is in [0, 1).
std::vector<double> parse_sparsities(const std::string& text);

/// Peak resident memory of this process (bytes), from getrusage.
std::int64_t peak_resident_bytes();

/// The threads a benchmark runs with: `requested` (0: all this process may use), cut to
/// what it can run at once, with a warning on stderr naming `command`. oneTBB would leave
/// the extra threads unstarted while the engine planned its blocks for them, and the
/// report would name a thread count that never ran.
int runnable_threads(int requested, const char* command);

/// UsageError unless timing an outputs x inputs layer against oneDNN's dense baseline fits
/// in the memory this process can have (physical, cgroup, RLIMIT_AS): W with its zeros
/// (and dW as large `with_gradient`), W's `nnz` non-zeros, and X and Y of `tokens` (and dY
/// and dX) with the copies the products make of them, more where the engine's dense path
/// runs (`dense_path`: it packs X). A large, very sparse layer is small for sluice but may
/// not be for oneDNN, and an allocation of tens of GB fails late or gets the process
/// killed. Called before W is generated, with the count its sparsity implies.
void require_dense_baseline_memory(std::int64_t outputs, std::int64_t inputs, bool with_gradient,
                                   std::int64_t tokens, double nnz, bool dense_path);

/// Whether an engine of `path` (auto: the cost model's choice, as CpuEngine::path_for makes
/// it) multiplies the layer on its dense path.
bool takes_dense_path(ProductPath path, std::int64_t outputs, std::int64_t inputs, double nnz,
                      std::int64_t tokens, Precision precision, int threads);

/// UsageError unless a fixed geometry (--lanes, --blocks, --shares; 0 = chosen) fits the
/// problem: lanes split the `inputs` features and each is a task, so at most
/// min(inputs, threads); blocks split the `tokens` and shares the stream among threads, so
/// at most min(tokens, threads) and threads. Beyond that a lane, block or share has nothing
/// of its own to do, and the cost of their partial sums grows with the count squared.
/// `threads` 0 means every thread this process may run.
void check_geometry_bounds(const Geometry& g, std::int64_t inputs, std::int64_t tokens,
                           int threads);

}  // namespace sluice::cli
