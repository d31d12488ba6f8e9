#pragma once
// Internal: reads of a file's byte ranges with O_DIRECT (docs/model_store.md). Through the
// page cache a read costs the kernel's copy into the cache's pages, their allocation and
// eviction, then the caller's CRC in a second pass over memory; direct, the device writes
// into an aligned buffer and each piece is copied out and checked while it is in cache —
// or, where the destination lies at the file offset's place in a 4 KiB block, the device
// writes straight into it — several pieces in flight (io_uring, where liburing is built
// in), so the device reads ahead while the thread checks. A file system that refuses
// O_DIRECT (tmpfs before Linux 6.6: EINVAL) and what a short direct read left go through
// the page cache as before.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "core/huge_pages.hpp"

namespace sluice::detail {

/// O_DIRECT's alignment of file offsets, lengths and memory: the page size, which every
/// block device's logical block divides.
inline constexpr std::uint64_t kDirectAlign = 4096;
/// Reads shorter than this go through the page cache: a direct read waits for the device
/// every time, where the kernel's read-ahead serves small reads from memory.
inline constexpr std::size_t kDirectReadMinBytes = std::size_t{1} << 18;

/// What the environment's SLUICE_DIRECT_IO asks for: "0" off (everything through the page
/// cache), "all" every read direct however small (so the store's tests, whose layers are
/// tiny, take the direct paths), else large reads only. (State files are written direct
/// from 1 MiB on unless "0": StateWriter.)
enum class DirectIo { off, large, all };
DirectIo direct_io_mode();
inline bool direct_io_enabled() {
  return direct_io_mode() != DirectIo::off;
}
/// The shortest read that goes direct (kDirectReadMinBytes, 0 under "all").
std::size_t direct_read_min_bytes();

/// Where `bytes` of a buffer must start for a direct read into it of a file range that
/// starts at `file_offset`: at the same place in a 4 KiB block.
inline std::size_t direct_phase(std::uint64_t file_offset) {
  return static_cast<std::size_t>(file_offset % kDirectAlign);
}

/// Memory for `count` elements of T, uninitialised (read over at once: no zero-fill), whose
/// first element lies at `phase` bytes into a 4 KiB block (direct_phase of the file range
/// it is read from or written to).
template <typename T>
class PhasedBuffer {
 public:
  PhasedBuffer() = default;
  PhasedBuffer(std::size_t count, std::size_t phase)
      : memory_(static_cast<std::byte*>(
            ::operator new (count * sizeof(T) + 2 * kDirectAlign, std::align_val_t{kDirectAlign}))),
        data_(reinterpret_cast<T*>(memory_.get() + phase)),
        size_(count) {
    // In huge pages where the kernel allows: a direct transfer's request holds a bounded
    // number of memory segments, so from 4 KiB pages the device gets many small requests.
    ask_for_huge_pages(memory_.get(), count * sizeof(T) + 2 * kDirectAlign);
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<T> span() { return {data_, size_}; }
  /// Moves the first element to `phase` bytes into a block (phase < kDirectAlign, a
  /// multiple of sizeof(T)): a buffer kept for ranges of several files.
  void set_phase(std::size_t phase) { data_ = reinterpret_cast<T*>(memory_.get() + phase); }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete (p, std::align_val_t{kDirectAlign}); }
  };
  std::unique_ptr<std::byte, Free> memory_;
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Reads byte ranges of one file, chaining a CRC over what it reads.
class DirectInput {
 public:
  /// `fd`: the caller's descriptor of `path`, opened without O_DIRECT (kept by the caller);
  /// `context` starts every error message.
  DirectInput(int fd, std::filesystem::path path, std::string context);
  ~DirectInput();
  DirectInput(const DirectInput&) = delete;
  DirectInput& operator=(const DirectInput&) = delete;

  /// Reads out.size() bytes from byte `at` into `out` and chains `crc` over them; returns
  /// the bytes read, fewer only where the file ends. IoError if the system call fails.
  std::size_t read(std::uint64_t at, std::span<std::byte> out, std::uint32_t& crc);
  /// Whether large reads go direct (false before the first, or once O_DIRECT was refused).
  bool direct() const { return direct_fd_ >= 0; }

 private:
  std::size_t read_buffered(std::uint64_t at, std::span<std::byte> out, std::uint32_t& crc);
  /// Direct reads of [at, at + out.size()) in order, chaining `crc`; returns the bytes
  /// delivered, fewer where the file ends, the file system refused (then no more direct
  /// reads of this file) or a read came back short: the caller reads the rest buffered.
  std::size_t read_direct(std::uint64_t at, std::span<std::byte> out, std::uint32_t& crc);
  [[noreturn]] void fail() const;  ///< IoError from errno

  int fd_;
  int direct_fd_ = -1;
  bool opened_ = false;  ///< O_DIRECT was tried (direct_fd_ -1 after: refused)
  std::filesystem::path path_;
  std::string context_;
};

}  // namespace sluice::detail
