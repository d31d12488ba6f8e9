#include "sluice/wafer_system.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cost_model/cost_model_checks.hpp"
#include "sluice/error.hpp"

namespace sluice {

using detail::check_shape;
using detail::check_sparsity;

namespace {
std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

WaferSystem WaferSystem::wse2() {
  WaferSystem s;
  s.name = "wse2";
  s.cores = {850000, "cores", "seed 002: 850,000 independently programmable cores"};
  s.fp_units = {3.4e6, "FPUs", "seed 002: 3.4 million floating point units (4 per core)"};
  s.clock_hz = {1.1e9, "Hz",
                "assumption: ~1.1 GHz, the commonly quoted WSE clock (Cerebras publishes none); "
                "the seed's 5.8 PFLOP/s over 3.4M FPUs implies 0.85 GHz"};
  s.fp32_fmac_per_core_cycle = {
      1, "FMAC/core/cycle",
      "assumption: one fp32 AXPY lane-op per core per cycle; this gives only 1.87 PFLOP/s, so "
      "the model uses the token-lane rate derived from the published peak instead"};
  s.peak_flops = {5.8e15, "FLOP/s", "seed 002: raw throughput 5.8 PFLOP/s (dense baseline)"};
  s.partial_sum_cycles = {4, "cycles/output/core",
                          "seed 002: copy 1 + reset accumulator 1 + double-wide add on the "
                          "partial-sum chain 2"};
  s.engine_rows = {922, "rows", "assumption: square grid, round(sqrt(850,000)) = 922"};
  s.engine_columns = {922, "columns", "assumption: square grid, round(sqrt(850,000)) = 922"};
  s.memory_bytes = {40e9, "B", "seed 002: 40 GB on-chip memory"};
  s.memory_bandwidth = {20e15, "B/s", "seed 002: 20 PB/s memory bandwidth"};
  s.fabric_bandwidth = {28e15, "B/s", "seed 002: 28 PB/s on-wafer fabric (220 Pb/s)"};
  s.memoryx_bandwidth = {4e12, "B/s", "seed 002: MemoryX model memory bandwidth 4 TB/s"};
  s.engine_io_bandwidth = {150e9, "B/s",
                           "CS-2 system I/O 1.2 Tb/s (12 x 100 GbE), Cerebras product material; "
                           "not in the seed: the SwarmX link into each engine"};
  s.swarmx_hop_latency = {5e-6, "s",
                          "assumption: a few microseconds per SwarmX tree level (switch and "
                          "store-and-forward of a chunk)"};
  s.weight_packet_bytes = {4, "B/non-zero",
                           "seed 002: 38-bit fabric messages; taken as 16-bit value + 16-bit "
                           "index"};
  s.gradient_bytes = {2, "B/non-zero",
                      "assumption: 16-bit gradients, position implied by stream order"};
  s.optimizer_bytes_per_weight = {32, "B/non-zero/step",
                                  "seed 002: Adam keeps four fp32 values per parameter; MemoryX "
                                  "reads and writes them each step"};
  return s;
}

std::vector<std::pair<std::string, SourcedValue>> WaferSystem::parameters() const {
  return {{"cores", cores},
          {"fp_units", fp_units},
          {"clock_hz", clock_hz},
          {"fp32_fmac_per_core_cycle", fp32_fmac_per_core_cycle},
          {"peak_flops", peak_flops},
          {"partial_sum_cycles", partial_sum_cycles},
          {"engine_rows", engine_rows},
          {"engine_columns", engine_columns},
          {"memory_bytes", memory_bytes},
          {"memory_bandwidth", memory_bandwidth},
          {"fabric_bandwidth", fabric_bandwidth},
          {"memoryx_bandwidth", memoryx_bandwidth},
          {"engine_io_bandwidth", engine_io_bandwidth},
          {"swarmx_hop_latency", swarmx_hop_latency},
          {"weight_packet_bytes", weight_packet_bytes},
          {"gradient_bytes", gradient_bytes},
          {"optimizer_bytes_per_weight", optimizer_bytes_per_weight}};
}

double WaferSystem::token_lanes_per_core_cycle() const {
  return peak_flops.value / (2 * cores.value * clock_hz.value);
}
double WaferSystem::fp32_scalar_peak_flops() const {
  return 2 * cores.value * clock_hz.value * fp32_fmac_per_core_cycle.value;
}
double WaferSystem::fpu_peak_flops() const {
  return 2 * fp_units.value * clock_hz.value;
}
double WaferSystem::clock_for_peak_from_fpus() const {
  return peak_flops.value / (2 * fp_units.value);
}
double WaferSystem::memory_bytes_per_core() const {
  return memory_bytes.value / cores.value;
}

CostModel WaferSystem::cost_model() const {
  if (!(cores.value > 0 && clock_hz.value > 0 && peak_flops.value > 0 && engine_rows.value >= 1 &&
        engine_columns.value >= 1))
    throw ArgumentError("wafer system " + name + ": cores, clock, peak and grid must be positive");
  CostConstants c;
  c.axpy_fixed = 0;
  c.axpy_per_token = 1.0 / (token_lanes_per_core_cycle() * clock_hz.value);
  c.partial_sum_fixed = partial_sum_cycles.value / clock_hz.value;
  c.partial_sum_per_token = 0;
  c.layer_fixed = (3 * engine_rows.value + engine_columns.value) / clock_hz.value;
  c.dense_flops = peak_flops.value;
  return CostModel(c);
}

Geometry WaferSystem::geometry_for(std::int64_t inputs, std::int64_t tokens) const {
  if (inputs < 1 || tokens < 1)
    throw ArgumentError("wafer geometry: inputs and tokens must be >= 1");
  const auto rows = static_cast<std::int64_t>(engine_rows.value);
  // The busiest row cannot hold fewer than ceil(inputs / rows) features; use the fewest
  // rows that achieve that, and give the remaining cores to more token columns (a logical
  // P x Q grid over all cores, folded onto the physical one). This avoids rows holding 2
  // features next to rows holding 1 (e.g. 1024 features on 922 rows).
  const std::int64_t features_per_row = ceil_div(inputs, rows);
  const std::int64_t lanes = ceil_div(inputs, features_per_row);
  const auto columns =
      static_cast<std::int64_t>(std::floor(cores.value / static_cast<double>(lanes)));
  Geometry g;
  g.lanes = static_cast<std::int32_t>(lanes);
  g.blocks = static_cast<std::int32_t>(std::max<std::int64_t>(1, std::min(tokens, columns)));
  g.tile_tokens = 0;
  return g;
}

double WaferSystem::nnz_per_engine_row(std::int64_t outputs, std::int64_t inputs,
                                       double sparsity) const {
  check_shape(outputs, inputs, 1, "nnz per engine row");
  check_sparsity(sparsity, "nnz per engine row");
  const double rows = geometry_for(inputs, 1).lanes;
  return static_cast<double>(outputs) * static_cast<double>(inputs) * (1 - sparsity) / rows;
}

}  // namespace sluice
