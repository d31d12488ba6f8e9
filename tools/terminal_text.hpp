#pragma once
// Bytes a model generated, made safe to show on a terminal: a byte-level GPT samples any of
// the 256 bytes, and a terminal acts on control bytes (ESC starts sequences that move the
// cursor, retitle the window or worse).
#include <string>
#include <string_view>

namespace sluice::cli {

/// `bytes` with every control character (C0 but newline and tab, DEL, and C1 as UTF-8) and
/// every byte that is not part of valid UTF-8 written as \xHH; the rest, valid UTF-8, as
/// it is.
std::string escape_for_terminal(std::string_view bytes);

}  // namespace sluice::cli
