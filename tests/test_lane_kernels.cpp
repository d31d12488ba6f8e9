// The by-input backward kernel of every ISA, called directly against a float64 reference:
// both gradients, each alone, every GradientSums mode, any token count, dY in fp32 or
// held in bf16, and nothing written past a row's tokens. (The engine's tests run it
// through whole products.)
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/kernels/lane_kernels.hpp"
#include "sluice/bf16.hpp"
#include "sluice/isa.hpp"

namespace sluice::detail {
namespace {

constexpr float kSentinel = 12345.0F;
constexpr std::int64_t kPad = 9;  // floats past each row's tokens, never to be written

/// Runs of packets (value, tag) with every run length the kernels treat apart: empty, one
/// packet, fewer than a step of eight, exactly eight, longer with a tail, and long enough
/// for the one-token gathers (from 128 packets, in steps of 32 and then 16).
template <typename PacketT>
struct RunsData {
  std::vector<PacketT> packets;
  std::vector<std::uint32_t> begin, end;
  std::int64_t tags = 0;

  RunsData(std::int64_t tag_count, std::mt19937& rng) : tags(tag_count) {
    std::uniform_real_distribution<float> value(-1, 1);
    for (const std::uint32_t length : {0U, 1U, 5U, 8U, 19U, 0U, 2U, 33U, 128U, 183U}) {
      begin.push_back(static_cast<std::uint32_t>(packets.size()));
      std::uint32_t tag = rng() % 3;  // increasing tags, as in a stream
      for (std::uint32_t k = 0; k < length; ++k, tag += 1 + rng() % 3) {
        const float w = value(rng);
        if constexpr (std::is_same_v<PacketT, Packet>) {
          packets.push_back({tag % static_cast<std::uint32_t>(tags), w});
        } else {
          packets.push_back({static_cast<std::uint16_t>(tag % tags), to_bf16(w)});
        }
      }
      end.push_back(static_cast<std::uint32_t>(packets.size()));
      // A carriage return between runs, as the kernels meet them in a chunk.
      if constexpr (std::is_same_v<PacketT, Packet>) {
        packets.push_back({kCarriageReturn, 0.0F});
      } else {
        packets.push_back(bf16_control(kCarriageReturn));
      }
    }
  }
  Runs<PacketT> runs() const {
    return {packets.data(), begin.data(), end.data(), static_cast<std::int64_t>(begin.size())};
  }
};

std::vector<float> random_rows(std::int64_t rows, std::int64_t stride, std::mt19937& rng) {
  std::uniform_real_distribution<float> value(-1, 1);
  std::vector<float> m(static_cast<std::size_t>(rows * stride));
  for (float& v : m) v = value(rng);
  return m;
}

/// dY as a kernel reads it: fp32 rows as they are (Tile), or (Bf16Tile) rows packed by the
/// ISA's bf16 table, padded to whole 32-token blocks and then some; `dy` is rounded to
/// what the kernel holds, for the reference.
template <typename DyTile>
struct HeldDy {
  std::vector<std::uint16_t> bits;
  DyTile tile;

  HeldDy(Isa isa, std::vector<float>& dy, std::int64_t rows, std::int64_t stride,
         std::int64_t tokens) {
    if constexpr (std::is_same_v<DyTile, Tile>) {
      tile = {dy.data(), stride};
    } else {
      const std::int64_t padded = (tokens + kBf16RowAlign - 1) / kBf16RowAlign * kBf16RowAlign;
      const std::int64_t held_stride = padded + kBf16RowAlign;
      bits.assign(static_cast<std::size_t>(rows * held_stride), 0xFFFF);  // NaN past rows
      for (std::int64_t r = 0; r < rows; ++r) {
        float* row = dy.data() + r * stride;
        bf16_lane_kernels(isa).pack(row, bits.data() + r * held_stride, tokens, padded);
        for (std::int64_t t = 0; t < tokens; ++t) row[t] = round_to_bf16(row[t]);
      }
      tile = {bits.data(), held_stride};
    }
  }
};

template <typename PacketT, typename DyTile = Tile>
void check(Isa isa, ByInputKernel<PacketT, DyTile> kernel, std::int64_t tokens, bool data,
           bool weight) {
  constexpr bool held = std::is_same_v<DyTile, Bf16Tile>;
  SCOPED_TRACE(std::string(to_string(isa)) + (sizeof(PacketT) == 4 ? " bf16" : " fp32") +
               (held ? " dY held in bf16" : "") + " tokens=" + std::to_string(tokens) +
               (data ? " dX" : "") + (weight ? " dW" : ""));
  std::mt19937 rng(static_cast<std::uint32_t>(tokens * 7 + (data ? 1 : 0) + (weight ? 2 : 0)));
  const RunsData<PacketT> runs(/*tags=*/90, rng);
  const std::int64_t stride = tokens + kPad;
  const std::int64_t run_count = static_cast<std::int64_t>(runs.begin.size());
  std::vector<float> dy = random_rows(runs.tags, stride, rng);
  const HeldDy<DyTile> held_dy(isa, dy, runs.tags, stride, tokens);
  const std::vector<float> x = random_rows(run_count, stride, rng);
  std::vector<float> dx(static_cast<std::size_t>(run_count * stride), kSentinel);
  const std::size_t n = runs.packets.size();
  // Two calls as over two tiles: the first starts the sums in `partial`, the second adds
  // to them and sends the totals out as gradient packets.
  std::vector<float> partial(n, kSentinel);
  std::vector<Packet> out(n, Packet{0, kSentinel});
  const DyTile dy_tile = held_dy.tile;
  const Tile x_tile{weight ? x.data() : nullptr, stride};
  const MutableTile dx_tile{data ? dx.data() : nullptr, stride};
  kernel(runs.runs(), dy_tile, x_tile, dx_tile, GradientSums{partial.data(), nullptr, true},
         tokens);
  kernel(runs.runs(), dy_tile, x_tile, dx_tile, GradientSums{partial.data(), out.data(), false},
         tokens);

  for (std::int64_t r = 0; r < run_count; ++r) {
    const float* x_row = x.data() + r * stride;
    std::vector<double> sum(static_cast<std::size_t>(tokens), 0.0), scale(sum);
    for (std::uint32_t k = runs.begin[r]; k < runs.end[r]; ++k) {
      const PacketT& p = runs.packets[k];
      const float* d = dy.data() + static_cast<std::int64_t>(tag_of(p)) * stride;
      double dot = 0, dot_scale = 0;
      for (std::int64_t t = 0; t < tokens; ++t) {
        sum[t] += double(value_of(p)) * d[t];
        scale[t] += std::abs(double(value_of(p)) * d[t]);
        dot += double(x_row[t]) * d[t];
        dot_scale += std::abs(double(x_row[t]) * d[t]);
      }
      if (weight) {
        // Two tiles of the same tokens: the total is twice the dot.
        ASSERT_EQ(out[k].tag, tag_of(p)) << "run " << r << ", packet " << k;
        EXPECT_NEAR(out[k].value, 2 * dot, 2e-5 * dot_scale + 1e-30) << "run " << r << ", k " << k;
      }
    }
    const float* row = dx.data() + r * stride;
    for (std::int64_t t = 0; t < tokens && data; ++t) {
      EXPECT_NEAR(row[t], sum[t], 1e-5 * scale[t] + 1e-30) << "run " << r << ", token " << t;
    }
    for (std::int64_t t = data ? tokens : 0; t < stride; ++t) {
      ASSERT_EQ(row[t], kSentinel) << "run " << r << ": written at token " << t;
    }
  }
  // Packets that are not weights (carriage returns) keep their slots untouched.
  for (std::size_t k = 0; k < n; ++k) {
    if (is_control(runs.packets[k]) || !weight) {
      EXPECT_EQ(out[k].value, kSentinel) << "packet " << k;
      EXPECT_EQ(partial[k], kSentinel) << "packet " << k;
    }
  }
}

class LaneKernelsByIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam())) GTEST_SKIP() << "this CPU cannot run " << to_string(GetParam());
  }
};

TEST_P(LaneKernelsByIsa, ByInputMatchesReference) {
  for (const std::int64_t tokens : {1, 3, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129}) {
    for (const auto& [data, weight] : {std::pair{true, true}, {true, false}, {false, true}}) {
      check<Packet>(GetParam(), by_input_kernels(GetParam()).fp32, tokens, data, weight);
      check<Bf16Packet>(GetParam(), by_input_kernels(GetParam()).bf16, tokens, data, weight);
      check<Bf16Packet, Bf16Tile>(GetParam(), by_input_kernels(GetParam()).bf16_held, tokens, data,
                                  weight);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, LaneKernelsByIsa,
                         ::testing::Values(Isa::scalar, Isa::avx2, Isa::avx512),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace sluice::detail
