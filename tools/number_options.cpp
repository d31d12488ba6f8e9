#include "number_options.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "core/available_memory.hpp"
#include "core/excerpt.hpp"

namespace sluice::cli {
namespace {

// Whole numbers in full (a batch bound of 2^24 read as 1.67772e+07), others as %g.
std::string compact(double value) {
  char text[32];
  if (value == std::floor(value) && std::abs(value) < 1e18) {
    std::snprintf(text, sizeof text, "%.0f", value);
  } else {
    std::snprintf(text, sizeof text, "%.6g", value);
  }
  return text;
}

bool parse_number(const std::string& text, double& value) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  return !text.empty() && ec == std::errc() && ptr == end && std::isfinite(value);
}

CLI::Validator bounded(double low, bool low_open, double high, const std::string& range) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double value = 0;
        if (!parse_number(text, value) || (low_open ? value <= low : value < low) || value > high) {
          return detail::excerpt(text) + " is not a number " + range;
        }
        return {};
      },
      "NUMBER " + range);
}

// Digits only (after one '-' where allowed), within what the type holds.
CLI::Validator strict_integer(bool is_signed) {
  return CLI::Validator(
      [is_signed](std::string& text) -> std::string {
        const bool negative = is_signed && !text.empty() && text[0] == '-';
        const std::string digits = negative ? text.substr(1) : text;
        if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) {
          return detail::excerpt(text) + " is not a whole number (decimal digits only)";
        }
        const char* end = text.data() + text.size();
        std::errc ec{};
        if (is_signed) {
          std::int64_t v = 0;
          ec = std::from_chars(text.data(), end, v).ec;
        } else {
          std::uint64_t v = 0;
          ec = std::from_chars(text.data(), end, v).ec;
        }
        if (ec != std::errc()) return detail::excerpt(text) + " does not fit in 64 bits";
        return {};
      },
      "", "strict_integer");
}

void harden(CLI::App& app) {
  for (CLI::Option* option : app.get_options()) {
    // The type's name, then ":" and each validator's description.
    const std::string type = option->get_type_name();
    const std::string base = type.substr(0, type.find(':'));
    if (base == "INT" || base == "UINT") option->transform(strict_integer(base == "INT"));
  }
  for (CLI::App* sub : app.get_subcommands({})) harden(*sub);
}

}  // namespace

CLI::Validator number_range(double low, double high) {
  return bounded(low, false, high, "in [" + compact(low) + ", " + compact(high) + "]");
}

CLI::Validator non_negative_number() {
  return bounded(0, false, std::numeric_limits<double>::max(), ">= 0");
}

CLI::Validator positive_number() {
  return bounded(0, true, std::numeric_limits<double>::max(), "> 0");
}

CLI::Validator within_available_memory() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0;
        const detail::MemoryLimit limit = detail::available_memory();
        if (!parse_number(text, value) || limit.bytes == 0 ||
            value <= static_cast<double>(limit.bytes)) {
          return {};  // the number's own checks speak for a malformed one
        }
        return detail::bytes_text(value) + " is more than the " +
               detail::bytes_text(static_cast<double>(limit.bytes)) + " of " + limit.source +
               " this process can have";
      },
      "", "within_available_memory");
}

void strict_integer_options(CLI::App& app) {
  harden(app);
}

}  // namespace sluice::cli
