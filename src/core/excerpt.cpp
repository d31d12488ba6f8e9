#include "core/excerpt.hpp"

#include <cstdio>

namespace sluice::detail {
namespace {

void append_escaped(std::string& out, std::string_view text) {
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      char code[8];
      std::snprintf(code, sizeof code, "\\x%02x", byte);
      out += code;
    } else {
      out += c;
    }
  }
}

// The longest prefix of at most `max` bytes that does not end inside a UTF-8 character.
std::string_view cut(std::string_view text, std::size_t max) {
  if (text.size() <= max) return text;
  std::size_t end = max;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end);
}

}  // namespace

std::string excerpt(std::string_view text, std::size_t max) {
  std::string out = "'";
  append_escaped(out, cut(text, max));
  out += text.size() > max ? "…'" : "'";
  return out;
}

std::string shorten_words(std::string_view message) {
  constexpr std::size_t kLongWord = 256, kShown = 40;
  std::string out;
  std::size_t start = 0;
  while (start < message.size()) {
    std::size_t end = message.find_first_of(" \n", start);
    if (end == std::string_view::npos) end = message.size();
    const std::string_view word = message.substr(start, end - start);
    append_escaped(out, word.size() > kLongWord ? cut(word, kShown) : word);
    if (word.size() > kLongWord) out += "…";
    if (end < message.size()) out += message[end];
    start = end + 1;
  }
  return out;
}

}  // namespace sluice::detail
