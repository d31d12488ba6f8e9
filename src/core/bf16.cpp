#include "sluice/bf16.hpp"

#include "core/enum_names.hpp"
#include "sluice/error.hpp"

namespace sluice {

constexpr detail::EnumName<Precision> kPrecisionNames[] = {{Precision::fp32, "fp32"},
                                                           {Precision::bf16, "bf16"}};

SLUICE_ENUM_NAMES(Precision, kPrecisionNames, parse_precision, "precision")

}  // namespace sluice
