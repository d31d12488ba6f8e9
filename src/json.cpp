#include "sluice/json.hpp"

#include <charconv>
#include <cmath>
#include <string>
#include <system_error>

#include "sluice/error.hpp"

namespace sluice {

std::string json_quote(std::string_view text) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size() + 2);
  out.push_back('"');
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (byte < 0x20 || byte == 0x7f) {
          out += "\\u00";
          out.push_back(kHex[byte >> 4]);
          out.push_back(kHex[byte & 0xf]);
        } else {
          out.push_back(c);  // UTF-8 continuation bytes included
        }
    }
  }
  out.push_back('"');
  return out;
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  if (value == 0) return "0";  // also turns -0 into 0
  char buffer[32];
  // Without a format argument to_chars gives the shortest round-trip representation.
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  if (result.ec != std::errc()) throw Error("json_number: cannot format a double");
  return std::string(buffer, result.ptr);
}

JsonWriter::JsonWriter(int indent) : indent_(indent < 0 ? 0 : indent) {}

void JsonWriter::newline() {
  if (indent_ == 0) return;
  out_.push_back('\n');
  out_.append(stack_.size() * static_cast<std::size_t>(indent_), ' ');
}

void JsonWriter::before_value() {
  if (stack_.empty()) {
    if (has_root_) throw ShapeError("JsonWriter: a second top-level value after a complete one");
    has_root_ = true;
    return;
  }
  Level& level = stack_.back();
  if (level.scope == Scope::kObject) {
    if (!expecting_value_after_key_)
      throw ShapeError("JsonWriter: a value inside an object needs key() first");
    expecting_value_after_key_ = false;
    return;  // key() already wrote the separator
  }
  if (!level.empty) out_.push_back(',');
  level.empty = false;
  newline();
}

JsonWriter& JsonWriter::key(std::string_view name) {
  if (stack_.empty() || stack_.back().scope != Scope::kObject)
    throw ShapeError("JsonWriter: key(\"" + std::string(name) + "\") outside an object");
  if (expecting_value_after_key_)
    throw ShapeError("JsonWriter: key(\"" + std::string(name) + "\") after a key with no value");
  Level& level = stack_.back();
  if (!level.empty) out_.push_back(',');
  level.empty = false;
  newline();
  out_ += json_quote(name);
  out_ += indent_ > 0 ? ": " : ":";
  expecting_value_after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::begin_object() {
  before_value();
  out_.push_back('{');
  stack_.push_back({Scope::kObject});
  return *this;
}

JsonWriter& JsonWriter::begin_array() {
  before_value();
  out_.push_back('[');
  stack_.push_back({Scope::kArray});
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  if (stack_.empty() || stack_.back().scope != Scope::kObject)
    throw ShapeError("JsonWriter: end_object() without a matching begin_object()");
  if (expecting_value_after_key_) throw ShapeError("JsonWriter: end_object() right after a key");
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (!empty) newline();
  out_.push_back('}');
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  if (stack_.empty() || stack_.back().scope != Scope::kArray)
    throw ShapeError("JsonWriter: end_array() without a matching begin_array()");
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (!empty) newline();
  out_.push_back(']');
  return *this;
}

JsonWriter& JsonWriter::write_raw(std::string_view token) {
  before_value();
  out_ += token;
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view text) {
  return write_raw(json_quote(text));
}
JsonWriter& JsonWriter::value(double number) {
  return write_raw(json_number(number));
}
JsonWriter& JsonWriter::value(bool flag) {
  return write_raw(flag ? "true" : "false");
}
JsonWriter& JsonWriter::null() {
  return write_raw("null");
}
JsonWriter& JsonWriter::write_integer(long long number) {
  return write_raw(std::to_string(number));
}
JsonWriter& JsonWriter::write_unsigned(unsigned long long number) {
  return write_raw(std::to_string(number));
}

bool JsonWriter::complete() const {
  return has_root_ && stack_.empty();
}

std::string JsonWriter::str() const {
  if (!complete())
    throw ShapeError("JsonWriter: document incomplete (" + std::to_string(stack_.size()) +
                     " open brackets" + (has_root_ ? "" : ", nothing written") + ")");
  return out_;
}

}  // namespace sluice
