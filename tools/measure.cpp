#include "measure.hpp"

#include "core/available_memory.hpp"
#include "core/excerpt.hpp"
#include "sluice/path_cost.hpp"

#include <oneapi/tbb/task_arena.h>
#include <sys/resource.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace sluice::cli {

std::pair<std::int64_t, std::int64_t> parse_shape(const std::string& text) {
  const auto x = text.find('x');
  std::int64_t a = 0, b = 0;
  const char* s = text.data();
  const char* e = s + text.size();
  if (x == std::string::npos || std::from_chars(s, s + x, a).ptr != s + x ||
      std::from_chars(s + x + 1, e, b).ptr != e || a <= 0 || b <= 0 || a >= (1LL << 31) ||
      b >= (1LL << 31)) {
    throw UsageError("--shape must be OUTxIN with positive sizes below 2^31, got " +
                     detail::excerpt(text));
  }
  return {a, b};
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::size_t begin = 0;
  for (std::size_t comma; (comma = text.find(',', begin)) != std::string::npos; begin = comma + 1) {
    items.push_back(text.substr(begin, comma - begin));
  }
  if (!text.empty()) items.push_back(text.substr(begin));
  return items;
}

std::vector<double> parse_sparsities(const std::string& text) {
  std::vector<double> out;
  for (const std::string& item : split_list(text)) {
    double v = 0;
    const char* s = item.data();
    const char* e = s + item.size();
    if (item.empty() || std::from_chars(s, e, v).ptr != e || !std::isfinite(v) || v < 0 || v >= 1) {
      throw UsageError("sparsity must be a number in [0, 1), got " + detail::excerpt(item));
    }
    out.push_back(v);
  }
  if (out.empty()) throw UsageError("no sparsity given");
  return out;
}

std::int64_t peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

int runnable_threads(int requested, const char* command) {
  const int available = tbb::this_task_arena::max_concurrency();
  if (requested <= available) return requested;
  std::fprintf(stderr, "sluice %s: --threads %d, but this process can run %d at once; using %d\n",
               command, requested, available, available);
  return available;
}

void require_dense_baseline_memory(std::int64_t outputs, std::int64_t inputs, bool with_gradient,
                                   std::int64_t tokens, double nnz, bool dense_path) {
  const double out = static_cast<double>(outputs), in = static_cast<double>(inputs);
  const double gradient = with_gradient ? 2 : 1;
  // Bytes per element of X and Y that sluice spmm's peak RSS showed beside W (X and Y in
  // fp32, the baseline's and the products' copies; the dense path packs X; a backward adds
  // dY, dX and theirs): about what a wide and a tall layer took. A run that needs all but a
  // little of the memory is refused too: it would be killed for it.
  const double per_activation = with_gradient ? (dense_path ? 22 : 14) : (dense_path ? 8 : 6);
  // W with its zeros (and dW), W's non-zeros as values and indices in the matrix and again
  // in the engine's stream.
  const double bytes = 4.0 * out * in * gradient + 16.0 * nnz +
                       per_activation * static_cast<double>(tokens) * (out + in);
  const detail::MemoryLimit limit = detail::available_memory();
  if (limit.bytes > 0 && bytes > static_cast<double>(limit.bytes)) {
    char text[300];
    std::snprintf(text, sizeof text,
                  "the dense baseline of a %lldx%lld layer needs %.1f GB (with W's non-zeros, X "
                  "and Y at %lld tokens%s), more than the %.1f GB of %s this process can have",
                  static_cast<long long>(outputs), static_cast<long long>(inputs), bytes * 1e-9,
                  static_cast<long long>(tokens), dense_path ? ", on the dense path" : "",
                  static_cast<double>(limit.bytes) * 1e-9, limit.source);
    throw UsageError(text);
  }
}

bool takes_dense_path(ProductPath path, std::int64_t outputs, std::int64_t inputs, double nnz,
                      std::int64_t tokens, Precision precision, int threads) {
  if (path != ProductPath::automatic) return path == ProductPath::dense;
  const int t = threads > 0 ? threads : tbb::this_task_arena::max_concurrency();
  return PathCosts::for_this_cpu().choose(outputs, inputs, nnz, tokens, precision, t) ==
         ProductPath::dense;
}

void check_geometry_bounds(const Geometry& g, std::int64_t inputs, std::int64_t tokens,
                           int threads) {
  const std::int64_t t = threads > 0 ? threads : tbb::this_task_arena::max_concurrency();
  auto bound = [](const char* flag, std::int32_t value, std::int64_t most, const std::string& why) {
    if (value > most) {
      throw UsageError(std::string(flag) + " " + std::to_string(value) + ": at most " +
                       std::to_string(most) + " here (" + why + ")");
    }
  };
  const std::string threads_text = std::to_string(t) + " threads";
  bound("--lanes", g.lanes, std::min<std::int64_t>(inputs, t),
        "lanes split the " + std::to_string(inputs) + " inputs among " + threads_text);
  bound("--blocks", g.blocks, std::min<std::int64_t>(tokens, t),
        "blocks split the " + std::to_string(tokens) + " tokens among " + threads_text);
  bound("--shares", g.shares, t, "shares split the stream among " + threads_text);
}

}  // namespace sluice::cli
