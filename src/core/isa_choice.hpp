#pragma once
// Choosing one of a kernel's implementations by ISA, in one place: every kernel table and
// function pointer the library picks at run time is picked here.
#include "sluice/isa.hpp"

namespace sluice::detail {

/// The one of an ISA's implementations `isa` names (pointers to tables or functions).
template <typename T>
constexpr T for_isa(Isa isa, T scalar, T avx2, T avx512) {
  return isa == Isa::avx512 ? avx512 : isa == Isa::avx2 ? avx2 : scalar;
}

/// Whether the CPU has AVX-512 VBMI2 (byte and word compress/expand), which one AVX-512
/// kernel uses beyond the set Isa::avx512 requires. Asked here, as every CPU feature is.
bool cpu_supports_avx512_vbmi2();

}  // namespace sluice::detail
