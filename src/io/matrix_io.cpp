// Matrix Market and DLMC .smtx readers and writers for CsrMatrix.
// Files are read whole and parsed with std::from_chars: real DLMC masks hold
// about a million indices. Every complaint names the file and the line.
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "core/available_memory.hpp"
#include "core/excerpt.hpp"
#include "core/input_file.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"

namespace sluice {

namespace {

namespace fs = std::filesystem;

// Column indices are uint32 in CsrMatrix; rows get the same bound so that a
// corrupt size line cannot ask for more than 16 GiB of row offsets.
constexpr std::int64_t kMaxDimension = (std::int64_t{1} << 31) - 1;

[[noreturn]] void fail(const fs::path& path, std::int64_t line, const std::string& what) {
  throw FormatError(path.string() + ":" + std::to_string(line) + ": " + what);
}

std::string quoted(std::string_view text) {
  return detail::excerpt(text);
}

/// Hands out the lines of a text one by one (without '\n' or a trailing '\r'),
/// counting them from 1.
class LineReader {
 public:
  explicit LineReader(std::string_view text) : rest_(text) {}

  bool next(std::string_view& line) {
    if (rest_.empty()) return false;
    const std::size_t end = rest_.find('\n');
    line = rest_.substr(0, end);
    rest_ = end == std::string_view::npos ? std::string_view{} : rest_.substr(end + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++number_;
    return true;
  }
  /// Number of the line last returned by next() (0 before the first).
  std::int64_t number() const { return number_; }
  /// Bytes not yet handed out.
  std::size_t remaining() const { return rest_.size(); }

 private:
  std::string_view rest_;
  std::int64_t number_ = 0;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), is_space);
}

/// Splits `line` at runs of whitespace (and commas if `commas`). Fills up to N
/// fields; returns how many there are in total (more than N means extra fields).
template <std::size_t N>
std::size_t split_fields(std::string_view line, std::array<std::string_view, N>& fields,
                         bool commas = false) {
  std::size_t count = 0;
  std::size_t i = 0;
  const auto separator = [&](char c) { return is_space(c) || (commas && c == ','); };
  while (i < line.size()) {
    while (i < line.size() && separator(line[i])) ++i;
    if (i == line.size()) break;
    const std::size_t start = i;
    while (i < line.size() && !separator(line[i])) ++i;
    if (count < N) fields[count] = line.substr(start, i - start);
    ++count;
  }
  return count;
}

bool parse_int(std::string_view text, std::int64_t& value) {
  const char* first = text.data();
  if (!text.empty() && text.front() == '+') ++first;
  const char* last = text.data() + text.size();
  const auto [end, error] = std::from_chars(first, last, value);
  return error == std::errc{} && end == last && first != last;
}

bool parse_double(std::string_view text, double& value) {
  const char* first = text.data();
  if (!text.empty() && text.front() == '+') ++first;  // from_chars refuses a leading '+'
  const char* last = text.data() + text.size();
  const auto [end, error] = std::from_chars(first, last, value);
  return error == std::errc{} && end == last && first != last;
}

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

/// Checks a matrix shape read from a header before anything is allocated for it.
// A short file may declare up to 2^31 - 1 rows, each with an 8-byte offset that no line of
// the file pays for: checked against the memory there is before any is allocated.
void require_offsets_memory(const fs::path& path, std::int64_t line, std::int64_t rows,
                            std::int64_t cols) {
  detail::require_memory(8.0 * (static_cast<double>(rows) + 1),
                         path.string() + ":" + std::to_string(line) + ": a " +
                             std::to_string(rows) + "x" + std::to_string(cols) +
                             " matrix's row offsets");
}

void check_shape(const fs::path& path, std::int64_t line, std::int64_t rows, std::int64_t cols,
                 std::int64_t nnz) {
  if (rows > kMaxDimension || cols > kMaxDimension) {
    fail(path, line,
         "size " + std::to_string(rows) + "x" + std::to_string(cols) +
             " too large (at most 2^31 - 1 rows and columns)");
  }
  // Both below 2^31: the product fits in int64.
  if (nnz > rows * cols) {
    fail(path, line,
         std::to_string(nnz) + " non-zeros do not fit in a " + std::to_string(rows) + "x" +
             std::to_string(cols) + " matrix");
  }
}

// ---- writing ------------------------------------------------------------------------

/// Writes to `path.tmp.<pid>` and renames over `path` on commit(), so readers never
/// see a half-written file; without commit() the temporary is removed.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(fs::path path)
      : path_(std::move(path)), temp_(path_.string() + ".tmp." + std::to_string(::getpid())) {
    file_ = std::fopen(temp_.c_str(), "wb");
    if (file_ == nullptr) {
      throw IoError("cannot write '" + path_.string() + "': " + std::strerror(errno));
    }
    buffer_.reserve(kFlushAt + 256);
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) {
      std::error_code ignored;
      fs::remove(temp_, ignored);
    }
  }

  std::string& buffer() { return buffer_; }
  /// Call after each record: writes the buffer out once it is large.
  void maybe_flush() {
    if (buffer_.size() >= kFlushAt) flush();
  }

  void commit() {
    flush();
    std::FILE* file = std::exchange(file_, nullptr);
    if (std::fclose(file) != 0) fail_os("cannot write");
    std::error_code error;
    fs::rename(temp_, path_, error);
    if (error) {
      throw IoError("cannot rename '" + temp_.string() + "' to '" + path_.string() +
                    "': " + error.message());
    }
    committed_ = true;
  }

 private:
  static constexpr std::size_t kFlushAt = std::size_t{1} << 20;

  void flush() {
    if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size())
      fail_os("cannot write");
    buffer_.clear();
  }
  [[noreturn]] void fail_os(const char* what) const {
    throw IoError(std::string(what) + " '" + path_.string() + "': " + std::strerror(errno));
  }

  fs::path path_, temp_;
  std::FILE* file_ = nullptr;
  std::string buffer_;
  bool committed_ = false;
};

template <typename T>
void append_number(std::string& out, T value) {
  std::array<char, 32> digits{};
  const auto result = std::to_chars(digits.data(), digits.data() + digits.size(), value);
  out.append(digits.data(), result.ptr);
}

/// The line "rows<separator>cols<separator>nnz" that starts both text formats' data.
void append_sizes(std::string& out, const CsrMatrix& matrix, const char* separator) {
  append_number(out, matrix.rows());
  out += separator;
  append_number(out, matrix.cols());
  out += separator;
  append_number(out, matrix.nnz());
  out += '\n';
}

void append_float(std::string& out, float value) {
  // max_digits10 significant digits: parsing them gives back the same float.
  std::array<char, 48> digits{};
  const auto result =
      std::to_chars(digits.data(), digits.data() + digits.size(), value, std::chars_format::general,
                    std::numeric_limits<float>::max_digits10);
  out.append(digits.data(), result.ptr);
}

// ---- Matrix Market -------------------------------------------------------------------

struct MarketEntry {
  std::uint32_t row, col;  // 0-based
  float value;
  std::int64_t line;
};

enum class MarketField { real, integer, pattern };
/// Symmetric and skew-symmetric files store one triangle; each off-diagonal entry stands
/// for its mirror too (negated when skew), as SuiteSparse's matrices are mostly stored.
enum class MarketSymmetry { general, symmetric, skew_symmetric };

struct MarketHeader {
  MarketField field;
  MarketSymmetry symmetry;
};

MarketField market_field(const fs::path& path, std::string_view word) {
  const std::string field = lowercase(word);
  if (field == "real") return MarketField::real;
  if (field == "integer") return MarketField::integer;
  if (field == "pattern") return MarketField::pattern;
  fail(path, 1, "field " + quoted(word) + " is not supported (real, integer or pattern)");
}

MarketSymmetry market_symmetry(const fs::path& path, std::string_view word) {
  const std::string symmetry = lowercase(word);
  if (symmetry == "general") return MarketSymmetry::general;
  if (symmetry == "symmetric") return MarketSymmetry::symmetric;
  if (symmetry == "skew-symmetric") return MarketSymmetry::skew_symmetric;
  fail(path, 1,
       "symmetry " + quoted(word) +
           " is not supported (general, symmetric or skew-symmetric; hermitian is complex)");
}

const char* symmetry_name(MarketSymmetry symmetry) {
  switch (symmetry) {
    case MarketSymmetry::general:
      return "general";
    case MarketSymmetry::symmetric:
      return "symmetric";
    case MarketSymmetry::skew_symmetric:
      return "skew-symmetric";
  }
  return "?";
}

MarketHeader read_market_header(const fs::path& path, LineReader& lines) {
  std::string_view line;
  if (!lines.next(line)) fail(path, 1, "empty file, expected a '%%MatrixMarket' header");
  std::array<std::string_view, 5> fields;
  const std::size_t count = split_fields(line, fields);
  if (count == 0 || lowercase(fields[0]) != "%%matrixmarket") {
    fail(path, 1, "missing '%%MatrixMarket' header");
  }
  if (count != 5) {
    fail(path, 1, "header needs 5 words ('%%MatrixMarket matrix coordinate <field> <symmetry>')");
  }
  if (lowercase(fields[1]) != "matrix") {
    fail(path, 1, "object " + quoted(fields[1]) + " is not supported");
  }
  if (lowercase(fields[2]) != "coordinate") {
    fail(path, 1, "format " + quoted(fields[2]) + " is not supported, only coordinate");
  }
  const MarketHeader header{market_field(path, fields[3]), market_symmetry(path, fields[4])};
  if (header.field == MarketField::pattern && header.symmetry == MarketSymmetry::skew_symmetric) {
    // The format defines no such file: a pattern has no values to negate.
    fail(path, 1, "a pattern cannot be skew-symmetric");
  }
  return header;
}

float parse_market_value(const fs::path& path, std::int64_t line, std::string_view text,
                         MarketField field) {
  if (field == MarketField::integer) {
    std::int64_t value = 0;
    if (!parse_int(text, value)) fail(path, line, "value " + quoted(text) + " is not an integer");
    return static_cast<float>(value);
  }
  double value = 0.0;
  if (!parse_double(text, value)) fail(path, line, "value " + quoted(text) + " is not a number");
  if (!std::isfinite(value)) fail(path, line, "value " + quoted(text) + " is not finite");
  // Above the midpoint between FLT_MAX and 2^128 the float would be infinite.
  if (std::fabs(value) >= 0x1.ffffffp127) {
    fail(path, line, "value " + quoted(text) + " does not fit in a float");
  }
  return static_cast<float>(value);
}

std::uint32_t parse_market_index(const fs::path& path, std::int64_t line, std::string_view text,
                                 const char* name, std::int64_t size) {
  std::int64_t index = 0;
  if (!parse_int(text, index)) {
    fail(path, line, std::string(name) + " index " + quoted(text) + " is not an integer");
  }
  if (index < 1 || index > size) {
    fail(path, line,
         std::string(name) + " index " + std::to_string(index) + " out of range 1.." +
             std::to_string(size));
  }
  return static_cast<std::uint32_t>(index - 1);
}

/// Adds what a symmetric file's entry `e` stands for besides itself: its mirror across the
/// diagonal (negated when skew). Either triangle may be given; an entry and its mirror both
/// given are refused as duplicates.
void add_mirror(const fs::path& path, MarketSymmetry symmetry, const MarketEntry& e,
                std::vector<MarketEntry>& entries) {
  if (e.row == e.col) {
    if (symmetry == MarketSymmetry::skew_symmetric) {
      fail(path, e.line,
           "entry (" + std::to_string(e.row + 1) + ", " + std::to_string(e.col + 1) +
               ") on the diagonal of a skew-symmetric matrix, whose diagonal is zero");
    }
    return;
  }
  const float value = symmetry == MarketSymmetry::skew_symmetric ? -e.value : e.value;
  entries.push_back({e.col, e.row, value, e.line});
}

}  // namespace

CsrMatrix read_matrix_market(const fs::path& path, std::uint64_t seed) {
  const std::string text = detail::read_maybe_gzipped_bytes(path);
  LineReader lines(text);
  const MarketHeader header = read_market_header(path, lines);
  const MarketField field = header.field;
  const bool mirrored = header.symmetry != MarketSymmetry::general;

  // Comments ('%') and blank lines may come before the size line.
  std::string_view line;
  bool have_size = false;
  while (lines.next(line)) {
    if (line.starts_with('%') || is_blank(line)) continue;
    have_size = true;
    break;
  }
  if (!have_size) fail(path, lines.number() + 1, "file ends before the size line");
  const std::int64_t size_line = lines.number();
  std::array<std::string_view, 3> fields;
  const std::size_t size_count = split_fields(line, fields);
  if (size_count != 3) {
    fail(path, size_line,
         "size line needs 3 numbers 'rows cols nnz', found " + std::to_string(size_count));
  }
  std::array<std::int64_t, 3> size{};
  constexpr std::array<const char*, 3> kSizeNames = {"rows", "cols", "nnz"};
  for (std::size_t i = 0; i < 3; ++i) {
    if (!parse_int(fields[i], size[i])) {
      fail(path, size_line,
           std::string(kSizeNames[i]) + " " + quoted(fields[i]) + " is not an integer");
    }
  }
  const auto [rows, cols, nnz] = size;
  if (rows <= 0 || cols <= 0) {
    fail(path, size_line,
         "size " + std::to_string(rows) + "x" + std::to_string(cols) + " must be positive");
  }
  if (nnz < 0) fail(path, size_line, "negative entry count " + std::to_string(nnz));
  check_shape(path, size_line, rows, cols, nnz);
  if (mirrored && rows != cols) {
    fail(path, size_line,
         std::string("a ") + symmetry_name(header.symmetry) + " matrix must be square, not " +
             std::to_string(rows) + "x" + std::to_string(cols));
  }
  require_offsets_memory(path, size_line, rows, cols);
  // A count the rest of the file cannot hold (an entry takes more than a byte) is
  // corrupt. Below that, a mere truncation is reported where the entries run out,
  // and the reservation is capped by what the file can hold ("1 1\n" or "1 1 1\n").
  if (static_cast<std::uint64_t>(nnz) > lines.remaining()) {
    fail(path, size_line,
         "size line declares " + std::to_string(nnz) + " entries but only " +
             std::to_string(lines.remaining()) + " bytes follow");
  }
  const std::size_t shortest_entry = field == MarketField::pattern ? 4 : 6;
  std::vector<MarketEntry> entries;
  entries.reserve((mirrored ? 2 : 1) *
                  std::min(static_cast<std::size_t>(nnz), lines.remaining() / shortest_entry + 1));
  const std::size_t wanted_fields = field == MarketField::pattern ? 2 : 3;
  const char* entry_form = field == MarketField::pattern ? "'row col'" : "'row col value'";
  std::array<std::string_view, 3> entry;
  std::int64_t stored = 0;  // entries read; a mirrored file holds more
  while (lines.next(line)) {
    if (line.starts_with('%') || is_blank(line)) continue;
    const std::int64_t number = lines.number();
    if (stored == nnz) {
      fail(path, number, "extra entry: the size line declares only " + std::to_string(nnz));
    }
    const std::size_t count = split_fields(line, entry);
    if (count < wanted_fields) {
      fail(path, number, std::string("missing field: expected ") + entry_form);
    }
    if (count > wanted_fields) {
      fail(path, number, std::string("extra field: expected only ") + entry_form);
    }
    MarketEntry e{};
    e.row = parse_market_index(path, number, entry[0], "row", rows);
    e.col = parse_market_index(path, number, entry[1], "column", cols);
    e.value =
        field == MarketField::pattern ? 0.0F : parse_market_value(path, number, entry[2], field);
    e.line = number;
    entries.push_back(e);
    ++stored;
    if (mirrored) add_mirror(path, header.symmetry, e, entries);
  }
  if (stored < nnz) {
    fail(path, lines.number() + 1,
         "file ends after " + std::to_string(stored) + " of " + std::to_string(nnz) + " entries");
  }

  // Entries may come in any order. A stable sort keeps file order among equal
  // positions, so of two duplicates the second is the later line.
  const auto by_position = [](const MarketEntry& a, const MarketEntry& b) {
    return a.row != b.row ? a.row < b.row : a.col < b.col;
  };
  if (!std::is_sorted(entries.begin(), entries.end(), by_position)) {
    std::stable_sort(entries.begin(), entries.end(), by_position);
  }
  for (std::size_t i = 1; i < entries.size(); ++i) {
    const MarketEntry& a = entries[i - 1];
    const MarketEntry& b = entries[i];
    if (a.row == b.row && a.col == b.col) {
      fail(path, b.line,
           "duplicate entry (" + std::to_string(b.row + 1) + ", " + std::to_string(b.col + 1) +
               "), first given on line " + std::to_string(a.line) +
               (mirrored ? std::string(" (in a ") + symmetry_name(header.symmetry) +
                               " file an entry (i, j) stands for (j, i) too)"
                         : std::string()));
    }
  }

  std::vector<std::int64_t> offsets(static_cast<std::size_t>(rows) + 1, 0);
  std::vector<std::uint32_t> col_indices(entries.size());
  std::vector<float> values(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    ++offsets[entries[i].row + std::size_t{1}];
    col_indices[i] = entries[i].col;
    values[i] = entries[i].value;
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) offsets[r + 1] += offsets[r];
  CsrMatrix matrix(rows, cols, std::move(offsets), std::move(col_indices), std::move(values));
  if (field == MarketField::pattern) matrix.fill_values(seed);
  return matrix;
}

void write_matrix_market(const CsrMatrix& matrix, const fs::path& path) {
  if (matrix.rows() == 0 || matrix.cols() == 0) {
    // The reader (like most) refuses a zero size; don't write what can't be read back.
    throw ShapeError("write_matrix_market: cannot store an empty " + std::to_string(matrix.rows()) +
                     "x" + std::to_string(matrix.cols()) + " matrix in '" + path.string() + "'");
  }
  AtomicFileWriter writer(path);
  std::string& out = writer.buffer();
  out += "%%MatrixMarket matrix coordinate real general\n";
  append_sizes(out, matrix, " ");
  const auto& offsets = matrix.row_offsets();
  const auto& col_indices = matrix.col_indices();
  const auto& values = matrix.values();
  for (std::int64_t r = 0; r < matrix.rows(); ++r) {
    for (auto i = offsets[static_cast<std::size_t>(r)];
         i < offsets[static_cast<std::size_t>(r) + 1]; ++i) {
      append_number(out, r + 1);
      out += ' ';
      append_number(out, col_indices[static_cast<std::size_t>(i)] + std::uint64_t{1});
      out += ' ';
      append_float(out, values[static_cast<std::size_t>(i)]);
      out += '\n';
      writer.maybe_flush();
    }
  }
  writer.commit();
}

// ---- DLMC .smtx ----------------------------------------------------------------------

namespace {

/// Parses the whitespace-separated non-negative integers of `line` into `out`,
/// refusing more than `expected` of them. `what` and `whats` name one and several
/// of them in messages.
template <typename T>
void parse_number_line(const fs::path& path, std::int64_t line_number, std::string_view line,
                       std::size_t expected, const char* what, const char* whats,
                       std::vector<T>& out) {
  out.clear();
  out.reserve(std::min(expected, line.size() / 2 + 1));  // "0 " per number at best
  const char* p = line.data();
  const char* const end = line.data() + line.size();
  for (;;) {
    while (p != end && is_space(*p)) ++p;
    if (p == end) break;
    std::uint64_t value = 0;
    const auto [stop, error] = std::from_chars(p, end, value);
    const char* token_end = p;
    while (token_end != end && !is_space(*token_end)) ++token_end;
    if (error != std::errc{} || stop != token_end || value > std::numeric_limits<T>::max()) {
      fail(path, line_number,
           std::string(what) + " " + std::to_string(out.size()) + ": " +
               quoted(std::string_view(p, static_cast<std::size_t>(token_end - p))) +
               " is not a valid non-negative integer");
    }
    if (out.size() == expected) {
      fail(path, line_number,
           "more than the " + std::to_string(expected) + " " + whats + " the header declares");
    }
    out.push_back(static_cast<T>(value));
    p = token_end;
  }
  if (out.size() != expected) {
    fail(path, line_number,
         "expected " + std::to_string(expected) + " " + whats + ", found " +
             std::to_string(out.size()));
  }
}

}  // namespace

CsrMatrix read_smtx(const fs::path& path, std::uint64_t seed) {
  const std::string text = detail::read_maybe_gzipped_bytes(path);
  LineReader lines(text);
  std::string_view line;
  if (!lines.next(line)) fail(path, 1, "empty file, expected 'rows, cols, nnz'");
  std::array<std::string_view, 3> fields;
  const std::size_t count = split_fields(line, fields, /*commas=*/true);
  if (count != 3) {
    fail(path, 1, "first line needs 3 numbers 'rows, cols, nnz', found " + std::to_string(count));
  }
  std::array<std::int64_t, 3> size{};
  constexpr std::array<const char*, 3> kSizeNames = {"rows", "cols", "nnz"};
  for (std::size_t i = 0; i < 3; ++i) {
    if (!parse_int(fields[i], size[i]) || size[i] < 0) {
      fail(path, 1,
           std::string(kSizeNames[i]) + " " + quoted(fields[i]) + " is not a non-negative integer");
    }
  }
  const auto [rows, cols, nnz] = size;
  check_shape(path, 1, rows, cols, nnz);
  // Every number takes at least one byte: a header asking for more is corrupt.
  if (static_cast<std::uint64_t>(rows + 1 + nnz) > lines.remaining()) {
    fail(path, 1,
         "header declares " + std::to_string(rows + 1) + " row offsets and " + std::to_string(nnz) +
             " column indices but only " + std::to_string(lines.remaining()) + " bytes follow");
  }
  require_offsets_memory(path, 1, rows, cols);

  if (!lines.next(line)) fail(path, 2, "file ends before the row offsets");
  std::vector<std::int64_t> offsets;
  parse_number_line(path, 2, line, static_cast<std::size_t>(rows) + 1, "row offset", "row offsets",
                    offsets);
  if (offsets.front() != 0) {
    fail(path, 2, "first row offset is " + std::to_string(offsets.front()) + ", expected 0");
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    if (offsets[r + 1] < offsets[r]) {
      fail(path, 2,
           "row offsets decrease at row " + std::to_string(r) + " (" + std::to_string(offsets[r]) +
               " then " + std::to_string(offsets[r + 1]) + ")");
    }
  }
  if (offsets.back() != nnz) {
    fail(path, 2,
         "last row offset is " + std::to_string(offsets.back()) +
             " but the header says nnz = " + std::to_string(nnz));
  }

  std::vector<std::uint32_t> col_indices;
  if (lines.next(line)) {
    parse_number_line(path, 3, line, static_cast<std::size_t>(nnz), "column index",
                      "column indices", col_indices);
  } else if (nnz > 0) {
    fail(path, 3, "file ends before the column indices");
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    for (auto i = offsets[r]; i < offsets[r + 1]; ++i) {
      const auto col = col_indices[static_cast<std::size_t>(i)];
      const auto at = [&] {
        return "row " + std::to_string(r) + ", position " + std::to_string(i - offsets[r]) +
               ": column index " + std::to_string(col);
      };
      if (col >= cols) fail(path, 3, at() + " out of range (cols = " + std::to_string(cols) + ")");
      if (i > offsets[r]) {
        const auto previous = col_indices[static_cast<std::size_t>(i) - 1];
        if (col == previous) fail(path, 3, at() + " is a duplicate");
        if (col < previous) {
          fail(path, 3, at() + " after " + std::to_string(previous) + " (must increase)");
        }
      }
    }
  }
  while (lines.next(line)) {
    if (!is_blank(line)) fail(path, lines.number(), "unexpected content after the column indices");
  }

  std::vector<float> values(col_indices.size());
  CsrMatrix matrix(rows, cols, std::move(offsets), std::move(col_indices), std::move(values));
  matrix.fill_values(seed);
  return matrix;
}

void write_smtx(const CsrMatrix& matrix, const fs::path& path) {
  AtomicFileWriter writer(path);
  std::string& out = writer.buffer();
  append_sizes(out, matrix, ", ");
  const auto write_list = [&](const auto& list) {
    bool first = true;
    for (const auto value : list) {
      if (!first) out += ' ';
      first = false;
      append_number(out, value);
      writer.maybe_flush();
    }
    out += '\n';
  };
  write_list(matrix.row_offsets());
  write_list(matrix.col_indices());
  writer.commit();
}

CsrMatrix read_matrix(const fs::path& path, std::uint64_t seed) {
  // Either reader takes a gzip'd file as it is (x.mtx.gz, as scipy writes one).
  const bool gzipped = lowercase(path.extension().string()) == ".gz";
  const fs::path kind = gzipped ? path.stem() : path;
  const std::string extension = lowercase(kind.extension().string());
  if (extension == ".smtx") return read_smtx(path, seed);
  if (extension == ".mtx") return read_matrix_market(path, seed);
  throw FormatError(path.string() + ": unknown matrix file extension '" +
                    kind.extension().string() + (gzipped ? ".gz" : "") +
                    "' (expected .smtx or .mtx, either gzip'd or not)");
}

}  // namespace sluice
