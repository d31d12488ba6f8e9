#pragma once
// Reading an input file whole (a text corpus, a matrix, path costs, a data set): in chunks,
// and never past a bound, so that a device or a pipe that never ends (/dev/zero) is refused
// instead of read until memory runs out. Internal.
#include <cstdint>
#include <filesystem>
#include <string>

namespace sluice::detail {

/// The most bytes one input is read to: a quarter of the memory this process can have
/// (what is read is held in RAM beside what is built from it).
std::uint64_t max_input_bytes();

/// ResourceError: `path` holds more than `limit` bytes, the most read of one input here.
[[noreturn]] void throw_input_too_large(const std::filesystem::path& path, std::uint64_t limit);

/// Appends the file's bytes to `text`, which may grow to `limit` bytes: IoError naming the
/// path if it cannot be opened or read, throw_input_too_large past the limit (a regular
/// file's size is checked before it is read).
void append_file_bytes(const std::filesystem::path& path, std::string& text, std::uint64_t limit);

/// The file's bytes, at most `limit` of them (as append_file_bytes).
std::string read_file_bytes(const std::filesystem::path& path,
                            std::uint64_t limit = max_input_bytes());

/// As append_file_bytes, the file's bytes decompressed when it is gzip'd (any other file is
/// read as it is); FormatError naming the path if its gzip stream is corrupt.
void append_maybe_gzipped_bytes(const std::filesystem::path& path, std::string& text,
                                std::uint64_t limit);
/// The same into a string of its own.
std::string read_maybe_gzipped_bytes(const std::filesystem::path& path,
                                     std::uint64_t limit = max_input_bytes());

}  // namespace sluice::detail
