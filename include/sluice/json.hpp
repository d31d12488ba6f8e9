#pragma once
// A minimal JSON writer for machine-readable output (`--json` of the CLI, calibration
// fits). It only writes: strings are escaped, doubles are printed in their shortest
// form that reads back to the same value, and NaN or infinity become null (JSON has no
// spelling for them). Misuse (a value where a key is due, unbalanced brackets) throws
// ShapeError, so a half-built document is never mistaken for a whole one.
#include <concepts>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace sluice {

/// `text` as a JSON string literal, quotes included. UTF-8 passes through unchanged;
/// quotes, backslashes and control characters are escaped.
std::string json_quote(std::string_view text);

/// Shortest decimal form of `value` that parses back to the same double ("0.1", "1e-09",
/// "3"); "null" for NaN and infinities. Also handy for CSV cells.
std::string json_number(double value);

class JsonWriter {
 public:
  /// `indent` spaces per level; 0 writes everything on one line.
  explicit JsonWriter(int indent = 0);

  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  /// The next member's name; only inside an object, and must be followed by a value.
  JsonWriter& key(std::string_view name);

  JsonWriter& value(std::string_view text);
  JsonWriter& value(const char* text) { return value(std::string_view(text)); }
  JsonWriter& value(const std::string& text) { return value(std::string_view(text)); }
  JsonWriter& value(double number);
  JsonWriter& value(float number) { return value(static_cast<double>(number)); }
  JsonWriter& value(bool flag);
  /// Integers of any width, printed exactly.
  template <std::integral T>
  requires(!std::same_as<T, bool>) JsonWriter& value(T number) {
    if constexpr (std::is_signed_v<T>) {
      return write_integer(static_cast<long long>(number));
    } else {
      return write_unsigned(static_cast<unsigned long long>(number));
    }
  }
  JsonWriter& null();

  /// key(name).value(v) in one call.
  template <typename T>
  JsonWriter& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

  /// True once exactly one complete top-level value has been written.
  bool complete() const;
  /// The document; ShapeError unless complete().
  std::string str() const;

 private:
  enum class Scope { kObject, kArray };
  JsonWriter& write_integer(long long number);
  JsonWriter& write_unsigned(unsigned long long number);
  JsonWriter& write_raw(std::string_view token);
  void before_value();
  void newline();

  struct Level {
    Scope scope;
    bool empty = true;
  };
  std::string out_;
  std::vector<Level> stack_;
  int indent_ = 0;
  bool expecting_value_after_key_ = false;
  bool has_root_ = false;
};

}  // namespace sluice
