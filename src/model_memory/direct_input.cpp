#include "model_memory/direct_input.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/crc32.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

/// The aligned buffer of direct reads whose destination is not at the file's phase: large
/// enough that a read is worth a request to the device, small enough to stay in L2/L3
/// while it is copied out and checked.
constexpr std::size_t kBounceBytes = std::size_t{4} << 20;
/// Copy and CRC go by pieces of this size, so the CRC reads what the copy just wrote
/// from L2 rather than from memory.
constexpr std::size_t kCopyPiece = std::size_t{128} << 10;

std::uint64_t align_down(std::uint64_t x) {
  return x / kDirectAlign * kDirectAlign;
}
std::uint64_t align_up(std::uint64_t x) {
  return align_down(x + kDirectAlign - 1);
}

std::byte* bounce_buffer() {
  struct Free {
    void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{kDirectAlign}); }
  };
  // One per reading thread, kept: a new one would fault in its pages on every file.
  thread_local std::unique_ptr<std::byte, Free> buffer(
      static_cast<std::byte*>(::operator new (kBounceBytes, std::align_val_t{kDirectAlign})));
  return buffer.get();
}

void copy_and_check(std::byte* to, const std::byte* from, std::size_t size, std::uint32_t& crc) {
  for (std::size_t i = 0; i < size; i += kCopyPiece) {
    const std::size_t n = std::min(kCopyPiece, size - i);
    std::memcpy(to + i, from + i, n);
    crc = crc32({to + i, n}, crc);
  }
}

}  // namespace

DirectIo direct_io_mode() {
  static const DirectIo mode = [] {
    const char* env = std::getenv("SLUICE_DIRECT_IO");
    if (env != nullptr && std::strcmp(env, "0") == 0) return DirectIo::off;
    if (env != nullptr && std::strcmp(env, "all") == 0) return DirectIo::all;
    return DirectIo::large;
  }();
  return mode;
}

std::size_t direct_read_min_bytes() {
  return direct_io_mode() == DirectIo::all ? 0 : kDirectReadMinBytes;
}

DirectInput::DirectInput(int fd, std::filesystem::path path, std::string context)
    : fd_(fd), path_(std::move(path)), context_(std::move(context)) {}

DirectInput::~DirectInput() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

std::size_t DirectInput::read(std::uint64_t at, std::span<std::byte> out, std::uint32_t& crc) {
  if (direct_io_enabled() && out.size() >= direct_read_min_bytes()) {
    if (!opened_) {
      opened_ = true;
      direct_fd_ = ::open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);  // -1: refused
    }
    std::size_t done = 0;
    if (direct_fd_ >= 0 && read_direct(at, out, crc, done)) return done;
  }
  return read_buffered(at, out, crc);
}

std::size_t DirectInput::read_buffered(std::uint64_t at, std::span<std::byte> out,
                                       std::uint32_t& crc) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done,
                              std::min<std::size_t>(out.size() - done, std::size_t{1} << 30),
                              static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw IoError(context_ + ": cannot read " + path_.string() + ": " + std::strerror(errno));
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  crc = crc32(out.first(done), crc);
  return done;
}

std::int64_t DirectInput::pread_direct(std::byte* p, std::size_t size, std::uint64_t at) {
  for (;;) {
    const ssize_t n = ::pread(direct_fd_, p, size, static_cast<off_t>(at));
    if (n >= 0) return n;
    if (errno == EINTR) continue;
    if (errno == EINVAL || errno == EOPNOTSUPP) return -1;
    throw IoError(context_ + ": cannot read " + path_.string() + ": " + std::strerror(errno));
  }
}

bool DirectInput::read_direct(std::uint64_t at, std::span<std::byte> out, std::uint32_t& crc,
                              std::size_t& done) {
  const std::uint64_t end = at + out.size();
  // Straight into `out` where it lies at the file's phase: its whole blocks; the partial
  // blocks at either end (and all of a range elsewhere) through the bounce buffer.
  const bool in_place =
      direct_phase(reinterpret_cast<std::uintptr_t>(out.data())) == direct_phase(at) &&
      align_up(at) < align_down(end);
  const std::uint64_t first = in_place ? align_up(at) : end;
  const std::uint64_t last = in_place ? align_down(end) : end;
  std::uint64_t pos = at;  // the next file byte to deliver, into out[pos - at]
  enum class Got { all, eof, refused };
  auto bounced = [&](std::uint64_t stop) {
    std::byte* buffer = bounce_buffer();
    while (pos < stop) {
      const std::uint64_t block = align_down(pos);
      const auto size =
          static_cast<std::size_t>(std::min<std::uint64_t>(kBounceBytes, align_up(stop) - block));
      const std::int64_t n = pread_direct(buffer, size, block);
      if (n < 0) return Got::refused;
      const std::uint64_t got = block + static_cast<std::uint64_t>(n);
      if (got <= pos) return Got::eof;
      const std::uint64_t take = std::min(got, stop) - pos;
      copy_and_check(out.data() + (pos - at), buffer + (pos - block),
                     static_cast<std::size_t>(take), crc);
      pos += take;
    }
    return Got::all;
  };
  auto in_place_blocks = [&] {
    const std::uint64_t from = pos;
    Got got = Got::all;
    while (pos < last) {
      const std::int64_t n = pread_direct(
          out.data() + (pos - at),
          static_cast<std::size_t>(std::min<std::uint64_t>(last - pos, 1U << 30)), pos);
      if (n < 0 || n == 0) {
        got = n < 0 ? Got::refused : Got::eof;
        break;
      }
      pos += static_cast<std::uint64_t>(n);
      if (n % static_cast<std::int64_t>(kDirectAlign) != 0) {
        got = pos < last ? Got::eof : Got::all;
        pos = std::min(pos, last);
        break;
      }
    }
    for (std::uint64_t i = from; i < pos; i += kCopyPiece) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kCopyPiece, pos - i));
      crc = crc32({out.data() + (i - at), n}, crc);
    }
    return got;
  };
  Got got = bounced(first);
  if (got == Got::all) got = in_place_blocks();
  if (got == Got::all) got = bounced(end);
  done = static_cast<std::size_t>(pos - at);
  if (got != Got::refused) return true;
  // Refused (the file system's alignment is larger than a page, or it has no direct I/O):
  // the page cache from here on, for this file.
  ::close(direct_fd_);
  direct_fd_ = -1;
  if (pos == at) return false;
  done += read_buffered(pos, out.subspan(done), crc);
  return true;
}

}  // namespace sluice::detail
