#pragma once
// Byte-level text for language modelling: every byte a symbol 0..255, a fixed held-out split
// (the last 5% of the bytes), training windows sampled by a seed, held-out windows in order.
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace sluice {

/// `sequences` windows of `context` input symbols each, laid out as the blocks want tokens
/// (sequence s is [s * context, (s + 1) * context)), and every input's next byte.
struct TextBatch {
  std::int64_t sequences = 0;
  std::int64_t context = 0;
  std::vector<std::int32_t> inputs;
  std::vector<std::int32_t> targets;  ///< targets[i] is the byte after inputs[i]
};

class TextCorpus {
 public:
  static constexpr int kSymbols = 256;
  /// The held-out part: the last floor(bytes / 20) bytes.
  static constexpr std::int64_t kHeldOutDivisor = 20;
  /// The most bytes load() reads (4 GiB, or a quarter of the memory the process can have
  /// if that is less): a corpus is held in RAM.
  static constexpr std::uint64_t kMaxCorpusBytes = std::uint64_t{4} << 30;

  /// Reads a file, or a directory's regular files concatenated in sorted name order (not
  /// recursing; skipping hidden files, symbolic links - fortune's *.u8 aliases - and the
  /// *.dat indexes strfile writes beside fortune files); a gzip'd file is read decompressed
  /// (enwik8.gz trains on its text, not its compressed bytes). IoError naming the path if it cannot
  /// be read; FormatError naming it if it holds no text or too little for one window of
  /// context + 1 bytes in each of the training and held-out parts; ResourceError naming it
  /// if it holds more than the most a corpus may (a device or pipe that never ends
  /// included).
  static TextCorpus load(const std::filesystem::path& path, std::int64_t context);

  /// The same from bytes in memory; `name` stands for the source in error messages.
  TextCorpus(std::string bytes, std::int64_t context, std::string name = "text");

  std::int64_t context() const { return context_; }
  std::int64_t bytes() const { return static_cast<std::int64_t>(bytes_.size()); }
  std::span<const std::uint8_t> train() const;
  std::span<const std::uint8_t> held_out() const;

  /// `sequences` windows of context + 1 bytes at uniformly drawn offsets of the training part;
  /// the same (seed, step) give the same batch on every platform.
  TextBatch sample(std::int64_t sequences, std::uint64_t seed, std::uint64_t step) const;

  /// Consecutive non-overlapping windows of the held-out part: there are held_out_windows(),
  /// window w starts at byte w * context of it. Returns [first, first + count) of them.
  std::int64_t held_out_windows() const;
  TextBatch held_out_batch(std::int64_t first, std::int64_t count) const;

 private:
  TextBatch batch_at(std::span<const std::uint8_t> part,
                     std::span<const std::int64_t> offsets) const;

  std::string bytes_;
  std::int64_t context_ = 0;
  std::int64_t train_bytes_ = 0;
};

}  // namespace sluice
