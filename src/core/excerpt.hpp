#pragma once
// How an error message shows a piece of its input: quoted, at most ~40 characters (a bad
// "number" may be a megabyte cell or a binary blob), cut with "…" at a character boundary,
// control bytes and NUL shown as \xNN (a raw NUL would cut the message where it is printed).
#include <cstddef>
#include <string>
#include <string_view>

namespace sluice::detail {

/// 'text', or its first `max` bytes (whole UTF-8 characters) and "…", escaped.
std::string excerpt(std::string_view text, std::size_t max = 40);

/// `message` with every word (a run without spaces) longer than 256 bytes (no path or
/// number is) cut to 40 as excerpt cuts, and control bytes escaped: the last guard for
/// messages that echo their input whole (CLI11's do).
std::string shorten_words(std::string_view message);

}  // namespace sluice::detail
