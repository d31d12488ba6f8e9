#pragma once
// The engine's two paths on one CPU, in both precisions (docs/dense_path.md): what a
// product costs streamed sparse and what it costs densified and multiplied by the dense
// kernel, and so which is faster for a layer. The engine asks it per layer
// (ProductPath::automatic); `sluice sweep` fits it to measured runs and prints the
// crossover sparsity.
//
//     sparse(layer) = nnz * (sparse_per_nnz[precision]
//                            + tokens * sparse_per_nnz_token[precision]) / threads
//     dense(layer)  = (outputs * inputs * (tokens * dense_per_mac[precision]
//                                          + densify_per_slot[precision])
//                      + nnz * densify_per_packet[precision]) / threads
//
// The sparse term is the streamed product's AXPY cost and what taking in each packet costs
// whatever the batch (sluice/layer_cost_model.hpp has the product's finer model); the dense
// term is the dense kernel, writing every slot of the dense tiles, and taking in and
// scattering each packet. The crossover density is (tokens * dense_per_mac +
// densify_per_slot) / (sparse_per_nnz + tokens * sparse_per_nnz_token -
// densify_per_packet).
//
// Its constants depend on the CPU: built-in ones were fitted on two (measured_with), and a
// file `sluice sweep --path both --save-path-costs FILE` writes holds one machine's own,
// which for_this_cpu() takes when SLUICE_PATH_COSTS names it.
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>

#include "sluice/bf16.hpp"
#include "sluice/product_path.hpp"

namespace sluice {

/// What multiplies bf16 on a CPU, which sets the dense kernel's rate in bf16.
enum class Bf16Unit { none, avx512_bf16, amx };

struct PathCosts {
  /// Seconds per non-zero and token on the sparse path, per thread: [fp32, bf16].
  std::array<double, 2> sparse_per_nnz_token{};
  /// Seconds per non-zero on the sparse path whatever the batch, per thread.
  std::array<double, 2> sparse_per_nnz{};
  /// Seconds per multiply-add of the dense kernel, per thread: [fp32, bf16].
  std::array<double, 2> dense_per_mac{};
  /// Seconds per weight slot of the dense tiles (zeroing them, and what the tiled matmul
  /// loses to the whole one), per thread: [fp32, bf16].
  std::array<double, 2> densify_per_slot{};
  /// Seconds per packet taken in, checked and scattered into a tile, per thread.
  std::array<double, 2> densify_per_packet{};

  /// The constants fitted on a CPU with this unit (docs/dense_path.md): with AMX, those of
  /// an AMX Xeon; with AVX512-BF16 alone, those of a Zen 5; with neither, the Xeon's fp32
  /// terms, bf16's dense product at fp32's rate (oneDNN emulates bf16 there).
  static PathCosts measured_with(Bf16Unit unit);
  /// This CPU's: measured_with(its unit), under the terms of the file SLUICE_PATH_COSTS
  /// names when it is set. Read once per process; a file that cannot be read or is not a
  /// path-cost file throws (IoError or FormatError naming it) on every call.
  static PathCosts for_this_cpu();
  /// The bf16 unit oneDNN finds on this CPU.
  static Bf16Unit this_cpus_bf16_unit();
  /// Where for_this_cpu()'s constants come from, for reports: "SLUICE_PATH_COSTS=FILE", or
  /// "built in, AMX" (or "AVX512-BF16", "no bf16 unit").
  static std::string this_cpus_origin();

  /// `base` with the terms of each precision `file` holds. IoError when it cannot be read,
  /// FormatError naming the file and the key when it is not what to_json() writes.
  static PathCosts read(const std::filesystem::path& file, const PathCosts& base);
  /// Both precisions' terms as JSON, the form read() takes.
  std::string to_json() const;

  double sparse_seconds(double nnz, std::int64_t tokens, Precision precision,
                        std::int32_t threads) const;
  double dense_seconds(std::int64_t outputs, std::int64_t inputs, double nnz, std::int64_t tokens,
                       Precision precision, std::int32_t threads) const;
  /// The faster path for the layer (sparse on a tie).
  ProductPath choose(std::int64_t outputs, std::int64_t inputs, double nnz, std::int64_t tokens,
                     Precision precision, std::int32_t threads) const;
  /// The sparsity above which the sparse path is faster (0 when it always is, 1 when
  /// never).
  double crossover_sparsity(std::int64_t tokens, Precision precision) const;
};

}  // namespace sluice
