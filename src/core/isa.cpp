#include "sluice/isa.hpp"

#include <cstdlib>

#include "core/enum_names.hpp"
#include "core/isa_choice.hpp"
#include "sluice/error.hpp"

namespace sluice {

constexpr detail::EnumName<Isa> kIsaNames[] = {
    {Isa::scalar, "scalar"}, {Isa::avx2, "avx2"}, {Isa::avx512, "avx512"}};

SLUICE_ENUM_NAMES(Isa, kIsaNames, parse_isa, "ISA")

bool cpu_supports(Isa isa) {
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
  switch (isa) {
    case Isa::scalar:
      return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
  }
  return false;
}

Isa detected_isa() {
  static const Isa detected = [] {
    if (cpu_supports(Isa::avx512)) return Isa::avx512;
    if (cpu_supports(Isa::avx2)) return Isa::avx2;
    return Isa::scalar;
  }();
  return detected;
}

Isa default_isa() {
  const Isa best = detected_isa();
  const char* cap = std::getenv("SLUICE_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  const Isa wanted = parse_isa(cap);
  return wanted < best ? wanted : best;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> isas;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (cpu_supports(isa)) isas.push_back(isa);
  }
  return isas;
}

namespace detail {

bool cpu_supports_avx512_vbmi2() {
  return __builtin_cpu_supports("avx512vbmi2");
}

}  // namespace detail

}  // namespace sluice
