// libFuzzer target: the CSV data-set reader (plain or gzip'd) must refuse anything
// malformed with a sluice::Error, and whatever it accepts must be a usable data set:
// finite features, one label per sample, every label below the class count.
#include <cmath>

#include "fuzz_input_file.hpp"
#include "sluice/dataset.hpp"
#include "sluice/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = sluice::fuzz::input_file(data, size, ".csv");
  try {
    const sluice::Dataset d = sluice::load_csv(path);
    if (d.features.rows() < 1 || d.samples() < 1 ||
        d.labels.size() != static_cast<std::size_t>(d.samples())) {
      __builtin_trap();
    }
    for (const int label : d.labels) {
      if (label < 0 || label >= d.classes) __builtin_trap();
    }
    for (std::int64_t f = 0; f < d.features.rows(); ++f) {
      for (std::int64_t s = 0; s < d.samples(); ++s) {
        if (!std::isfinite(d.features(f, s))) __builtin_trap();
      }
    }
  } catch (const sluice::Error&) {
  }
  return 0;
}
