#include "terminal_text.hpp"

#include <cstddef>

namespace sluice::cli {
namespace {

bool is_continuation(unsigned char b) {
  return (b & 0xC0) == 0x80;
}

/// The length of the valid UTF-8 sequence at `s[i]` (1 to 4), or 0 if none starts there
/// (a stray continuation, an overlong form, a surrogate, beyond U+10FFFF, or cut short).
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto at = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char b = at(0);
  if (b < 0x80) return 1;
  std::size_t n = 0;
  unsigned char low = 0x80, high = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) low = 0xA0;   // no overlong forms
    if (b == 0xED) high = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) low = 0x90;
    if (b == 0xF4) high = 0x8F;  // nothing beyond U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size() || at(1) < low || at(1) > high) return 0;
  for (std::size_t k = 2; k < n; ++k) {
    if (!is_continuation(at(k))) return 0;
  }
  return n;
}

void append_hex(std::string& out, unsigned char b) {
  constexpr char kDigits[] = "0123456789abcdef";
  out += "\\x";
  out += kDigits[b >> 4];
  out += kDigits[b & 0xF];
}

}  // namespace

std::string escape_for_terminal(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    const std::size_t n = utf8_length(bytes, i);
    const bool c0 = n == 1 && ((b < 0x20 && b != '\n' && b != '\t') || b == 0x7F);
    const bool c1 = n == 2 && b == 0xC2 && static_cast<unsigned char>(bytes[i + 1]) < 0xA0;
    if (n == 0 || c0 || c1) {
      for (std::size_t k = 0; k < (n == 0 ? 1 : n); ++k) {
        append_hex(out, static_cast<unsigned char>(bytes[i + k]));
      }
      i += n == 0 ? 1 : n;
    } else {
      out.append(bytes.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace sluice::cli
