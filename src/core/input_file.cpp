#include "core/input_file.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "core/available_memory.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {

std::uint64_t max_input_bytes() {
  return available_memory().bytes / 4;
}

void throw_input_too_large(const std::filesystem::path& path, std::uint64_t limit) {
  throw ResourceError(path.string() + ": more than " + bytes_text(static_cast<double>(limit)) +
                      ", the most read of one input here (at most a quarter of the memory this "
                      "process can have)");
}

void append_file_bytes(const std::filesystem::path& path, std::string& text, std::uint64_t limit) {
  std::error_code no_size;  // devices and pipes have none
  const std::uintmax_t size = std::filesystem::file_size(path, no_size);
  if (!no_size && text.size() + size > limit) throw_input_too_large(path, limit);
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                             &std::fclose);
  if (!file) throw IoError("cannot open " + path.string() + ": " + std::strerror(errno));
  if (!no_size) text.reserve(text.size() + size);
  std::vector<char> chunk(std::size_t{1} << 20);
  for (;;) {
    const std::size_t got = std::fread(chunk.data(), 1, chunk.size(), file.get());
    if (text.size() + got > limit) throw_input_too_large(path, limit);
    text.append(chunk.data(), got);
    if (got < chunk.size()) break;
  }
  if (std::ferror(file.get()) != 0) {
    throw IoError("cannot read " + path.string() + ": " + std::strerror(errno));
  }
}

std::string read_file_bytes(const std::filesystem::path& path, std::uint64_t limit) {
  std::string text;
  append_file_bytes(path, text, limit);
  return text;
}

}  // namespace sluice::detail
