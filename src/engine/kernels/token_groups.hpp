#pragma once
// How the bf16 kernels walk a token tile. Internal, ISA-neutral.
#include <algorithm>
#include <cstdint>
#include <utility>

namespace sluice::detail {

/// Runs `kernel.template operator()<NV>(t0, width)` over [0, tokens) in groups of at most
/// `kGroup` tokens, NV = the group's blocks of `kBlock` tokens (1 to kGroup / kBlock), so
/// each group's register count is a compile-time constant.
template <std::int64_t kGroup, std::int64_t kBlock, typename Kernel>
void for_each_group(std::int64_t tokens, Kernel&& kernel) {
  static_assert(kGroup % kBlock == 0);
  constexpr int kMaxBlocks = static_cast<int>(kGroup / kBlock);
  for (std::int64_t t0 = 0; t0 < tokens; t0 += kGroup) {
    const std::int64_t width = std::min(kGroup, tokens - t0);
    const auto blocks = static_cast<int>((width + kBlock - 1) / kBlock);
    [&]<int... N>(std::integer_sequence<int, N...>) {
      (void)((blocks == N + 1 ? (kernel.template operator()<N + 1>(t0, width), true) : false) ||
             ...);
    }
    (std::make_integer_sequence<int, kMaxBlocks>{});
  }
}

}  // namespace sluice::detail
