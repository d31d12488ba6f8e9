#pragma once
// Internal: the file helpers of the checkpoint format (docs/checkpoint_format.md) —
// sections of tag, length, CRC-32 and payload; buffered, fsync'd output; input that
// trusts no length before checking it against the bytes left — shared by HostModelMemory's
// checkpoints and TieredModelMemory's store. Every error names the file (and the byte).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "core/crc32.hpp"
#include "model_memory/direct_input.hpp"
#include "sluice/error.hpp"
#include "sluice/optimizer.hpp"
#include "sluice/stream_packets.hpp"

namespace sluice::detail {

constexpr std::uint32_t fourcc(const char (&s)[5]) {
  return static_cast<std::uint32_t>(static_cast<unsigned char>(s[0])) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[1])) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[2])) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[3])) << 24;
}

inline constexpr std::size_t kSectionHeaderBytes = 4 + 8 + 4;

/// A layer shape a saved file may hold (a checkpoint's, a model store's): one a stream can
/// address (outputs below 2^32, inputs below the packets' control bit), whose rows x cols
/// then fits an int64.
constexpr bool storable_shape(std::int64_t rows, std::int64_t cols) {
  return rows >= 0 && cols >= 0 && rows <= std::int64_t{0xFFFF'FFFF} &&
         cols <= std::int64_t{kControlBit};
}

/// The optimizer's numbers as the HEAD sections of a checkpoint and of a model store's
/// manifest hold them: f64 each, in this order.
inline constexpr std::array<double OptimizerConfig::*, 7> kOptimizerNumbers = {
    &OptimizerConfig::learning_rate,   &OptimizerConfig::momentum, &OptimizerConfig::beta1,
    &OptimizerConfig::beta2,           &OptimizerConfig::epsilon,  &OptimizerConfig::weight_decay,
    &OptimizerConfig::clip_global_norm};

inline std::string tag_name(std::uint32_t tag) {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const auto c = static_cast<char>((tag >> (8 * i)) & 0xFFU);
    s += (c >= 0x20 && c < 0x7F) ? c : '?';
  }
  return "'" + s + "'";
}

template <typename T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// --- writing -------------------------------------------------------------------------

// Little-endian scalar fields of a section, built in memory (at most a few dozen bytes).
class FieldWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (size_ + sizeof(T) > bytes_.size()) throw Error("checkpoint: section fields overflow");
    std::memcpy(bytes_.data() + size_, &value, sizeof(T));
    size_ += sizeof(T);
  }
  std::span<const std::byte> bytes() const { return {bytes_.data(), size_}; }

 private:
  std::array<std::byte, 128> bytes_{};
  std::size_t size_ = 0;
};

// A section's payload as pieces that already exist in memory: no copy of the arrays.
struct Section {
  std::uint32_t tag = 0;
  FieldWriter fields;
  std::vector<std::span<const std::byte>> arrays;

  std::uint64_t length() const {
    std::uint64_t n = fields.bytes().size();
    for (const auto& a : arrays) n += a.size();
    return n;
  }
  std::uint32_t crc() const {
    std::uint32_t c = crc32(fields.bytes());
    for (const auto& a : arrays) c = crc32(a, c);
    return c;
  }
};

inline std::string os_error(const std::string& what, const std::filesystem::path& path) {
  return what + " " + path.string() + ": " + std::strerror(errno);
}

/// Moves all of `bytes` with `call(p, n)` (::read or ::write on one descriptor) at most
/// 1 GiB a call (Linux moves less than 2 GiB in one), again where a signal interrupted it;
/// `moved(n)` sees each call's count before the next (0: a read found the file's end). A
/// failed call throws IoError(error()).
template <typename Byte, typename Call, typename Error, typename Moved>
void transfer_all(std::span<Byte> bytes, Call call, Error error, Moved moved) {
  Byte* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = call(p, std::min<std::size_t>(left, std::size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(error());
    }
    moved(static_cast<std::size_t>(n));
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// POSIX file output with a buffer; every failure is an IoError naming the file. A file
// not committed (a write failed: a full disk) is removed, so that no unfinished one is left.
class FileWriter {
 public:
  /// `context` starts every error message.
  explicit FileWriter(std::filesystem::path path, std::string context = "save checkpoint")
      : path_(std::move(path)), context_(std::move(context)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw IoError(os_error(context_ + ": cannot create", path_));
    buffer_.reserve(kBufferBytes);
  }
  ~FileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(std::span<const std::byte> bytes) {
    if (bytes.size() >= kBufferBytes) {
      flush();
      write_all(bytes);
      return;
    }
    if (buffer_.size() + bytes.size() > kBufferBytes) flush();
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  }
  template <typename T>
  void put(T value) {
    write(std::as_bytes(std::span<const T>(&value, 1)));
  }

  /// Flushes, fsyncs and closes: after this the bytes are on disk.
  void commit() {
    flush();
    if (::fsync(fd_) != 0) throw IoError(os_error(context_ + ": cannot fsync", path_));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw IoError(os_error(context_ + ": cannot close", path_));
    committed_ = true;
  }

 private:
  static constexpr std::size_t kBufferBytes = 1 << 20;

  void flush() {
    write_all(buffer_);
    buffer_.clear();
  }
  void write_all(std::span<const std::byte> bytes) {
    transfer_all(
        bytes, [&](const std::byte* p, std::size_t n) { return ::write(fd_, p, n); },
        [&] { return os_error(context_ + ": cannot write", path_); }, [](std::size_t) {});
  }

  std::filesystem::path path_;
  std::string context_;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<std::byte> buffer_;
};

inline void write_section(FileWriter& out, const Section& s) {
  out.put(s.tag);
  out.put(s.length());
  out.put(s.crc());
  out.write(s.fields.bytes());
  for (const auto& a : s.arrays) out.write(a);
}

/// Makes a rename in `dir` durable. `context` starts the error message.
inline void fsync_directory(const std::filesystem::path& dir,
                            const std::string& context = "save checkpoint") {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError(os_error(context + ": cannot open directory", dir));
  const int rc = ::fsync(fd);
  const int saved_errno = errno;
  ::close(fd);
  if (rc != 0) {
    errno = saved_errno;
    throw IoError(os_error(context + ": cannot fsync directory", dir));
  }
}

// Reads a file front to back; knows how many bytes are left, so no length read from the
// file is trusted (or allocated) before it has been checked against them.
class FileReader {
 public:
  /// `context` starts every error message, followed by the file's name.
  explicit FileReader(std::filesystem::path path, std::string context = "load checkpoint")
      : path_(std::move(path)), context_(std::move(context)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw IoError(os_error(context_ + ": cannot open", path_));
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int saved_errno = errno;
      ::close(fd_);
      errno = saved_errno;
      throw IoError(os_error(context_ + ": cannot stat", path_));
    }
    size_ = static_cast<std::uint64_t>(info.st_size);
    input_.emplace(fd_, path_, context_);
  }
  ~FileReader() { ::close(fd_); }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  std::uint64_t position() const { return pos_; }
  std::uint64_t remaining() const { return size_ - pos_; }

  /// Skips `bytes` (checked against what is left), e.g. a section not wanted.
  void skip(std::uint64_t bytes, const char* what) {
    if (bytes > remaining()) {
      fail("truncated: " + std::string(what) + " at byte " + std::to_string(pos_) + " needs " +
           std::to_string(bytes) + " bytes, " + std::to_string(remaining()) + " left");
    }
    pos_ += bytes;
  }
  /// Drops the file's pages from the page cache: for a file read once, in order.
  void drop_cache() { ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED); }

  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(context_ + " " + path_.string() + ": " + what);
  }

  void read(std::span<std::byte> out, const char* what) {
    std::uint32_t crc = 0;
    read(out, what, crc);
  }
  /// Reads `out` and chains `crc` over it (large reads go direct: direct_input.hpp).
  void read(std::span<std::byte> out, const char* what, std::uint32_t& crc) {
    if (out.size() > remaining()) {
      fail("truncated: " + std::string(what) + " at byte " + std::to_string(pos_) + " needs " +
           std::to_string(out.size()) + " bytes, " + std::to_string(remaining()) + " left");
    }
    const std::size_t n = input_->read(pos_, out, crc);
    pos_ += n;
    if (n < out.size()) fail("the file shrank while being read, at byte " + std::to_string(pos_));
  }
  template <typename T>
  T get(const char* what) {
    T value{};
    read(std::as_writable_bytes(std::span<T>(&value, 1)), what);
    return value;
  }

 private:
  std::filesystem::path path_;
  std::string context_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::uint64_t pos_ = 0;
  std::optional<DirectInput> input_;
};

// One section's payload: reads pieces and keeps the CRC; `expect_end` checks that the
// section's length was used exactly.
class SectionReader {
 public:
  SectionReader(FileReader& in, std::uint32_t expected_tag, const std::string& name)
      : in_(in), name_(name) {
    start_ = in.position();
    const auto tag = in.get<std::uint32_t>("section header");
    length_ = in.get<std::uint64_t>("section header");
    crc_ = in.get<std::uint32_t>("section header");
    if (tag != expected_tag) {
      in.fail("section at byte " + std::to_string(start_) + ": tag " + tag_name(tag) +
              ", expected " + tag_name(expected_tag) + " (" + name_ + ")");
    }
    if (length_ > in.remaining()) {
      in.fail("truncated: " + name_ + " at byte " + std::to_string(start_) + " claims " +
              std::to_string(length_) + " bytes, " + std::to_string(in.remaining()) + " left");
    }
    left_ = length_;
  }

  std::uint64_t length() const { return length_; }

  template <typename T>
  T get(const char* what) {
    T value{};
    read(std::as_writable_bytes(std::span<T>(&value, 1)), what);
    return value;
  }
  /// Reads `count` elements; the caller has checked `count` against the section length.
  template <typename T>
  std::vector<T> get_array(std::uint64_t count, const char* what) {
    std::vector<T> v(static_cast<std::size_t>(count));
    get_into(std::span<T>(v), what);
    return v;
  }
  /// Reads `out.size()` elements into `out`; the caller has checked the count.
  template <typename T>
  void get_into(std::span<T> out, const char* what) {
    read(std::as_writable_bytes(out), what);
  }

  /// Checks that the payload was read exactly and that its CRC matches.
  void finish() {
    if (left_ != 0) {
      in_.fail(name_ + " at byte " + std::to_string(start_) + ": " + std::to_string(left_) +
               " unexpected bytes at its end");
    }
    if (computed_ != crc_) {
      in_.fail(name_ + " at byte " + std::to_string(start_) + ": CRC mismatch (stored " +
               std::to_string(crc_) + ", computed " + std::to_string(computed_) +
               "): the file is corrupt");
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    in_.fail(name_ + " at byte " + std::to_string(start_) + ": " + what);
  }

 private:
  void read(std::span<std::byte> out, const char* what) {
    if (out.size() > left_) {
      fail(std::string(what) + " runs past the section's end (length " + std::to_string(length_) +
           ")");
    }
    in_.read(out, what, computed_);
    left_ -= out.size();
  }

  FileReader& in_;
  std::string name_;
  std::uint64_t start_ = 0, length_ = 0, left_ = 0;
  std::uint32_t crc_ = 0, computed_ = 0;
};

// `count` elements of `size` bytes, if that fits in `budget` bytes; false otherwise (also on
// overflow). Used before allocating anything a file asks for.
inline bool fits(std::uint64_t count, std::uint64_t size, std::uint64_t& budget) {
  if (count > budget / size) return false;
  budget -= count * size;
  return true;
}

}  // namespace sluice::detail
