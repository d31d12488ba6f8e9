#pragma once
// The engine's two paths on one CPU, in both precisions (docs/dense_path.md): what a
// product costs streamed sparse and what it costs densified and multiplied by the dense
// kernel, and so which is faster for a layer. The engine asks it per layer
// (ProductPath::automatic); `sluice sweep` fits it to measured runs and prints the
// crossover sparsity.
//
//     sparse(layer) = nnz * tokens * sparse_per_nnz_token[precision] / threads
//     dense(layer)  = (outputs * inputs * (tokens * dense_per_mac[precision]
//                                          + densify_per_slot[precision])
//                      + nnz * densify_per_packet[precision]) / threads
//
// The sparse term is the streamed product's AXPY cost (sluice/layer_cost_model.hpp has its
// fixed costs, which matter only where the dense path never pays); the dense term is the
// dense kernel, writing every slot of the dense tiles, and taking in and scattering each
// packet. The crossover density is (tokens * dense_per_mac + densify_per_slot) /
// (tokens * sparse_per_nnz_token - densify_per_packet): a narrow batch never pays for
// densifying.
#include <array>
#include <cstdint>

#include "sluice/bf16.hpp"
#include "sluice/product_path.hpp"

namespace sluice {

struct PathCosts {
  /// Seconds per non-zero and token on the sparse path, per thread: [fp32, bf16].
  std::array<double, 2> sparse_per_nnz_token{};
  /// Seconds per multiply-add of the dense kernel, per thread: [fp32, bf16].
  std::array<double, 2> dense_per_mac{};
  /// Seconds per weight slot of the dense tiles (zeroing them, and what the tiled matmul
  /// loses to the whole one), per thread: [fp32, bf16].
  std::array<double, 2> densify_per_slot{};
  /// Seconds per packet taken in, checked and scattered into a tile, per thread.
  std::array<double, 2> densify_per_packet{};

  /// The costs measured on a CPU with AVX-512 (docs/performance_notes.md); bf16's dense
  /// kernel as fast as measured on AMX only where the CPU multiplies bf16 in hardware,
  /// else as fp32's.
  static PathCosts for_this_cpu();

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
