#pragma once
// The wafer-scale system's published parameters (WaferSystem::wse2), with their sources,
// and the layer cost model they give (sluice/layer_cost_model.hpp).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sluice/layer_cost_model.hpp"

namespace sluice {

/// A parameter with its unit and where the number comes from.
struct SourcedValue {
  double value = 0;
  std::string unit;
  std::string source;
};

/// The published parameters of a wafer-scale engine and its cluster (wse2()). The
/// acceleration model on it:
///   * geometry: input features over engine rows, tokens over engine columns, one pass.
///     P is the fewest rows (<= engine_rows) that keep the busiest row at its minimum of
///     ceil(inputs / engine_rows) features, Q = cores / P (the logical grid is folded onto
///     the physical one when P < engine_rows), so the whole wafer is busy;
///   * a1 = 1 / (token_lanes_per_core_cycle * clock): the token-lane FMAC rate per core is
///     derived from the published 5.8 PFLOP/s, so the engine running every weight (dense)
///     is exactly the dense baseline;
///   * b0 = partial_sum_cycles / clock (four cycles per output per core, seed 002);
///   * a0 = b1 = 0 (packet handling and the hand-off are pipelined in hardware);
///   * c_layer = (3 * rows + columns) / clock: the stream crosses the wafer once and the
///     last output's partial sum drains round a ring of rows at two cycles per hop.
/// Saturation is then dense / (4 n_out cycles) = inputs * T_q / (4 * rows * lane-ops),
/// i.e. inputs * tokens / (4 * cores * token_lanes_per_core_cycle): independent of the
/// P x Q split, proportional to the tokens each engine holds.
struct WaferSystem {
  std::string name;
  SourcedValue cores;
  SourcedValue fp_units;
  SourcedValue clock_hz;
  SourcedValue fp32_fmac_per_core_cycle;
  SourcedValue peak_flops;
  SourcedValue partial_sum_cycles;
  SourcedValue engine_rows;
  SourcedValue engine_columns;
  SourcedValue memory_bytes;
  SourcedValue memory_bandwidth;
  SourcedValue fabric_bandwidth;
  SourcedValue memoryx_bandwidth;
  SourcedValue engine_io_bandwidth;
  SourcedValue swarmx_hop_latency;
  SourcedValue weight_packet_bytes;
  SourcedValue gradient_bytes;
  SourcedValue optimizer_bytes_per_weight;

  /// Cerebras WSE-2 / CS-2 with MemoryX and SwarmX, from seed 002 plus stated assumptions.
  static WaferSystem wse2();

  /// Every parameter as (name, value) in declaration order: the documented table.
  std::vector<std::pair<std::string, SourcedValue>> parameters() const;

  // -- derived quantities ---------------------------------------------------------------
  /// peak / (2 * cores * clock): FMACs on token lanes per core per cycle needed for the
  /// published peak (3.10 for WSE-2 at 1.1 GHz).
  double token_lanes_per_core_cycle() const;
  /// 2 * cores * clock * fp32 FMACs per core per cycle (1.87 PFLOP/s for WSE-2).
  double fp32_scalar_peak_flops() const;
  /// 2 * floating point units * clock (7.48 PFLOP/s for WSE-2 at 1.1 GHz).
  double fpu_peak_flops() const;
  /// The clock at which every floating point unit doing one FMAC per cycle gives the
  /// published peak (853 MHz for WSE-2).
  double clock_for_peak_from_fpus() const;
  double memory_bytes_per_core() const;

  /// The engine's cost constants (see the struct comment).
  CostModel cost_model() const;
  /// Features over rows, tokens over columns, one pass (see the struct comment).
  Geometry geometry_for(std::int64_t inputs, std::int64_t tokens) const;
  /// Mean non-zeros sent to each engine row (of geometry_for's P) for a layer of
  /// uniform sparsity.
  double nnz_per_engine_row(std::int64_t outputs, std::int64_t inputs, double sparsity) const;
};

}  // namespace sluice
