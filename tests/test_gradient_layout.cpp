// The layout of a summed gradient chunk (MpiFabric's rank 0): every ISA's kernel against
// a plain loop, on odd lengths, outputs at every alignment, control packets anywhere.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "engine/kernels/gradient_layout.hpp"
#include "sluice/isa.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

struct Case {
  std::vector<Packet> fp32;
  std::vector<Bf16Packet> bf16;  // the same packets as a bf16 stream
  std::vector<float> values;     // one per weight packet, exactly
};

// `n` packets, each a control packet with probability `controls` (carriage returns and,
// now and then, an end-of-layer: the kernels must not care which).
Case make_case(std::size_t n, double controls, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<std::uint32_t> index(0, 65534);
  std::normal_distribution<float> value(0.0F, 1.0F);
  Case c;
  for (std::size_t k = 0; k < n; ++k) {
    if (coin(rng) < controls) {
      const std::uint32_t tag = coin(rng) < 0.1 ? kEndOfLayer : kCarriageReturn;
      c.fp32.push_back({tag, 0.0F});
      c.bf16.push_back(bf16_control(tag));
    } else {
      const std::uint32_t i = index(rng);
      const float v = value(rng);
      c.fp32.push_back({i, v});
      c.bf16.push_back({static_cast<std::uint16_t>(i), to_bf16(v)});
      c.values.push_back(value(rng));  // the summed gradient, unrelated to the weight
    }
  }
  return c;
}

template <typename PacketT>
std::vector<Packet> reference(const std::vector<PacketT>& sent, const std::vector<float>& values) {
  std::vector<Packet> out;
  std::size_t v = 0;
  for (const PacketT& p : sent) {
    out.push_back(is_control(p) ? Packet{tag_of(p), 0.0F} : Packet{tag_of(p), values[v++]});
  }
  return out;
}

class GradientLayoutTest : public testing::ByIsa {};

// Runs `lay_out` into a buffer whose first packet is `offset` packets past a 64-byte
// boundary, with guard packets on both sides, and compares bit for bit.
template <typename PacketT, typename Fn>
void expect_laid_out(Fn lay_out, const std::vector<PacketT>& sent, const std::vector<float>& values,
                     std::size_t offset, bool streaming, const std::string& what) {
  const std::vector<Packet> want = reference(sent, values);
  constexpr Packet kGuard{0xDEAD'BEEFU, -7.0F};
  const std::size_t n = sent.size();
  std::vector<Packet> storage(n + offset + 24, kGuard);
  auto* base = storage.data();
  while (reinterpret_cast<std::uintptr_t>(base) % 64 != 0) ++base;  // at most 7 packets on
  Packet* out = base + offset;
  lay_out(sent.data(), n, values.data(), out, streaming);
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < n; ++k) {
    if (std::memcmp(&out[k], &want[k], sizeof(Packet)) != 0) ++wrong;
  }
  EXPECT_EQ(wrong, 0U) << what;
  for (Packet* g = storage.data(); g < out; ++g) {
    EXPECT_EQ(g->tag, kGuard.tag) << what << ": wrote before the output";
  }
  for (Packet* g = out + n; g < storage.data() + storage.size(); ++g) {
    EXPECT_EQ(g->tag, kGuard.tag) << what << ": wrote past the output";
  }
}

TEST_P(GradientLayoutTest, MatchesAPlainLoop) {
  const detail::GradientLayout& layout = detail::gradient_layout(GetParam());
  std::uint64_t seed = 1;
  for (const std::size_t n : {0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 1001}) {
    for (const double controls : {0.0, 0.05, 0.5, 1.0}) {
      const Case c = make_case(n, controls, seed++);
      for (std::size_t offset = 0; offset < 8; ++offset) {
        for (const bool streaming : {false, true}) {
          const std::string what = "n " + std::to_string(n) + ", controls " +
                                   std::to_string(controls) + ", offset " + std::to_string(offset) +
                                   (streaming ? ", streaming" : "");
          expect_laid_out(layout.fp32, c.fp32, c.values, offset, streaming, "fp32, " + what);
          expect_laid_out(layout.bf16, c.bf16, c.values, offset, streaming, "bf16, " + what);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryIsa, GradientLayoutTest, ::testing::ValuesIn(testing::kAllIsas),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace sluice
