#pragma once
// The subcommands' `--json` documents, built with nlohmann::json (Debian's
// nlohmann-json3-dev) through the calls the commands make: begin_object, key, value,
// field... Members keep the order they were written in; doubles print in their shortest
// form that reads back to the same value; NaN and infinities become null (JSON has no
// spelling for them); invalid UTF-8 in a string (a file name) becomes U+FFFD rather than
// an invalid document. Misuse (a value where a key is due, unbalanced brackets) throws
// std::logic_error: a half-built document is never mistaken for a whole one.
#include <concepts>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace sluice::cli {

/// Shortest decimal form of `value` that parses back to the same double ("0.1", "1e-09",
/// "3"); "null" for NaN and infinities. Also for CSV cells and messages.
std::string json_number(double value);

class JsonWriter {
 public:
  /// `indent` spaces per level; 0 writes everything on one line.
  explicit JsonWriter(int indent = 0) : indent_(indent < 0 ? -1 : indent == 0 ? -1 : indent) {}

  JsonWriter& begin_object() { return open(nlohmann::ordered_json::object()); }
  JsonWriter& end_object() { return close(true); }
  JsonWriter& begin_array() { return open(nlohmann::ordered_json::array()); }
  JsonWriter& end_array() { return close(false); }
  /// The next member's name; only inside an object, and must be followed by a value.
  JsonWriter& key(std::string_view name);

  JsonWriter& value(std::string_view text) { return put(std::string(text)); }
  JsonWriter& value(const char* text) { return put(std::string(text)); }
  JsonWriter& value(const std::string& text) { return put(text); }
  JsonWriter& value(double number) { return put(number); }
  JsonWriter& value(float number) { return put(static_cast<double>(number)); }
  JsonWriter& value(bool flag) { return put(flag); }
  /// Integers of any width, exactly.
  template <std::integral T>
  requires(!std::same_as<T, bool>) JsonWriter& value(T number) { return put(number); }
  JsonWriter& null() { return put(nullptr); }

  /// key(name).value(v) in one call.
  template <typename T>
  JsonWriter& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

  /// True once exactly one complete top-level value has been written.
  bool complete() const { return has_root_ && stack_.empty(); }
  /// The document; std::logic_error unless complete().
  std::string str() const;

 private:
  JsonWriter& put(nlohmann::ordered_json v);
  JsonWriter& open(nlohmann::ordered_json container);
  JsonWriter& close(bool object);
  /// Where the next value goes (checks that one may go there).
  nlohmann::ordered_json& slot();

  nlohmann::ordered_json root_;
  // The open containers, innermost last. Only the innermost one grows while they are
  // open, so the pointers into its parents stay valid.
  std::vector<nlohmann::ordered_json*> stack_;
  std::string pending_key_;
  bool has_key_ = false;
  bool has_root_ = false;
  int indent_ = -1;
};

}  // namespace sluice::cli
