// The ISA choice: detected once, capped by SLUICE_ISA, and what an engine runs when it is
// not told. tests/CMakeLists.txt also runs this file with SLUICE_ISA=avx2 and =scalar set
// by ctest, so the cap is tested as a user sets it, before the process starts.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/isa.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

// Sets SLUICE_ISA for one scope and puts back what was there.
class ScopedIsaCap {
 public:
  explicit ScopedIsaCap(const char* value) {
    if (const char* old = std::getenv("SLUICE_ISA")) old_ = old;
    if (value != nullptr) {
      setenv("SLUICE_ISA", value, 1);
    } else {
      unsetenv("SLUICE_ISA");
    }
  }
  ~ScopedIsaCap() {
    if (old_) {
      setenv("SLUICE_ISA", old_->c_str(), 1);
    } else {
      unsetenv("SLUICE_ISA");
    }
  }
  ScopedIsaCap(const ScopedIsaCap&) = delete;
  ScopedIsaCap& operator=(const ScopedIsaCap&) = delete;

 private:
  std::optional<std::string> old_;
};

Isa lower(Isa a, Isa b) {
  return a < b ? a : b;
}

// Whatever the environment this process started with (unset, or ctest's avx2/scalar runs):
// the default is the detected ISA, capped by SLUICE_ISA, and an engine runs the default.
TEST(Isa, DefaultIsTheDetectedIsaCappedByTheEnvironment) {
  const char* cap = std::getenv("SLUICE_ISA");
  const Isa want =
      cap == nullptr || *cap == '\0' ? detected_isa() : lower(parse_isa(cap), detected_isa());
  EXPECT_EQ(default_isa(), want) << "SLUICE_ISA=" << (cap != nullptr ? cap : "(unset)");
  EXPECT_TRUE(cpu_supports(default_isa()));
  EXPECT_EQ(CpuEngine().isa(), want);
  if (cap != nullptr && std::string(cap) == "scalar") EXPECT_EQ(default_isa(), Isa::scalar);
}

TEST(Isa, EveryCapIsHonouredAndNeverRaisesTheIsa) {
  for (const Isa cap : testing::kAllIsas) {
    const ScopedIsaCap scoped(to_string(cap));
    EXPECT_EQ(default_isa(), lower(cap, detected_isa())) << to_string(cap);
    EXPECT_EQ(CpuEngine().isa(), default_isa()) << to_string(cap);
  }
  const ScopedIsaCap empty("");
  EXPECT_EQ(default_isa(), detected_isa());
}

TEST(Isa, AnUnknownCapIsRefusedByName) {
  const ScopedIsaCap scoped("avx1024");
  const std::string message = testing::thrown_message<ArgumentError>([] { default_isa(); });
  EXPECT_CONTAINS(message, "avx1024");
}

TEST(Isa, DetectionIsConsistent) {
  EXPECT_TRUE(cpu_supports(Isa::scalar));
  EXPECT_TRUE(cpu_supports(detected_isa()));
  for (const Isa isa : testing::kAllIsas) {
    EXPECT_EQ(cpu_supports(isa), isa <= detected_isa()) << to_string(isa);
    EXPECT_EQ(parse_isa(to_string(isa)), isa);
  }
  const std::vector<Isa> supported = supported_isas();
  ASSERT_FALSE(supported.empty());
  EXPECT_EQ(supported.front(), Isa::scalar);
  EXPECT_EQ(supported.back(), detected_isa());
}

}  // namespace
}  // namespace sluice
