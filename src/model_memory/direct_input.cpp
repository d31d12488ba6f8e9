#include "model_memory/direct_input.hpp"

#include <fcntl.h>
#include <unistd.h>
#ifdef SLUICE_HAVE_LIBURING
#include <liburing.h>
#endif

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

/// A direct read is split into pieces of this size, kDepth of them in flight (io_uring, with
/// which O_DIRECT reads do not block the thread): the device reads ahead while the thread
/// copies and checks what has come — the page cache's read-ahead did that before. 8 MiB in
/// flight, as the VM's disk reads ahead (read_ahead_kb); a piece is small enough to stay in
/// L2/L3 while it is copied out and checked.
constexpr std::size_t kPieceBytes = std::size_t{2} << 20;
constexpr std::size_t kDepth = 4;
/// Copy and CRC go by pieces of this size, so the CRC reads what the copy just wrote
/// from L2 rather than from memory.
constexpr std::size_t kCopyPiece = std::size_t{128} << 10;

std::uint64_t align_down(std::uint64_t x) {
  return x / kDirectAlign * kDirectAlign;
}
std::uint64_t align_up(std::uint64_t x) {
  return align_down(x + kDirectAlign - 1);
}

/// A reading thread's direct reads of pieces, each in a slot: kDepth in flight through the
/// thread's io_uring (liburing), else — built without liburing, or the kernel refuses the
/// thread a ring (seccomp or kernel.io_uring_disabled: ENOSYS, EPERM) — one at a time by
/// pread. Kept for the thread's life with the aligned buffers of the slots: new ones would
/// fault in their pages on every file.
class PieceReads {
 public:
  PieceReads() {
#ifdef SLUICE_HAVE_LIBURING
    ring_ready_ = io_uring_queue_init(kDepth, &ring_, 0) == 0;
#endif
    buffers_.reset(static_cast<std::byte*>(
        ::operator new (depth() * kPieceBytes, std::align_val_t{kDirectAlign})));
    ask_for_huge_pages(buffers_.get(), depth() * kPieceBytes);  // as PhasedBuffer's
  }
  ~PieceReads() {
#ifdef SLUICE_HAVE_LIBURING
    if (ring_ready_) io_uring_queue_exit(&ring_);
#endif
  }
  PieceReads(const PieceReads&) = delete;
  PieceReads& operator=(const PieceReads&) = delete;

  /// Reads in flight at once.
  std::size_t depth() const {
    return ring_ready_ ? kDepth : 1;
  }
  std::byte* buffer(std::size_t slot) {
    return buffers_.get() + slot * kPieceBytes;
  }

  /// Starts the read of `size` bytes at `offset` of `fd` into `into` as slot `slot` (free);
  /// false if it could not be started.
  bool start(std::size_t slot, int fd, std::byte* into, std::size_t size, std::uint64_t offset) {
    finished_[slot] = false;
#ifdef SLUICE_HAVE_LIBURING
    if (ring_ready_) return start_on_ring(slot, fd, into, size, offset);
#endif
    ssize_t n = 0;
    while ((n = ::pread(fd, into, size, static_cast<off_t>(offset))) < 0 && errno == EINTR) {
    }
    results_[slot] = n < 0 ? -errno : n;
    finished_[slot] = true;
    return true;
  }

  /// Waits for slot `slot`'s read and sets `result` to its bytes read or -errno; returns 0,
  /// or the errno of a failed wait (the read may then be in flight still).
  int finish(std::size_t slot, std::int64_t& result) {
#ifdef SLUICE_HAVE_LIBURING
    while (!finished_[slot]) {
      io_uring_cqe* cqe = nullptr;
      const int waited = io_uring_wait_cqe(&ring_, &cqe);
      if (waited == -EINTR) continue;
      if (waited < 0) return -waited;
      const std::uint64_t done = io_uring_cqe_get_data64(cqe);
      if (done < kDepth) {  // else a stale no-op (start_on_ring)
        results_[done] = cqe->res;
        finished_[done] = true;
      }
      io_uring_cqe_seen(&ring_, cqe);
    }
#endif
    result = results_[slot];
    return 0;
  }

 private:
#ifdef SLUICE_HAVE_LIBURING
  bool start_on_ring(std::size_t slot, int fd, std::byte* into, std::size_t size,
                     std::uint64_t offset) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return false;  // not while every slot waited for is reaped
    io_uring_prep_read(sqe, fd, into, static_cast<unsigned>(size), offset);
    io_uring_sqe_set_data64(sqe, slot);
    int submitted = 0;
    while ((submitted = io_uring_submit(&ring_)) == -EINTR) {
    }
    if (submitted == 1) return true;
    // The kernel did not take it: the entry stays queued and would go with the next
    // submission, reading into memory that is by then someone else's — so as a no-op.
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, kDepth);
    return false;
  }
  io_uring ring_{};
#endif
  bool ring_ready_ = false;
  std::array<std::int64_t, kDepth> results_{};
  std::array<bool, kDepth> finished_{};
  struct Free {
    void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{kDirectAlign}); }
  };
  std::unique_ptr<std::byte, Free> buffers_;
};

PieceReads& piece_reads() {
  thread_local PieceReads reads;
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
  PieceReads& reads = piece_reads();
  const std::size_t depth = reads.depth();
  const std::vector<Piece> pieces = plan_pieces(at, out);
  const std::uint64_t end = at + out.size();
  std::size_t submitted = 0, waited = 0;
  auto submit = [&] {
    const std::size_t slot = submitted % depth;
    const Piece& p = pieces[submitted];
    if (!reads.start(slot, direct_fd_, p.into != nullptr ? p.into : reads.buffer(slot), p.size,
                     p.block)) {
      return false;
    }
    ++submitted;
    return true;
  };
  auto wait_next = [&] {  // the result of piece `waited`
    std::int64_t n = 0;
    if (const int error = reads.finish(waited % depth, n); error != 0) {
      errno = error;
      fail();
    }
    ++waited;
    return n;
  };
  // The kernel writes into the buffers and `out` until every read is waited for, so every
  // way out waits (a failure to wait then ends the process: noexcept destructor).
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
  while (submitted < pieces.size() && submitted < depth && submit()) {
  }
  while (waited < submitted) {
    const std::size_t slot = waited % depth;
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
