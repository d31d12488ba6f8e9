#include "sluice/bf16.hpp"

#include "core/enum_names.hpp"
#include "sluice/error.hpp"

namespace sluice {

constexpr detail::EnumName<Precision> kPrecisionNames[] = {{Precision::fp32, "fp32"},
                                                           {Precision::bf16, "bf16"}};

const char* to_string(Precision precision) {
  return detail::name_of(kPrecisionNames, precision);
}

Precision parse_precision(const std::string& name) {
  return detail::parse_name(kPrecisionNames, name, "precision");
}

}  // namespace sluice
