#include "model_memory/direct_input.hpp"

#include <fcntl.h>
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "core/crc32.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

/// A direct read is split into pieces of this size, kDepth of them in flight (Linux's
/// asynchronous I/O, which with O_DIRECT does not block): the device reads ahead while the
/// thread copies and checks what has come — the page cache's read-ahead did that before.
/// 8 MiB in flight, as the VM's disk reads ahead (read_ahead_kb); a piece is small enough
/// to stay in L2/L3 while it is copied out and checked.
constexpr std::size_t kPieceBytes = std::size_t{2} << 20;
constexpr int kDepth = 4;
/// Copy and CRC go by pieces of this size, so the CRC reads what the copy just wrote
/// from L2 rather than from memory.
constexpr std::size_t kCopyPiece = std::size_t{128} << 10;

std::uint64_t align_down(std::uint64_t x) {
  return x / kDirectAlign * kDirectAlign;
}
std::uint64_t align_up(std::uint64_t x) {
  return align_down(x + kDirectAlign - 1);
}

/// A reading thread's asynchronous reads: an AIO context and the aligned buffers of the
/// pieces in flight whose destination is not at the file's phase. Kept for the thread's
/// life: new ones would fault in their pages on every file.
struct AsyncReads {
  aio_context_t context = 0;
  bool usable = false;
  struct Free {
    void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{kDirectAlign}); }
  };
  std::unique_ptr<std::byte, Free> buffers;

  AsyncReads() {
    usable = ::syscall(SYS_io_setup, kDepth, &context) == 0;
    if (usable) {
      buffers.reset(static_cast<std::byte*>(
          ::operator new (kDepth* kPieceBytes, std::align_val_t{kDirectAlign})));
    }
  }
  ~AsyncReads() {
    if (usable) ::syscall(SYS_io_destroy, context);
  }
  AsyncReads(const AsyncReads&) = delete;
  AsyncReads& operator=(const AsyncReads&) = delete;
  std::byte* buffer(std::size_t slot) { return buffers.get() + slot * kPieceBytes; }
};

AsyncReads& async_reads() {
  thread_local AsyncReads reads;
  return reads;
}

void copy_and_check(std::byte* to, const std::byte* from, std::size_t size, std::uint32_t& crc) {
  for (std::size_t i = 0; i < size; i += kCopyPiece) {
    const std::size_t n = std::min(kCopyPiece, size - i);
    std::memcpy(to + i, from + i, n);
    crc = crc32({to + i, n}, crc);
  }
}

void check(std::span<const std::byte> bytes, std::uint32_t& crc) {
  for (std::size_t i = 0; i < bytes.size(); i += kCopyPiece) {
    crc = crc32(bytes.subspan(i, std::min(kCopyPiece, bytes.size() - i)), crc);
  }
}

/// One read of whole blocks: into the destination (`into`) or a buffer slot.
struct Piece {
  std::uint64_t block = 0;
  std::size_t size = 0;
  std::byte* into = nullptr;
};

/// The pieces that cover [at, end) of the file: where `out` lies at the file's phase, its
/// whole blocks straight into it and the partial blocks at either end through the buffers;
/// else everything through the buffers.
std::vector<Piece> plan_pieces(std::uint64_t at, std::span<std::byte> out) {
  const std::uint64_t end = at + out.size();
  const bool in_place =
      direct_phase(reinterpret_cast<std::uintptr_t>(out.data())) == direct_phase(at) &&
      align_up(at) < align_down(end);
  std::vector<Piece> pieces;
  auto through_buffers = [&](std::uint64_t from, std::uint64_t to) {
    for (std::uint64_t b = align_down(from); b < to; b += kPieceBytes) {
      pieces.push_back(
          {b, static_cast<std::size_t>(std::min<std::uint64_t>(kPieceBytes, align_up(to) - b))});
    }
  };
  if (!in_place) {
    through_buffers(at, end);
    return pieces;
  }
  const std::uint64_t first = align_up(at), last = align_down(end);
  through_buffers(at, first);
  for (std::uint64_t b = first; b < last; b += kPieceBytes) {
    pieces.push_back({b, static_cast<std::size_t>(std::min<std::uint64_t>(kPieceBytes, last - b)),
                      out.data() + (b - at)});
  }
  through_buffers(last, end);
  return pieces;
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
  std::size_t done = 0;
  if (direct_io_enabled() && out.size() >= direct_read_min_bytes()) {
    if (!opened_) {
      opened_ = true;
      direct_fd_ = ::open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);  // -1: refused
      if (direct_fd_ >= 0 && !async_reads().usable) {
        ::close(direct_fd_);
        direct_fd_ = -1;
      }
    }
    if (direct_fd_ >= 0) done = read_direct(at, out, crc);
  }
  // The rest (all of a small read; after a refusal or a short direct read, whatever the
  // page cache says is there) through the page cache.
  if (done < out.size()) done += read_buffered(at + done, out.subspan(done), crc);
  return done;
}

std::size_t DirectInput::read_buffered(std::uint64_t at, std::span<std::byte> out,
                                       std::uint32_t& crc) {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done,
                              std::min<std::size_t>(out.size() - done, std::size_t{1} << 30),
                              static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail();
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  crc = crc32(out.first(done), crc);
  return done;
}

void DirectInput::fail() const {
  throw IoError(context_ + ": cannot read " + path_.string() + ": " + std::strerror(errno));
}

std::size_t DirectInput::read_direct(std::uint64_t at, std::span<std::byte> out,
                                     std::uint32_t& crc) {
  AsyncReads& reads = async_reads();
  const std::vector<Piece> pieces = plan_pieces(at, out);
  const std::uint64_t end = at + out.size();
  std::array<iocb, kDepth> requests{};
  std::array<std::int64_t, kDepth> results{};
  std::array<bool, kDepth> finished{};
  std::size_t submitted = 0, waited = 0;
  auto submit = [&] {
    const std::size_t slot = submitted % kDepth;
    const Piece& p = pieces[submitted];
    iocb& r = requests[slot];
    r = iocb{};
    r.aio_data = slot;
    r.aio_lio_opcode = IOCB_CMD_PREAD;
    r.aio_fildes = static_cast<std::uint32_t>(direct_fd_);
    r.aio_buf = reinterpret_cast<std::uintptr_t>(p.into != nullptr ? p.into : reads.buffer(slot));
    r.aio_nbytes = p.size;
    r.aio_offset = static_cast<std::int64_t>(p.block);
    iocb* list[1] = {&r};
    while (::syscall(SYS_io_submit, reads.context, 1, list) != 1) {
      if (errno != EINTR) return false;
    }
    finished[slot] = false;
    ++submitted;
    return true;
  };
  auto wait_next = [&] {  // the result of piece `waited`, whose slot's request is done
    const std::size_t slot = waited % kDepth;
    while (!finished[slot]) {
      std::array<io_event, kDepth> events{};
      const long n = ::syscall(SYS_io_getevents, reads.context, 1, kDepth, events.data(), nullptr);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail();
      for (long e = 0; e < n; ++e) {
        results[events[e].data] = events[e].res;
        finished[events[e].data] = true;
      }
    }
    ++waited;
    return results[slot];
  };
  // The kernel writes into the buffers and `out` until every request is waited for, so
  // every way out waits (a failure to wait then ends the process: noexcept destructor).
  struct Drain {
    std::size_t& submitted;
    std::size_t& waited;
    decltype(wait_next)& wait;
    ~Drain() {
      while (waited < submitted) wait();
    }
  } drain{submitted, waited, wait_next};

  std::uint64_t pos = at;  // the next file byte to deliver, into out[pos - at]
  bool refused = false;
  while (submitted < pieces.size() && submitted < kDepth && submit()) {
  }
  while (waited < submitted) {
    const std::size_t slot = waited % kDepth;
    const Piece& p = pieces[waited];
    const std::int64_t n = wait_next();
    if (n == -EINVAL || n == -EOPNOTSUPP) {
      refused = true;
      break;
    }
    if (n < 0) {
      errno = static_cast<int>(-n);
      fail();
    }
    const std::uint64_t to =
        std::min({p.block + static_cast<std::uint64_t>(n), p.block + p.size, end});
    if (to > pos) {
      const auto size = static_cast<std::size_t>(to - pos);
      if (p.into != nullptr) {
        check({out.data() + (pos - at), size}, crc);
      } else {
        copy_and_check(out.data() + (pos - at), reads.buffer(slot) + (pos - p.block), size, crc);
      }
      pos = to;
    }
    if (static_cast<std::uint64_t>(n) < p.size && pos < end) break;  // short: the page cache says
    if (submitted < pieces.size() && !submit()) break;
  }
  if (refused) {
    // The file system's alignment is larger than a page, or it has no direct I/O: the
    // page cache from here on, for this file.
    ::close(direct_fd_);
    direct_fd_ = -1;
  }
  return static_cast<std::size_t>(pos - at);
}

}  // namespace sluice::detail
