#include "measure.hpp"

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
    throw UsageError("--shape must be OUTxIN with positive sizes below 2^31, got '" + text + "'");
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
      throw UsageError("sparsity must be a number in [0, 1), got '" + item + "'");
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

void require_dense_baseline_memory(std::int64_t outputs, std::int64_t inputs, bool with_gradient) {
  const double bytes =
      4.0 * static_cast<double>(outputs) * static_cast<double>(inputs) * (with_gradient ? 2 : 1);
  const double physical =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (physical > 0 && bytes > physical) {
    char text[200];
    std::snprintf(text, sizeof text,
                  "the dense baseline of a %lldx%lld layer needs %.1f GB, more than this "
                  "machine's %.1f GB of memory",
                  static_cast<long long>(outputs), static_cast<long long>(inputs), bytes * 1e-9,
                  physical * 1e-9);
    throw UsageError(text);
  }
}

}  // namespace sluice::cli
