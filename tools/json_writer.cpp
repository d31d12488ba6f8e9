#include "json_writer.hpp"

#include <charconv>
#include <cmath>
#include <stdexcept>
#include <system_error>

namespace sluice::cli {

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  if (value == 0) return "0";  // also turns -0 into 0
  char buffer[32];
  // Without a format argument to_chars gives the shortest round-trip representation.
  const auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  if (result.ec != std::errc()) throw std::logic_error("json_number: cannot format a double");
  return std::string(buffer, result.ptr);
}

JsonWriter& JsonWriter::key(std::string_view name) {
  if (stack_.empty() || !stack_.back()->is_object()) {
    throw std::logic_error("JsonWriter: key(\"" + std::string(name) + "\") outside an object");
  }
  if (has_key_) {
    throw std::logic_error("JsonWriter: key(\"" + std::string(name) +
                           "\") after a key with no value");
  }
  pending_key_ = name;
  has_key_ = true;
  return *this;
}

nlohmann::ordered_json& JsonWriter::slot() {
  if (stack_.empty()) {
    if (has_root_) throw std::logic_error("JsonWriter: a second top-level value");
    has_root_ = true;
    return root_;
  }
  nlohmann::ordered_json& top = *stack_.back();
  if (top.is_array()) {
    top.push_back(nullptr);
    return top.back();
  }
  if (!has_key_) throw std::logic_error("JsonWriter: a value inside an object needs key() first");
  has_key_ = false;
  // A repeated key would silently replace the earlier value: refused instead.
  if (top.contains(pending_key_)) {
    throw std::logic_error("JsonWriter: key \"" + pending_key_ + "\" written twice");
  }
  return top[pending_key_];
}

JsonWriter& JsonWriter::put(nlohmann::ordered_json v) {
  slot() = std::move(v);
  return *this;
}

JsonWriter& JsonWriter::open(nlohmann::ordered_json container) {
  nlohmann::ordered_json& at = slot();
  at = std::move(container);
  stack_.push_back(&at);
  return *this;
}

JsonWriter& JsonWriter::close(bool object) {
  if (stack_.empty() || stack_.back()->is_object() != object) {
    throw std::logic_error(std::string("JsonWriter: ") + (object ? "end_object" : "end_array") +
                           "() without its begin");
  }
  if (has_key_) throw std::logic_error("JsonWriter: end_object() right after a key");
  stack_.pop_back();
  return *this;
}

std::string JsonWriter::str() const {
  if (!complete()) {
    throw std::logic_error("JsonWriter: document incomplete (" + std::to_string(stack_.size()) +
                           " open brackets" + (has_root_ ? "" : ", nothing written") + ")");
  }
  return root_.dump(indent_, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace sluice::cli
