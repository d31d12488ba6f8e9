#pragma once
// The examples' one command-line helper: a count typed by a user, read strictly.
#include <charconv>
#include <cstring>
#include <system_error>

/// `text` as a whole number (digits only, nothing after them), `fallback` where it is
/// absent, else -1: each example's usage check refuses it with exit code 2.
inline int count_arg(const char* text, int fallback) {
  if (text == nullptr) return fallback;
  int value = -1;
  const char* end = text + std::strlen(text);
  const auto [stop, error] = std::from_chars(text, end, value);
  return error == std::errc{} && stop == end ? value : -1;
}
