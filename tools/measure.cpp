#include "measure.hpp"

#include <sys/resource.h>

#include <charconv>
#include <cmath>
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

std::vector<double> parse_sparsities(const std::string& text) {
  std::vector<double> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
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

}  // namespace sluice::cli
