#include "core/input_file.hpp"

#include <zlib.h>

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
  bool at_end = false;
  if (!no_size) {  // read in place: no chunk to allocate for a small file
    const std::size_t before = text.size();
    text.resize(before + size);
    const std::size_t got = std::fread(text.data() + before, 1, size, file.get());
    text.resize(before + got);
    at_end = got < size;  // it shrank, or an error (below)
  }
  // What a file's size does not say: a device's or pipe's bytes, or a file that grew.
  const std::size_t chunk_bytes = no_size ? std::size_t{1} << 20 : std::size_t{1} << 12;
  const std::unique_ptr<char[]> chunk(new char[chunk_bytes]);
  while (!at_end) {
    const std::size_t got = std::fread(chunk.get(), 1, chunk_bytes, file.get());
    if (text.size() + got > limit) throw_input_too_large(path, limit);
    text.append(chunk.get(), got);
    at_end = got < chunk_bytes;
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

namespace {

/// Whether `path` is a regular file that does not start as a gzip stream does: one read as
/// it is. (A pipe or device is not peeked at, which would take its first bytes.)
bool plain_regular_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                             &std::fclose);
  unsigned char magic[2] = {0, 0};
  return file &&
         !(std::fread(magic, 1, 2, file.get()) == 2 && magic[0] == 0x1f && magic[1] == 0x8b);
}

}  // namespace

void append_maybe_gzipped_bytes(const std::filesystem::path& path, std::string& text,
                                std::uint64_t limit) {
  // A plain file as it is, its size checked before it is read; zlib passes a pipe through.
  if (plain_regular_file(path)) {
    append_file_bytes(path, text, limit);
    return;
  }
  const std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), &gzclose);
  if (!file) throw IoError("cannot open " + path.string() + ": " + std::strerror(errno));
  constexpr unsigned kChunk = 1U << 20;
  gzbuffer(file.get(), kChunk);
  std::vector<char> chunk(kChunk);
  int got = 0;
  while ((got = gzread(file.get(), chunk.data(), kChunk)) > 0) {
    if (text.size() + static_cast<std::size_t>(got) > limit) throw_input_too_large(path, limit);
    text.append(chunk.data(), static_cast<std::size_t>(got));
  }
  int error = Z_OK;
  const char* message = gzerror(file.get(), &error);
  if (got >= 0 && (error == Z_OK || error == Z_STREAM_END)) return;
  std::string why = message != nullptr ? message : "";
  const std::string prefix = path.string() + ": ";  // zlib names the file itself
  if (why.starts_with(prefix)) why.erase(0, prefix.size());
  if (error == Z_ERRNO) throw IoError("cannot read " + path.string() + ": " + why);  // not the data
  throw FormatError(path.string() + ": corrupt gzip data (" + why + ")");
}

std::string read_maybe_gzipped_bytes(const std::filesystem::path& path, std::uint64_t limit) {
  std::string text;
  append_maybe_gzipped_bytes(path, text, limit);
  return text;
}

}  // namespace sluice::detail
