#pragma once
// Instruction-set selection for the kernels: detected once from the CPU, capped by the
// environment variable SLUICE_ISA=scalar|avx2|avx512 (so the slower paths can be tested
// on a faster machine), and overridable per engine.
#include <string>
#include <vector>

namespace sluice {

enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

const char* to_string(Isa isa);
/// Parses "scalar", "avx2" or "avx512"; throws ArgumentError otherwise.
Isa parse_isa(const std::string& name);

/// The best ISA this CPU (and OS) supports.
Isa detected_isa();
/// detected_isa() capped by SLUICE_ISA, if set (an unknown value throws).
Isa default_isa();
/// Every ISA this CPU can run, scalar first (what the tests iterate over).
std::vector<Isa> supported_isas();
bool cpu_supports(Isa isa);

}  // namespace sluice
