#pragma once
// An enum's names, listed once: to_string and its parse_* read the same table, so nothing
// is printed that parsing refuses, and the message for an unknown name lists them all; the
// macros at the end define both from the table, the same for every enum.
#include <cstddef>
#include <string>

#include "sluice/error.hpp"

namespace sluice::detail {

template <typename E>
struct EnumName {
  E value;
  const char* name;
};

/// The name of `value`, or "unknown" for a value outside the table.
template <typename E, std::size_t N>
const char* name_of(const EnumName<E> (&names)[N], E value) {
  for (const EnumName<E>& entry : names) {
    if (entry.value == value) return entry.name;
  }
  return "unknown";
}

/// The value named `name`; otherwise ArgumentError "unknown <what> '<name>' (expected a, b or c)".
template <typename E, std::size_t N>
E parse_name(const EnumName<E> (&names)[N], const std::string& name, const char* what) {
  std::string expected;
  for (std::size_t i = 0; i < N; ++i) {
    if (name == names[i].name) return names[i].value;
    expected += i == 0 ? "" : i + 1 == N ? " or " : ", ";
    expected += names[i].name;
  }
  throw ArgumentError(std::string("unknown ") + what + " '" + name + "' (expected " + expected +
                      ")");
}

}  // namespace sluice::detail

/// Defines `const char* to_string(E)` over NAMES, a table of EnumName<E>: where used, in the
/// namespace whose public header declares it.
#define SLUICE_ENUM_TO_STRING(E, NAMES)             \
  const char* to_string(E value) {                  \
    return ::sluice::detail::name_of(NAMES, value); \
  }

/// The same, and `E PARSE(const std::string&)`, WHAT naming the kind of name in the message
/// for an unknown one.
#define SLUICE_ENUM_NAMES(E, NAMES, PARSE, WHAT)            \
  SLUICE_ENUM_TO_STRING(E, NAMES)                           \
  E PARSE(const std::string& name) {                        \
    return ::sluice::detail::parse_name(NAMES, name, WHAT); \
  }
