#pragma once
// Internal: the files of a TieredModelMemory store (docs/model_store.md), in the
// checkpoint format's sections (tag, length, CRC-32, payload; checkpoint_io.hpp):
//
//   MANIFEST                     what is committed: step, epochs, seed, optimizer, the
//                                schedules and the model description (model_sections.hpp),
//                                every layer's shape, update count and its state file's
//                                generation
//   layer-LLLLLL.pattern         the mask and its transpose as the layer was added
//   layer-LLLLLL.gGGGGGGGG.pattern  ... after a mask change (regrow) of that generation
//   layer-LLLLLL.gGGGGGGGG.state master values, bias, optimizer state of one generation
//
// A step writes every updated layer's state file of a new generation (flushed), then the
// manifest beside it, fsync'd and renamed over MANIFEST: the rename is the commit. The
// generation before stays as the layer's spare, which its next update renames and writes
// over. Files no manifest names (spares, what a killed step left behind) are removed when
// the store opens; spares also when it closes.
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model_memory/direct_input.hpp"
#include "model_memory/optimizer_kernels.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/optimizer.hpp"

namespace sluice::detail {

struct ManifestLayer {
  LayerShape shape;
  std::int64_t updates = 0;     ///< Adam's t
  std::int64_t generation = 0;  ///< of the state file that holds the layer
  /// Of the pattern file: 0 for the one written with the layer, a mask change's generation
  /// after it (manifest v2; v1 has only the first).
  std::int64_t pattern_generation = 0;
  bool has_state = false;  ///< false: optimizer state all zero (none in the file)
};

struct Manifest {
  std::int64_t step = 0;
  std::int64_t epochs = 0;           ///< passes over the training data (ModelMemory::epochs)
  std::int64_t next_generation = 1;  ///< of the next state files written
  std::uint64_t seed = 0;
  DynamicSparsity dynamic;                      ///< ModelMemory::dynamic (manifest version 3 on)
  std::string model;                            ///< ModelMemory::model (manifest version 5 on)
  std::vector<std::string> class_names;         ///< ModelMemory::class_names (version 6 on)
  std::vector<double> input_mean, input_scale;  ///< ModelMemory's (version 6 on)
  std::string training_data;                    ///< ModelMemory::training_data (version 7 on)
  OptimizerConfig config;                       ///< without the schedule (code, not data)
  NonFinitePolicy policy = NonFinitePolicy::skip_step;
  std::vector<ManifestLayer> layers;
};

/// The store's directory held by one process (flock on the directory, let go when the
/// process ends, however it ends): a second process opening the store would take the
/// first's uncommitted files for a killed step's leftovers and remove them, and the two
/// would commit over each other.
class StoreLock {
 public:
  /// IoError naming the directory if another open store (any process) holds it.
  explicit StoreLock(const std::filesystem::path& dir);
  ~StoreLock();
  StoreLock(const StoreLock&) = delete;
  StoreLock& operator=(const StoreLock&) = delete;

 private:
  int fd_ = -1;
};

std::filesystem::path manifest_path(const std::filesystem::path& dir);
std::filesystem::path pattern_path(const std::filesystem::path& dir, std::int32_t layer,
                                   std::int64_t generation);
std::filesystem::path state_path(const std::filesystem::path& dir, std::int32_t layer,
                                 std::int64_t generation);

/// Writes the manifest beside MANIFEST, fsyncs it and renames it over MANIFEST: the
/// commit. Throws with MANIFEST unchanged if any of that fails. The rename is durable once
/// the directory is fsync'd (fsync_directory), which the caller does after taking the new
/// manifest as its own: a failure there must not undo a commit the directory shows (the
/// files it names removed as a failed step's).
void write_manifest(const std::filesystem::path& dir, const Manifest& m);
/// FormatError naming the file and the byte if it is corrupt, IoError if unreadable.
Manifest read_manifest(const std::filesystem::path& dir);

/// Writes (and fsyncs) a layer's pattern file: its mask and transposed pattern.
void write_pattern(const std::filesystem::path& path, const CsrMatrix& mask,
                   const TransposedPattern& transposed);
/// What read_pattern checks beside every section's length and CRC.
enum class PatternCheck {
  full,  ///< every invariant of the mask and the transpose: a file not checked before
  /// none more: a file this store checked in full when it opened, or wrote from a checked
  /// pattern, whose CRCs prove its bytes unchanged since (a cache reload)
  crc_only,
};

/// Reads the pattern file into `mask` and/or `transposed` (either may be null: its
/// sections are skipped), checking their CRCs and the shape against `shape`. Their arrays'
/// memory is kept where it fits (a piece the cache evicted); the mask's values are left
/// for the caller to read (zero under PatternCheck::full). Returns the bytes read.
std::uint64_t read_pattern(const std::filesystem::path& path, const LayerShape& shape,
                           CsrMatrix* mask, TransposedPattern* transposed, PatternCheck check);

/// A store file smaller than this is written through the page cache and left there after a
/// read or a write: the next step reads it back from memory, where a dropped page costs a
/// device round trip per read. A larger one is written direct and its pages are dropped
/// once read: a model larger than RAM would otherwise push everything else out of the page
/// cache, and a large read gains nothing from it.
inline constexpr std::uint64_t kPageCachedFileBytes = std::uint64_t{1} << 20;

/// Byte counts and times of the store's file I/O, summed by every thread.
struct IoCounters {
  std::atomic<std::uint64_t> read_bytes{0}, write_bytes{0};
  std::atomic<double> read_seconds{0}, write_seconds{0};
};

/// Where a state file's sections are: the layout follows from nnz, bias size and slots.
struct StateLayout {
  std::int64_t nnz = 0, bias = 0;
  int slots = 0;
  /// Payload offsets: values, bias, state[s], bias_state[s]; then the END section.
  std::uint64_t values = 0, bias_at = 0;
  std::array<std::uint64_t, kMaxOptimizerSlots> state{}, bias_state{};
  std::uint64_t end = 0, size = 0;
  static StateLayout of(std::int64_t nnz, std::int64_t bias, int slots);
};

/// Reads a state file section's payload range [first, first + out.size()) floats (large
/// ranges with O_DIRECT: direct_input.hpp); `crc` chains the section's CRC over reads made in
/// order. FormatError naming the file and the offset on a short file.
class StateReader {
 public:
  StateReader(std::filesystem::path path, const StateLayout& layout, IoCounters& io);
  ~StateReader();
  StateReader(const StateReader&) = delete;
  StateReader& operator=(const StateReader&) = delete;
  /// Reads `out.size()` floats of the section whose payload starts at `section`, from
  /// element `first`, chaining `crc`.
  void read(std::uint64_t section, std::int64_t first, std::span<float> out, std::uint32_t& crc);
  /// Checks a whole section's CRC (read in order through `crc`) against the stored one.
  void check_crc(std::uint64_t section, std::uint32_t crc, const char* name);
  const std::filesystem::path& path() const { return path_; }
  /// Drops the file's pages from the page cache (it was read once, in order) if it is not
  /// small (kPageCachedFileBytes).
  void drop_cache();

 private:
  std::filesystem::path path_;
  StateLayout layout_;
  IoCounters& io_;
  int fd_ = -1;
  std::unique_ptr<DirectInput> input_;  ///< over fd_
};

/// Bytes of the aligned buffer a StateWriter copies its ranges through (direct I/O).
constexpr std::size_t kDirectWriteBytes = std::size_t{4} << 20;
/// The aligned buffer a StateWriter of this layout holds: none for files under
/// kPageCachedFileBytes, which go through the page cache (direct I/O pays for large writes
/// only).
std::int64_t direct_write_buffer_bytes(const StateLayout& layout);

/// Writes a state file in order of sections or by ranges within them, then finish()
/// writes the section headers with their CRCs, fsyncs and closes it. The whole 4 KiB
/// blocks of a range go with O_DIRECT from an aligned buffer (the file is written once
/// and read at the next step at the earliest: through the page cache it costs a copy,
/// the cache's pages and a write-back that the fsync waits for); the partial blocks at a
/// range's ends and the headers go through the page cache. A file system without
/// O_DIRECT (tmpfs) gets everything through the page cache.
class StateWriter {
 public:
  enum class Durability {
    committed,  ///< part of a commit: its data flushed (fdatasync) by finish()
    /// a step's scratch (a gradient spilled until the commit): read back before the commit,
    /// never named by a manifest, so not worth a device flush
    scratch,
  };
  /// `recycled`: a file no manifest names any more (an old generation's, or the last
  /// step's spill at `path` itself), renamed to `path` and written over where it exists: no
  /// inode to create and free each step and, at the same size, no blocks to allocate (the
  /// file system rewrites written blocks in place, which costs it less than new ones).
  StateWriter(std::filesystem::path path, const StateLayout& layout, IoCounters& io,
              Durability durability = Durability::committed,
              const std::filesystem::path& recycled = {});
  ~StateWriter();  ///< removes an unfinished file
  StateWriter(const StateWriter&) = delete;
  StateWriter& operator=(const StateWriter&) = delete;
  /// Writes floats [first, first + data.size()) of the section at `section`; ranges of
  /// one section must come in order (the CRC is chained over them). `index` names the
  /// section: 0 values, 1 bias, 2 + s state[s], 2 + slots + s bias_state[s].
  void write(int index, std::int64_t first, std::span<const float> data);
  void finish();

 private:
  std::filesystem::path path_;
  StateLayout layout_;
  IoCounters& io_;
  Durability durability_;
  /// Writes bytes [at, at + size) of the file: whole blocks direct, the rest buffered.
  void write_bytes(std::uint64_t at, const std::byte* p, std::size_t size);
  void write_buffered(std::uint64_t at, const std::byte* p, std::size_t size);

  int fd_ = -1;
  int direct_fd_ = -1;  ///< -1: the file system refused O_DIRECT
  struct FreeAligned {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, FreeAligned> aligned_;
  std::vector<std::uint32_t> crcs_;
  std::vector<std::int64_t> written_;
  bool finished_ = false;
};

/// The payload offset of section `index` (numbered as StateWriter::write's).
std::uint64_t state_section(const StateLayout& layout, int index);

}  // namespace sluice::detail
