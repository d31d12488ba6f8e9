// Placeholder until the vector kernel lands: the scalar reference.
#include "kernels/lane_kernels.hpp"

namespace sluice::detail {

void by_input_avx512(const LaneRuns& runs, Tile dy, Tile x, MutableTile dx, const GradientSums& sums,
                   std::int64_t tokens) {
  by_input_scalar(runs, dy, x, dx, sums, tokens);
}
void by_input_avx512(const Bf16LaneRuns& runs, Tile dy, Tile x, MutableTile dx,
                   const GradientSums& sums, std::int64_t tokens) {
  by_input_scalar(runs, dy, x, dx, sums, tokens);
}

}  // namespace sluice::detail
