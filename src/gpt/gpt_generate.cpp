// Sampling text from a GptModel, a byte at a time.
#include <algorithm>
#include <cmath>
#include <string>

#include "core/splitmix.hpp"
#include "sluice/error.hpp"
#include "sluice/gpt.hpp"

namespace sluice {

std::string generate_text(GptModel& model, std::string_view prompt, std::int64_t bytes,
                          double temperature, std::uint64_t seed) {
  if (bytes < 0) throw ArgumentError("generate: " + std::to_string(bytes) + " bytes");
  if (!(temperature >= 0) || !std::isfinite(temperature)) {
    throw ArgumentError("generate: temperature " + std::to_string(temperature) +
                        " is not a finite number >= 0");
  }
  std::vector<std::int32_t> tokens;
  for (const char c : prompt) tokens.push_back(static_cast<unsigned char>(c));
  // An empty prompt starts after a newline, as the corpus' texts do.
  if (tokens.empty()) tokens.push_back('\n');
  std::string out;
  std::uint64_t state = seed;
  for (std::int64_t i = 0; i < bytes; ++i) {
    const std::vector<float> logits = model.next_logits(tokens);
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    std::int64_t chosen = best;
    if (temperature > 0) {
      // Softmax in double from the largest logit, then one uniform draw (splitmix64, so the
      // same seed gives the same text on every platform).
      std::vector<double> p(logits.size());
      double sum = 0;
      for (std::size_t o = 0; o < logits.size(); ++o) {
        p[o] = std::exp((logits[o] - logits[static_cast<std::size_t>(best)]) / temperature);
        sum += p[o];
      }
      state = detail::splitmix64(state);
      double u = static_cast<double>(state >> 11) * 0x1.0p-53 * sum;
      chosen = static_cast<std::int64_t>(logits.size()) - 1;
      for (std::size_t o = 0; o < p.size(); ++o) {
        if (u < p[o]) {
          chosen = static_cast<std::int64_t>(o);
          break;
        }
        u -= p[o];
      }
    }
    tokens.push_back(static_cast<std::int32_t>(chosen));
    out.push_back(static_cast<char>(chosen));
  }
  return out;
}

}  // namespace sluice
