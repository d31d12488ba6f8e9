// Byte-level text corpora: a file or a directory of files, a fixed held-out tail, seeded
// training windows.
#include "sluice/text_corpus.hpp"

#include <algorithm>
#include <iterator>

#include "core/input_file.hpp"
#include "core/splitmix.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

/// The most bytes a corpus may hold (it is kept in RAM beside the model).
std::uint64_t max_corpus_bytes() {
  return std::min(TextCorpus::kMaxCorpusBytes, detail::max_input_bytes());
}

bool is_text_member(const std::filesystem::directory_entry& entry) {
  const std::string name = entry.path().filename().string();
  if (name.empty() || name.front() == '.') return false;
  if (name.size() > 4 && name.ends_with(".dat")) return false;
  std::error_code ec;  // an entry that vanished or cannot be examined is not read
  return !entry.is_symlink(ec) && !ec && entry.is_regular_file(ec) && !ec;
}

std::string read_directory(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> files;
  std::int64_t subdirectories = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (is_text_member(*it)) files.push_back(it->path());
    std::error_code kind;
    if (it->is_directory(kind) && !kind) ++subdirectories;
  }
  if (ec) throw IoError("cannot list " + dir.string() + ": " + ec.message());
  if (files.empty()) {
    const std::string skipped =
        subdirectories == 1 ? "its subdirectory is"
                            : "its " + std::to_string(subdirectories) + " subdirectories are";
    throw FormatError(dir.string() + ": no text files in the directory" +
                      (subdirectories == 0
                           ? std::string()
                           : " (a corpus is one directory's files; " + skipped + " not read)"));
  }
  std::sort(files.begin(), files.end());  // the same corpus whatever order readdir gives
  std::string text;
  const std::uint64_t limit = max_corpus_bytes();
  for (const auto& file : files) detail::append_maybe_gzipped_bytes(file, text, limit);
  return text;
}

/// A draw in [0, n) from 64 random bits: the modulo's bias, below n / 2^64, is far under
/// anything a corpus of this size could show, and it is the same on every platform.
std::int64_t draw(std::uint64_t bits, std::int64_t n) {
  return static_cast<std::int64_t>(bits % static_cast<std::uint64_t>(n));
}

}  // namespace

TextCorpus TextCorpus::load(const std::filesystem::path& path, std::int64_t context) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    throw IoError("cannot open " + path.string() + ": " +
                  (ec ? ec.message() : std::string("no such file or directory")));
  }
  std::string text;
  if (std::filesystem::is_directory(status)) {
    text = read_directory(path);
  } else {
    detail::append_maybe_gzipped_bytes(path, text, max_corpus_bytes());
  }
  return TextCorpus(std::move(text), context, path.string());
}

TextCorpus::TextCorpus(std::string bytes, std::int64_t context, std::string name)
    : bytes_(std::move(bytes)), context_(context) {
  if (context <= 0) {
    throw ArgumentError("TextCorpus: context must be positive, got " + std::to_string(context));
  }
  const auto size = static_cast<std::int64_t>(bytes_.size());
  if (size == 0) throw FormatError(name + ": no text (0 bytes)");
  const std::int64_t held = size / kHeldOutDivisor;
  train_bytes_ = size - held;
  if (held < context + 1) {
    throw FormatError(name + ": " + std::to_string(size) + " bytes are too few for context " +
                      std::to_string(context) + ": the held-out last 5% (" + std::to_string(held) +
                      " bytes) must hold a window of " + std::to_string(context + 1) +
                      " bytes (at least " + std::to_string((context + 1) * kHeldOutDivisor) +
                      " bytes needed)");
  }
}

std::span<const std::uint8_t> TextCorpus::train() const {
  return {reinterpret_cast<const std::uint8_t*>(bytes_.data()),
          static_cast<std::size_t>(train_bytes_)};
}

std::span<const std::uint8_t> TextCorpus::held_out() const {
  return {reinterpret_cast<const std::uint8_t*>(bytes_.data()) + train_bytes_,
          bytes_.size() - static_cast<std::size_t>(train_bytes_)};
}

TextBatch TextCorpus::batch_at(std::span<const std::uint8_t> part,
                               std::span<const std::int64_t> offsets) const {
  TextBatch batch;
  batch.sequences = static_cast<std::int64_t>(offsets.size());
  batch.context = context_;
  batch.inputs.reserve(offsets.size() * static_cast<std::size_t>(context_));
  batch.targets.reserve(batch.inputs.capacity());
  for (const std::int64_t offset : offsets) {
    const std::uint8_t* window = part.data() + offset;
    for (std::int64_t i = 0; i < context_; ++i) {
      batch.inputs.push_back(window[i]);
      batch.targets.push_back(window[i + 1]);
    }
  }
  return batch;
}

TextBatch TextCorpus::sample(std::int64_t sequences, std::uint64_t seed, std::uint64_t step) const {
  if (sequences < 0) {
    throw ArgumentError("TextCorpus::sample: negative sequence count " + std::to_string(sequences));
  }
  const std::int64_t starts = train_bytes_ - context_;  // offsets with context + 1 bytes after
  const std::uint64_t stream = detail::splitmix64(detail::splitmix64(seed) ^ step);
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(sequences));
  for (std::size_t s = 0; s < offsets.size(); ++s) {
    offsets[s] = draw(detail::splitmix64(stream + s), starts);
  }
  return batch_at(train(), offsets);
}

std::int64_t TextCorpus::held_out_windows() const {
  // The last window needs one byte beyond its context for its final target.
  return (static_cast<std::int64_t>(held_out().size()) - 1) / context_;
}

TextBatch TextCorpus::held_out_batch(std::int64_t first, std::int64_t count) const {
  if (first < 0 || count < 0 || first + count > held_out_windows()) {
    throw ArgumentError("TextCorpus::held_out_batch: windows [" + std::to_string(first) + ", " +
                        std::to_string(first + count) + ") outside the " +
                        std::to_string(held_out_windows()) + " held-out windows");
  }
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(count));
  for (std::int64_t w = 0; w < count; ++w)
    offsets[static_cast<std::size_t>(w)] = (first + w) * context_;
  return batch_at(held_out(), offsets);
}

}  // namespace sluice
