#include "sluice/bf16.hpp"

#include "sluice/error.hpp"

namespace sluice {

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::fp32:
      return "fp32";
    case Precision::bf16:
      return "bf16";
  }
  return "unknown";
}

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "bf16") return Precision::bf16;
  throw ShapeError("unknown precision '" + name + "' (expected fp32 or bf16)");
}

}  // namespace sluice
