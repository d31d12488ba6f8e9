#include "sluice/path_cost.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "engine/dense_matmul.hpp"

namespace sluice {
namespace {
std::size_t index_of(Precision precision) {
  return precision == Precision::bf16 ? 1 : 0;
}

/// The file SLUICE_PATH_COSTS names, or null when it is unset or empty.
const char* path_costs_file() {
  const char* file = std::getenv("SLUICE_PATH_COSTS");
  return file != nullptr && *file != '\0' ? file : nullptr;
}
}  // namespace

PathCosts PathCosts::measured_with(Bf16Unit unit) {
  PathCosts c;
  if (unit == Bf16Unit::avx512_bf16) {
    // Fitted on a 2-vCPU Zen 5 (AVX512-BF16, no AMX) to `sluice sweep --path both` at
    // 16, 64 and 256 tokens (4096 x 4096, wall time on both cores), least squares on the
    // relative error (docs/performance_notes.md, "The dense path's crossover on a Zen 5").
    // At one batch size the fixed and per-token sparse terms cannot be told apart.
    c.sparse_per_nnz_token = {3.2e-11, 1.76e-11};
    c.sparse_per_nnz = {7.9e-10, 1.03e-9};
    c.dense_per_mac = {9.95e-12, 4.49e-12};
    c.densify_per_slot = {1.78e-10, 1.83e-10};
    c.densify_per_packet = {5.12e-10, 3.27e-10};
    return c;
  }
  // Fitted (as `sluice sweep --path both` fits them) to the dense path after issue #30's
  // third round and the streamed product, in process CPU time, one thread, on the AMX
  // Xeon, 4096 x 4096 x 256, two rounds pooled (docs/performance_notes.md, "The dense path
  // in wall time"); fp32's densifying per slot fitted below zero and is held at 0. The
  // sparse path's fixed term was not fitted there (one batch size).
  c.sparse_per_nnz_token = {5.85e-11, 3.66e-11};
  c.sparse_per_nnz = {0.0, 0.0};
  c.dense_per_mac = {1.54e-11, 3.47e-12};
  c.densify_per_slot = {0.0, 1.66e-10};
  c.densify_per_packet = {4.54e-10, 5.1e-10};
  if (unit == Bf16Unit::none) {
    c.dense_per_mac[1] = c.dense_per_mac[0];
    c.densify_per_slot[1] = c.densify_per_slot[0];
  }
  return c;
}

Bf16Unit PathCosts::this_cpus_bf16_unit() {
  return detail::DenseMatmul::bf16_unit();
}

std::string PathCosts::this_cpus_origin() {
  if (const char* file = path_costs_file()) return std::string("SLUICE_PATH_COSTS=") + file;
  switch (this_cpus_bf16_unit()) {
    case Bf16Unit::amx:
      return "built in, AMX";
    case Bf16Unit::avx512_bf16:
      return "built in, AVX512-BF16";
    case Bf16Unit::none:
      break;
  }
  return "built in, no bf16 unit";
}

PathCosts PathCosts::for_this_cpu() {
  // Once per process: the engine asks for every product it runs.
  static const PathCosts costs = [] {
    const PathCosts built_in = measured_with(this_cpus_bf16_unit());
    const char* file = path_costs_file();
    return file != nullptr ? read(file, built_in) : built_in;
  }();
  return costs;
}

double PathCosts::sparse_seconds(double nnz, std::int64_t tokens, Precision precision,
                                 std::int32_t threads) const {
  const std::size_t p = index_of(precision);
  return nnz * (sparse_per_nnz[p] + static_cast<double>(tokens) * sparse_per_nnz_token[p]) /
         std::max(1, threads);
}

double PathCosts::dense_seconds(std::int64_t outputs, std::int64_t inputs, double nnz,
                                std::int64_t tokens, Precision precision,
                                std::int32_t threads) const {
  const std::size_t p = index_of(precision);
  const double slots = static_cast<double>(outputs) * static_cast<double>(inputs);
  return (slots * (static_cast<double>(tokens) * dense_per_mac[p] + densify_per_slot[p]) +
          nnz * densify_per_packet[p]) /
         std::max(1, threads);
}

ProductPath PathCosts::choose(std::int64_t outputs, std::int64_t inputs, double nnz,
                              std::int64_t tokens, Precision precision,
                              std::int32_t threads) const {
  if (outputs <= 0 || inputs <= 0 || tokens <= 0) return ProductPath::sparse;
  return dense_seconds(outputs, inputs, nnz, tokens, precision, threads) <
                 sparse_seconds(nnz, tokens, precision, threads)
             ? ProductPath::dense
             : ProductPath::sparse;
}

double PathCosts::crossover_sparsity(std::int64_t tokens, Precision precision) const {
  const std::size_t p = index_of(precision);
  const double t = static_cast<double>(tokens);
  const double saved =  // per non-zero
      sparse_per_nnz[p] + t * sparse_per_nnz_token[p] - densify_per_packet[p];
  if (!(saved > 0) || tokens <= 0) return 0;
  const double density = (t * dense_per_mac[p] + densify_per_slot[p]) / saved;
  return std::clamp(1.0 - density, 0.0, 1.0);
}

}  // namespace sluice
