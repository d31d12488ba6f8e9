#include "model_memory/model_store_files.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/csr_matrix_access.hpp"
#include "core/huge_pages.hpp"
#include "model_memory/checkpoint_io.hpp"
#include "model_memory/model_sections.hpp"

namespace sluice::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kManifestMagic[8] = {'S', 'L', 'U', 'I', 'C', 'E', 'M', 'F'};
constexpr char kPatternMagic[8] = {'S', 'L', 'U', 'I', 'C', 'E', 'P', 'T'};
constexpr char kStateMagic[8] = {'S', 'L', 'U', 'I', 'C', 'E', 'S', 'T'};
constexpr std::uint32_t kVersion = 1;
/// The manifest's version 2 adds the epoch count and each layer's pattern generation,
/// version 3 the mask-update schedule (a "DYNS" section after "HEAD"), version 4 the
/// learning-rate decay (an "LRDC" section after "DYNS"), version 5 the model description
/// (a "MODL" section after "LRDC"), version 6 the class names and input scaling ("CLAS"
/// and "SCAL" sections after "MODL"), version 7 the training data's name (a "DATA" section
/// after "SCAL"); versions 1 (0 epochs, the first pattern files), 2 (rule none), 3 (no
/// decay), 4 (a stack of layers), 5 (no class names or scaling) and 6 (no training data
/// named) are still read.
constexpr std::uint32_t kManifestVersion = 7;
constexpr std::uint64_t kPrefixBytes = 8 + 4;
/// The most non-zeros a manifest's layer may claim: a pebibyte of values, past any store,
/// and low enough that every byte count derived from it (a layer's working set, its
/// files' layout) stays within int64.
constexpr std::int64_t kMaxLayerNonZeros = std::int64_t{1} << 48;
constexpr std::uint64_t kStateHeadBytes = 8 + 8 + 4;

constexpr std::uint32_t kHeadTag = fourcc("HEAD");
constexpr std::uint32_t kLayerTag = fourcc("LAYR");
constexpr std::uint32_t kEndTag = fourcc("END ");
constexpr std::uint32_t kStateHeadTag = fourcc("LHDR");
constexpr std::array<std::uint32_t, 5> kPatternTags = {
    fourcc("ROWS"), fourcc("COLS"), fourcc("TROW"), fourcc("TCOL"), fourcc("TSRC")};

void write_prefix(FileWriter& out, const char (&magic)[8], std::uint32_t version = kVersion) {
  out.write(std::as_bytes(std::span(magic)));
  out.put(version);
}

/// Checks the magic and a version in [oldest, newest]; returns the version.
std::uint32_t read_prefix(FileReader& in, const char (&magic)[8], const char* what,
                          std::uint32_t oldest = kVersion, std::uint32_t newest = kVersion) {
  char found[8];
  in.read(std::as_writable_bytes(std::span(found)), "magic");
  if (std::memcmp(found, magic, sizeof found) != 0) {
    in.fail(std::string("at byte 0: not a ") + what + " (wrong magic)");
  }
  const auto version = in.get<std::uint32_t>("version");
  if (version < oldest || version > newest) {
    in.fail("at byte 8: version " + std::to_string(version) + ", expected " +
            (oldest == newest ? "" : std::to_string(oldest) + " to ") + std::to_string(newest));
  }
  return version;
}

std::uint32_t section_tag(int index, int slots) {
  if (index == 0) return fourcc("VALS");
  if (index == 1) return fourcc("BIAS");
  const int s = index - 2;
  const char* base = s < slots ? "STA" : "BST";
  const char name[5] = {base[0], base[1], base[2], static_cast<char>('0' + s % slots), 0};
  return fourcc(name);
}

int section_count(int slots) {
  return 2 + 2 * slots;
}

std::uint64_t section_floats(const StateLayout& l, int index) {
  if (index == 0) return static_cast<std::uint64_t>(l.nnz);
  if (index == 1) return static_cast<std::uint64_t>(l.bias);
  return static_cast<std::uint64_t>(index - 2 < l.slots ? l.nnz : l.bias);
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

StoreLock::StoreLock(const std::filesystem::path& dir) {
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) throw IoError(os_error("model store: cannot open the directory", dir));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {  // (without waiting: no EINTR)
    const int saved_errno = errno;
    ::close(fd_);
    if (saved_errno == EWOULDBLOCK) {
      throw IoError("model store " + dir.string() +
                    " is open in another process or object (one opens it at a time)");
    }
    errno = saved_errno;
    throw IoError(os_error("model store: cannot lock the directory", dir));
  }
}

StoreLock::~StoreLock() {
  ::close(fd_);  // lets go of the lock
}

std::filesystem::path manifest_path(const std::filesystem::path& dir) {
  return dir / "MANIFEST";
}

std::filesystem::path pattern_path(const std::filesystem::path& dir, std::int32_t layer,
                                   std::int64_t generation) {
  char name[64];
  if (generation == 0) {
    std::snprintf(name, sizeof name, "layer-%06d.pattern", layer);
  } else {
    std::snprintf(name, sizeof name, "layer-%06d.g%010lld.pattern", layer,
                  static_cast<long long>(generation));
  }
  return dir / name;
}

std::filesystem::path state_path(const std::filesystem::path& dir, std::int32_t layer,
                                 std::int64_t generation) {
  char name[64];
  std::snprintf(name, sizeof name, "layer-%06d.g%010lld.state", layer,
                static_cast<long long>(generation));
  return dir / name;
}

// --- manifest --------------------------------------------------------------------------

void write_manifest(const std::filesystem::path& dir, const Manifest& m) {
  const std::filesystem::path final_path = manifest_path(dir);
  std::filesystem::path tmp = final_path;
  tmp += ".tmp";
  {
    FileWriter out(tmp, "model store: write manifest");
    write_prefix(out, kManifestMagic, kManifestVersion);
    Section head;
    head.tag = kHeadTag;
    const OptimizerConfig& c = m.config;
    head.fields.put(static_cast<std::uint32_t>(m.layers.size()));
    head.fields.put(m.step);
    head.fields.put(m.next_generation);
    head.fields.put(m.seed);
    head.fields.put(static_cast<std::uint32_t>(c.kind));
    for (auto number : kOptimizerNumbers) head.fields.put(c.*number);
    head.fields.put(static_cast<std::uint32_t>(m.policy == NonFinitePolicy::error ? 1 : 0));
    head.fields.put(m.epochs);
    write_section(out, head);
    write_section(out, schedule_section(m.dynamic));
    write_section(out, decay_section(c.decay));
    write_section(out, model_section(m.model));
    write_section(out, class_names_section(m.class_names));
    write_section(out, input_scaling_section(m.input_mean, m.input_scale));
    write_section(out, training_data_section(m.training_data));
    for (std::size_t i = 0; i < m.layers.size(); ++i) {
      const ManifestLayer& l = m.layers[i];
      Section s;
      s.tag = kLayerTag;
      s.fields.put(static_cast<std::uint32_t>(i));
      for (std::int64_t x :
           {l.shape.rows, l.shape.cols, l.shape.nnz, l.shape.bias, l.updates, l.generation}) {
        s.fields.put(x);
      }
      s.fields.put(static_cast<std::uint32_t>(l.has_state ? 1 : 0));
      s.fields.put(l.pattern_generation);
      write_section(out, s);
    }
    Section end;
    end.tag = kEndTag;
    write_section(out, end);
    out.commit();
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    throw IoError(os_error("model store: cannot rename " + tmp.string() + " to", final_path));
  }
}

Manifest read_manifest(const std::filesystem::path& dir) {
  FileReader in(manifest_path(dir), "model store: manifest");
  const std::uint32_t version =
      read_prefix(in, kManifestMagic, "model store manifest", 1, kManifestVersion);
  Manifest m;
  SectionReader head(in, kHeadTag, "HEAD section");
  const auto count = head.get<std::uint32_t>("layer count");
  m.step = head.get<std::int64_t>("step");
  m.next_generation = head.get<std::int64_t>("next generation");
  m.seed = head.get<std::uint64_t>("seed");
  const auto kind = head.get<std::uint32_t>("optimizer kind");
  OptimizerConfig& c = m.config;
  for (auto number : kOptimizerNumbers) c.*number = head.get<double>("optimizer config");
  const auto policy = head.get<std::uint32_t>("non-finite policy");
  m.epochs = version >= 2 ? head.get<std::int64_t>("epochs") : 0;
  head.finish();
  if (kind > 2) head.fail("unknown optimizer kind " + std::to_string(kind));
  if (policy > 1) head.fail("unknown non-finite policy " + std::to_string(policy));
  if (m.step < 0 || m.next_generation <= 0 || m.epochs < 0) {
    head.fail("negative step, generation or epoch count");
  }
  c.kind = static_cast<OptimizerKind>(kind);
  m.policy = policy == 1 ? NonFinitePolicy::error : NonFinitePolicy::skip_step;
  try {
    validate_optimizer_config(c);
  } catch (const Error& e) {
    head.fail(e.what());
  }
  if (version >= 3) m.dynamic = read_schedule_section(in);
  if (version >= 4) c.decay = read_decay_section(in);
  if (version >= 5) m.model = read_model_section(in);
  if (version >= 6) {
    m.class_names = read_class_names_section(in);
    read_input_scaling_section(in, m.input_mean, m.input_scale);
  }
  if (version >= 7) m.training_data = read_training_data_section(in);
  if (count > in.remaining() / kSectionHeaderBytes) head.fail("more layers than the file holds");
  for (std::uint32_t i = 0; i < count; ++i) {
    SectionReader s(in, kLayerTag, "LAYR section of layer " + std::to_string(i));
    if (s.get<std::uint32_t>("layer index") != i) s.fail("layers out of order");
    ManifestLayer l;
    for (std::int64_t* x :
         {&l.shape.rows, &l.shape.cols, &l.shape.nnz, &l.shape.bias, &l.updates, &l.generation}) {
      *x = s.get<std::int64_t>("layer fields");
    }
    l.has_state = s.get<std::uint32_t>("state flag") != 0;
    l.pattern_generation = version >= 2 ? s.get<std::int64_t>("pattern generation") : 0;
    s.finish();
    const LayerShape& sh = l.shape;
    if (!storable_shape(sh.rows, sh.cols) || sh.nnz < 0 || sh.nnz > sh.rows * sh.cols ||
        sh.nnz > kMaxLayerNonZeros || (sh.bias != 0 && sh.bias != sh.rows) || l.updates < 0 ||
        l.generation < 0 || l.generation >= m.next_generation || l.pattern_generation < 0 ||
        l.pattern_generation >= m.next_generation) {
      s.fail("invalid layer fields");
    }
    m.layers.push_back(l);
  }
  SectionReader end(in, kEndTag, "END section");
  end.finish();
  if (in.remaining() != 0)
    in.fail("at byte " + std::to_string(in.position()) + ": bytes after the END section");
  return m;
}

// --- pattern files ---------------------------------------------------------------------

void write_pattern(const std::filesystem::path& path, const CsrMatrix& mask,
                   const TransposedPattern& transposed) {
  FileWriter out(path, "model store: write pattern");
  write_prefix(out, kPatternMagic);
  std::array<Section, 5> s;
  for (std::size_t i = 0; i < s.size(); ++i) s[i].tag = kPatternTags[i];
  s[0].arrays.push_back(bytes_of(mask.row_offsets()));
  s[1].arrays.push_back(bytes_of(mask.col_indices()));
  s[2].arrays.push_back(bytes_of(transposed.row_offsets));
  s[3].arrays.push_back(bytes_of(transposed.col_indices));
  s[4].arrays.push_back(bytes_of(transposed.source));
  for (const Section& x : s) write_section(out, x);
  Section end;
  end.tag = kEndTag;
  write_section(out, end);
  out.commit();
}

namespace {
// The transposed pattern's invariants, beyond its sections' lengths and CRCs.
void check_transposed(const FileReader& in, const TransposedPattern& t, const LayerShape& shape) {
  const auto nnz = static_cast<std::uint64_t>(shape.nnz);
  if (t.row_offsets.front() != 0 || t.row_offsets.back() != shape.nnz) {
    in.fail("the transposed pattern's offsets do not cover the mask");
  }
  for (std::size_t r = 0; r + 1 < t.row_offsets.size(); ++r) {
    if (t.row_offsets[r + 1] < t.row_offsets[r]) {
      in.fail("the transposed pattern's offsets decrease at input " + std::to_string(r));
    }
  }
  for (std::uint64_t k = 0; k < nnz; ++k) {
    if (t.source[k] >= nnz || t.col_indices[k] >= static_cast<std::uint64_t>(shape.rows)) {
      in.fail("the transposed pattern's entry " + std::to_string(k) + " is out of range");
    }
  }
}
}  // namespace

std::uint64_t read_pattern(const std::filesystem::path& path, const LayerShape& shape,
                           CsrMatrix* mask, TransposedPattern* transposed, PatternCheck check) {
  FileReader in(path, "model store: pattern");
  read_prefix(in, kPatternMagic, "model store pattern file");
  const auto rows = static_cast<std::uint64_t>(shape.rows);
  const auto cols = static_cast<std::uint64_t>(shape.cols);
  const auto nnz = static_cast<std::uint64_t>(shape.nnz);
  std::uint64_t bytes = 0;
  // Reads section i into `out` (its memory kept where it fits: resize_for_overwrite), or
  // skips it if not wanted.
  auto array = [&](int i, auto& out, std::uint64_t count, bool want, const char* name) {
    using T = typename std::remove_reference_t<decltype(out)>::value_type;
    SectionReader s(in, kPatternTags[static_cast<std::size_t>(i)], name);
    if (s.length() != count * sizeof(T)) {
      s.fail("holds " + std::to_string(s.length()) + " bytes, the manifest's shape needs " +
             std::to_string(count * sizeof(T)));
    }
    if (!want) {
      in.skip(s.length(), name);
      return;
    }
    resize_for_overwrite(out, static_cast<std::size_t>(count));
    s.get_into(std::span<T>(out), name);
    s.finish();
    bytes += count * sizeof(T);
  };
  std::vector<std::int64_t> skipped_offsets;
  std::vector<std::uint32_t> skipped_indices;
  array(0, mask != nullptr ? CsrMatrixAccess::row_offsets(*mask) : skipped_offsets, rows + 1,
        mask != nullptr, "ROWS section");
  array(1, mask != nullptr ? CsrMatrixAccess::col_indices(*mask) : skipped_indices, nnz,
        mask != nullptr, "COLS section");
  if (mask != nullptr) {
    CsrMatrixAccess::set_shape(*mask, shape.rows, shape.cols);
    resize_for_overwrite(mask->values(), static_cast<std::size_t>(nnz));
    if (check == PatternCheck::full) {
      std::fill(mask->values().begin(), mask->values().end(), 0.0F);
      try {
        mask->validate();
      } catch (const Error& e) {
        in.fail(std::string("the mask is not a valid pattern: ") + e.what());
      }
    }
  }
  if (transposed != nullptr) {
    TransposedPattern& t = *transposed;
    t.rows = shape.cols;
    t.cols = shape.rows;
    array(2, t.row_offsets, cols + 1, true, "TROW section");
    array(3, t.col_indices, nnz, true, "TCOL section");
    array(4, t.source, nnz, true, "TSRC section");
    SectionReader end(in, kEndTag, "END section");
    end.finish();
    if (in.remaining() != 0)
      in.fail("at byte " + std::to_string(in.position()) + ": bytes after the END section");
    if (check == PatternCheck::full) check_transposed(in, t, shape);
  }
  if (in.position() + in.remaining() >= kPageCachedFileBytes) in.drop_cache();
  return bytes;
}

// --- state files -----------------------------------------------------------------------

namespace {
// A file of kPageCachedFileBytes or more leaves the page cache once read or written.
void drop_pages_if_large(int fd, std::uint64_t file_bytes) {
  if (file_bytes >= kPageCachedFileBytes) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
}
}  // namespace

StateLayout StateLayout::of(std::int64_t nnz, std::int64_t bias, int slots) {
  StateLayout l;
  l.nnz = nnz;
  l.bias = bias;
  l.slots = slots;
  std::uint64_t pos = kPrefixBytes + kSectionHeaderBytes + kStateHeadBytes;
  auto place = [&](std::int64_t floats) {
    const std::uint64_t at = pos + kSectionHeaderBytes;
    pos = at + 4 * static_cast<std::uint64_t>(floats);
    return at;
  };
  l.values = place(nnz);
  l.bias_at = place(bias);
  for (int s = 0; s < slots; ++s) l.state[s] = place(nnz);
  for (int s = 0; s < slots; ++s) l.bias_state[s] = place(bias);
  l.end = pos;
  l.size = pos + kSectionHeaderBytes;
  return l;
}

std::uint64_t state_section(const StateLayout& l, int index) {
  if (index == 0) return l.values;
  if (index == 1) return l.bias_at;
  const int s = index - 2;
  return s < l.slots ? l.state[s] : l.bias_state[s - l.slots];
}

StateReader::StateReader(std::filesystem::path path, const StateLayout& layout, IoCounters& io)
    : path_(std::move(path)), layout_(layout), io_(io) {
  FileReader in(path_, "model store: state");  // the header, read in order
  read_prefix(in, kStateMagic, "model store state file");
  SectionReader head(in, kStateHeadTag, "LHDR section");
  const auto nnz = head.get<std::int64_t>("nnz");
  const auto bias = head.get<std::int64_t>("bias size");
  const auto slots = head.get<std::uint32_t>("slots");
  head.finish();
  if (nnz != layout.nnz || bias != layout.bias ||
      slots != static_cast<std::uint32_t>(layout.slots)) {
    head.fail("holds " + std::to_string(nnz) + " non-zeros, " + std::to_string(bias) +
              " biases and " + std::to_string(slots) + " state slots; the manifest expects " +
              std::to_string(layout.nnz) + ", " + std::to_string(layout.bias) + " and " +
              std::to_string(layout.slots));
  }
  if (in.remaining() + in.position() != layout.size) {
    in.fail("is " + std::to_string(in.remaining() + in.position()) + " bytes, expected " +
            std::to_string(layout.size));
  }
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw IoError(os_error("model store: cannot open", path_));
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  input_ = std::make_unique<DirectInput>(fd_, path_, "model store");
  // Every section header: the tag and length where the layout puts them.
  for (int i = 0; i <= section_count(layout.slots); ++i) {
    const bool end = i == section_count(layout.slots);
    const std::uint64_t at = end ? layout.end : state_section(layout, i) - kSectionHeaderBytes;
    std::uint32_t tag = 0, crc = 0;
    std::uint64_t length = 0;
    if (::pread(fd_, &tag, 4, static_cast<off_t>(at)) != 4 ||
        ::pread(fd_, &length, 8, static_cast<off_t>(at + 4)) != 8 ||
        ::pread(fd_, &crc, 4, static_cast<off_t>(at + 12)) != 4) {
      throw IoError(os_error("model store: cannot read", path_));
    }
    const std::uint32_t want = end ? kEndTag : section_tag(i, layout.slots);
    const std::uint64_t want_length = end ? 0 : 4 * section_floats(layout, i);
    if (tag != want || length != want_length || (end && crc != crc32({}))) {
      throw FormatError("model store: state " + path_.string() + ": section at byte " +
                        std::to_string(at) + ": tag " + tag_name(tag) + " of " +
                        std::to_string(length) + " bytes, expected " + tag_name(want) + " of " +
                        std::to_string(want_length));
    }
  }
}

StateReader::~StateReader() {
  if (fd_ >= 0) ::close(fd_);
}

void StateReader::read(std::uint64_t section, std::int64_t first, std::span<float> out,
                       std::uint32_t& crc) {
  const auto start = Clock::now();
  const std::uint64_t at = section + 4 * static_cast<std::uint64_t>(first);
  const std::size_t n = input_->read(at, std::as_writable_bytes(out), crc);
  if (n < out.size_bytes()) {
    throw FormatError("model store: state " + path_.string() + ": truncated at byte " +
                      std::to_string(at + n));
  }
  io_.read_bytes += out.size_bytes();
  io_.read_seconds += seconds_since(start);
}

void StateReader::check_crc(std::uint64_t section, std::uint32_t crc, const char* name) {
  std::uint32_t stored = 0;
  const std::uint64_t at = section - 4;
  if (::pread(fd_, &stored, 4, static_cast<off_t>(at)) != 4) {
    throw IoError(os_error("model store: cannot read", path_));
  }
  if (stored != crc) {
    throw FormatError("model store: state " + path_.string() + ": " + name + " section at byte " +
                      std::to_string(section - kSectionHeaderBytes) + ": CRC mismatch (stored " +
                      std::to_string(stored) + ", computed " + std::to_string(crc) +
                      "): the file is corrupt");
  }
}

void StateReader::drop_cache() {
  drop_pages_if_large(fd_, layout_.size);
}

std::int64_t direct_write_buffer_bytes(const StateLayout& layout) {
  return layout.size < kPageCachedFileBytes ? 0 : static_cast<std::int64_t>(kDirectWriteBytes);
}

StateWriter::StateWriter(std::filesystem::path path, const StateLayout& layout, IoCounters& io,
                         Durability durability, const std::filesystem::path& recycled)
    : path_(std::move(path)),
      layout_(layout),
      io_(io),
      durability_(durability),
      crcs_(static_cast<std::size_t>(section_count(layout.slots)), 0),
      written_(crcs_.size(), 0) {
  // A recycled file cut to this layout's size (a no-op at the same size: its blocks stay).
  if (!recycled.empty() && ::rename(recycled.c_str(), path_.c_str()) == 0) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd_ >= 0 && ::ftruncate(fd_, static_cast<off_t>(layout_.size)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  if (fd_ < 0) fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(os_error("model store: cannot create", path_));
  // The file's blocks in one piece, allocated once rather than write by write; a file
  // system without fallocate allocates as it is written.
  if (layout_.size > 0) (void)::fallocate(fd_, 0, 0, static_cast<off_t>(layout_.size));
  if (direct_write_buffer_bytes(layout_) == 0 || !direct_io_enabled()) return;
  direct_fd_ = ::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (direct_fd_ >= 0) {
    aligned_.reset(static_cast<std::byte*>(std::aligned_alloc(kDirectAlign, kDirectWriteBytes)));
    if (!aligned_) {
      ::close(direct_fd_);
      direct_fd_ = -1;
    }
  }
}

StateWriter::~StateWriter() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(path_.c_str());
}

void StateWriter::write_buffered(std::uint64_t at, const std::byte* p, std::size_t left) {
  while (left > 0) {
    const ssize_t n =
        ::pwrite(fd_, p, std::min<std::size_t>(left, std::size_t{1} << 30), static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(os_error("model store: cannot write", path_));
    p += n;
    at += static_cast<std::uint64_t>(n);
    left -= static_cast<std::size_t>(n);
  }
}

void StateWriter::write_bytes(std::uint64_t at, const std::byte* p, std::size_t size) {
  const std::uint64_t end = at + size;
  const std::uint64_t first = (at + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  const std::uint64_t last = end / kDirectAlign * kDirectAlign;
  if (direct_fd_ < 0 || first >= last) {
    write_buffered(at, p, size);
    return;
  }
  write_buffered(at, p, first - at);
  // Where the data lies at the file's phase, its blocks go straight from it: no copy.
  const bool in_place = direct_phase(reinterpret_cast<std::uintptr_t>(p)) == direct_phase(at);
  for (std::uint64_t b = first; b < last;) {
    const auto n = static_cast<std::size_t>(
        std::min<std::uint64_t>(last - b, in_place ? std::uint64_t{1} << 30 : kDirectWriteBytes));
    const std::byte* from = p + (b - at);
    if (!in_place) {
      std::memcpy(aligned_.get(), from, n);
      from = aligned_.get();
    }
    const ssize_t w = ::pwrite(direct_fd_, from, n, static_cast<off_t>(b));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && b == first && (errno == EINVAL || errno == EOPNOTSUPP)) {
      // Opened but refused at the first write (alignment this file system wants more of):
      // the page cache for the rest of the file.
      ::close(direct_fd_);
      direct_fd_ = -1;
      write_buffered(b, p + (b - at), end - b);
      return;
    }
    if (w < 0) throw IoError(os_error("model store: cannot write", path_));
    if (static_cast<std::uint64_t>(w) % kDirectAlign != 0) {
      throw IoError("model store: cannot write " + path_.string() + ": short direct write");
    }
    b += static_cast<std::uint64_t>(w);
  }
  write_buffered(last, p + (last - at), end - last);
}

void StateWriter::write(int index, std::int64_t first, std::span<const float> data) {
  auto& done = written_[static_cast<std::size_t>(index)];
  if (first != done) throw Error("model store: internal error: state written out of order");
  const auto start = Clock::now();
  const auto bytes = std::as_bytes(data);
  write_bytes(state_section(layout_, index) + 4 * static_cast<std::uint64_t>(first), bytes.data(),
              bytes.size());
  crcs_[static_cast<std::size_t>(index)] = crc32(bytes, crcs_[static_cast<std::size_t>(index)]);
  done += static_cast<std::int64_t>(data.size());
  io_.write_bytes += bytes.size();
  io_.write_seconds += seconds_since(start);
}

void StateWriter::finish() {
  const auto start = Clock::now();
  auto put = [&](std::uint64_t at, auto value) {
    if (::pwrite(fd_, &value, sizeof value, static_cast<off_t>(at)) !=
        static_cast<ssize_t>(sizeof value)) {
      throw IoError(os_error("model store: cannot write", path_));
    }
  };
  auto put_header = [&](std::uint64_t payload, std::uint32_t tag, std::uint64_t length,
                        std::uint32_t crc) {
    put(payload - kSectionHeaderBytes, tag);
    put(payload - kSectionHeaderBytes + 4, length);
    put(payload - kSectionHeaderBytes + 12, crc);
  };
  if (::pwrite(fd_, kStateMagic, 8, 0) != 8) {
    throw IoError(os_error("model store: cannot write", path_));
  }
  put(8, kVersion);
  Section h;
  h.fields.put(layout_.nnz);
  h.fields.put(layout_.bias);
  h.fields.put(static_cast<std::uint32_t>(layout_.slots));
  const std::uint64_t head_at = kPrefixBytes + kSectionHeaderBytes;
  put_header(head_at, kStateHeadTag, kStateHeadBytes, h.crc());
  const auto fields = h.fields.bytes();
  if (::pwrite(fd_, fields.data(), fields.size(), static_cast<off_t>(head_at)) !=
      static_cast<ssize_t>(fields.size())) {
    throw IoError(os_error("model store: cannot write", path_));
  }
  for (int i = 0; i < section_count(layout_.slots); ++i) {
    const auto floats = section_floats(layout_, i);
    if (written_[static_cast<std::size_t>(i)] != static_cast<std::int64_t>(floats)) {
      throw Error("model store: internal error: section " +
                  tag_name(section_tag(i, layout_.slots)) + " of " + path_.string() +
                  " not fully written");
    }
    put_header(state_section(layout_, i), section_tag(i, layout_.slots), 4 * floats,
               crcs_[static_cast<std::size_t>(i)]);
  }
  put_header(layout_.end + kSectionHeaderBytes, kEndTag, 0, crc32({}));
  // fdatasync on either descriptor flushes the file: the direct writes' device cache, the
  // buffered pages and the metadata that reading them back needs (size, blocks), not the
  // times a rewritten file's inode changes by (the file's name is the directory's fsync).
  if (durability_ == Durability::committed && ::fdatasync(fd_) != 0) {
    throw IoError(os_error("model store: cannot fsync", path_));
  }
  if (direct_fd_ >= 0) {
    ::close(direct_fd_);
    direct_fd_ = -1;
  }
  drop_pages_if_large(fd_, layout_.size);  // written once, read next step at the earliest
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw IoError(os_error("model store: cannot close", path_));
  finished_ = true;
  io_.write_seconds += seconds_since(start);
}

}  // namespace sluice::detail
