#include <gtest/gtest.h>

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

namespace fs = std::filesystem;

using testing::thrown_message;

class MatrixIoTest : public testing::TempDirTest {
 protected:
  fs::path write_text(const std::string& name, const std::string& text) {
    const fs::path path = dir_ / name;
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::string read_text(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  std::vector<std::string> files_in_dir() {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    return names;
  }

  /// A Matrix Market file `name` that must be refused; the message must say
  /// "name:line:" and contain `what`.
  void expect_bad_market(const std::string& name, const std::string& text, int line,
                         const std::string& what) {
    SCOPED_TRACE(name);
    const fs::path path = write_text(name, text);
    const auto msg = thrown_message<FormatError>([&] { read_matrix_market(path); });
    EXPECT_CONTAINS(msg, name + ":" + std::to_string(line) + ":");
    EXPECT_CONTAINS(msg, what);
  }
  void expect_bad_smtx(const std::string& name, const std::string& text, int line,
                       const std::string& what) {
    SCOPED_TRACE(name);
    const fs::path path = write_text(name, text);
    const auto msg = thrown_message<FormatError>([&] { read_smtx(path); });
    EXPECT_CONTAINS(msg, name + ":" + std::to_string(line) + ":");
    EXPECT_CONTAINS(msg, what);
  }
};

void expect_same_pattern(const CsrMatrix& a, const CsrMatrix& b) {
  EXPECT_EQ(a.rows(), b.rows());
  EXPECT_EQ(a.cols(), b.cols());
  EXPECT_EQ(a.row_offsets(), b.row_offsets());
  EXPECT_EQ(a.col_indices(), b.col_indices());
}

void expect_bit_equal_values(const CsrMatrix& a, const CsrMatrix& b) {
  ASSERT_EQ(a.values().size(), b.values().size());
  for (std::size_t i = 0; i < a.values().size(); ++i) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(a.values()[i]),
              std::bit_cast<std::uint32_t>(b.values()[i]))
        << "value " << i << ": " << a.values()[i] << " vs " << b.values()[i];
  }
}

// ---- Matrix Market ----------------------------------------------------------------

TEST_F(MatrixIoTest, MarketRoundTripIsBitExact) {
  CsrMatrix m = CsrMatrix::random(37, 53, 0.7, 4, RowDistribution::powerlaw);
  ASSERT_GE(m.nnz(), 8);
  // Awkward values: extremes, subnormals, ones that need all 9 digits.
  auto& v = m.values();
  v[0] = std::numeric_limits<float>::max();
  v[1] = -std::numeric_limits<float>::max();
  v[2] = std::numeric_limits<float>::denorm_min();
  v[3] = std::numeric_limits<float>::min();
  v[4] = 1.0F / 3.0F;
  v[5] = -0.0F;
  v[6] = 16777217.0F;
  v[7] = 0.1F;
  const fs::path path = dir_ / "m.mtx";
  write_matrix_market(m, path);
  const std::string text = read_text(path);
  EXPECT_EQ(text.rfind("%%MatrixMarket matrix coordinate real general\n37 53 ", 0), 0U) << text;
  const CsrMatrix back = read_matrix_market(path);
  expect_same_pattern(m, back);
  expect_bit_equal_values(m, back);
  EXPECT_EQ(files_in_dir(), std::vector<std::string>{"m.mtx"});  // no temporary left

  const CsrMatrix via_dispatch = read_matrix(path);
  expect_bit_equal_values(m, via_dispatch);
}

TEST_F(MatrixIoTest, MarketOverwritesExistingFile) {
  const fs::path path = write_text("old.mtx", "garbage");
  const CsrMatrix m(1, 2, {0, 1}, {1}, {5.0F});
  write_matrix_market(m, path);
  EXPECT_EQ(read_matrix_market(path).values(), std::vector<float>{5.0F});
}

TEST_F(MatrixIoTest, MarketUnorderedEntriesCommentsAndBlankLines) {
  const fs::path path = write_text("u.mtx",
                                   "%%MatrixMarket matrix coordinate real general\r\n"
                                   "% a comment\n"
                                   "\n"
                                   "%another\n"
                                   "  3 4 5\n"
                                   "3 4 -1.5e0\n"
                                   "1 3 2\n"
                                   "\n"
                                   "3 1 +0.25\n"
                                   "1 1\t7\r\n"
                                   "2 2 1e-3");  // no final newline
  const CsrMatrix m = read_matrix_market(path);
  EXPECT_EQ(m.rows(), 3);
  EXPECT_EQ(m.cols(), 4);
  EXPECT_EQ(m.row_offsets(), (std::vector<std::int64_t>{0, 2, 3, 5}));
  EXPECT_EQ(m.col_indices(), (std::vector<std::uint32_t>{0, 2, 1, 0, 3}));
  EXPECT_EQ(m.values(), (std::vector<float>{7.0F, 2.0F, 1e-3F, 0.25F, -1.5F}));
}

TEST_F(MatrixIoTest, MarketIntegerAndPattern) {
  const fs::path ints = write_text("i.mtx",
                                   "%%MatrixMarket matrix coordinate integer general\n"
                                   "2 2 2\n2 1 -3\n1 2 12\n");
  const CsrMatrix mi = read_matrix_market(ints);
  EXPECT_EQ(mi.col_indices(), (std::vector<std::uint32_t>{1, 0}));
  EXPECT_EQ(mi.values(), (std::vector<float>{12.0F, -3.0F}));

  const std::string pattern_text =
      "%%MatrixMarket MATRIX Coordinate Pattern General\n"
      "3 3 4\n1 1\n3 3\n2 1\n1 3\n";
  const fs::path pattern = write_text("p.mtx", pattern_text);
  const CsrMatrix a = read_matrix_market(pattern, 5);
  EXPECT_EQ(a.row_offsets(), (std::vector<std::int64_t>{0, 2, 3, 4}));
  EXPECT_EQ(a.col_indices(), (std::vector<std::uint32_t>{0, 2, 0, 2}));
  // Values come from fill_values(seed).
  CsrMatrix expected = a;
  expected.fill_values(5);
  EXPECT_EQ(a.values(), expected.values());
  for (const float v : a.values()) EXPECT_NE(v, 0.0F);
  EXPECT_EQ(read_matrix_market(pattern, 5).values(), a.values());
  EXPECT_NE(read_matrix_market(pattern, 6).values(), a.values());
}

// A gzip'd file (x.mtx.gz, as scipy writes one) reads as the file it holds, by either
// reader and by read_matrix's extension; a corrupt one is refused naming the file.
TEST_F(MatrixIoTest, GzippedFilesReadAsTheirContents) {
  const auto gzip = [&](const std::string& name, const std::string& text) {
    const fs::path path = dir_ / name;
    gzFile gz = gzopen(path.c_str(), "wb");
    EXPECT_NE(gz, nullptr);
    gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
    gzclose(gz);
    return path;
  };
  const std::string market =
      "%%MatrixMarket matrix coordinate real general\n3 4 2\n3 4 -1.5\n1 2 2\n";
  const CsrMatrix plain = read_matrix_market(write_text("m.mtx", market));
  for (const fs::path& path : {gzip("m.mtx.gz", market), gzip("m.MTX.GZ", market)}) {
    const CsrMatrix m = read_matrix(path);
    expect_same_pattern(m, plain);
    EXPECT_EQ(m.values(), plain.values());
  }
  const std::string smtx = "2, 3, 2\n0 1 2\n2 0\n";
  expect_same_pattern(read_matrix(gzip("s.smtx.gz", smtx)), read_smtx(write_text("s.smtx", smtx)));
  EXPECT_EQ(read_matrix_market(gzip("named_plain.mtx", market)).values(), plain.values());

  std::string truncated = read_text(dir_ / "m.mtx.gz");
  truncated.resize(truncated.size() / 2);
  const fs::path bad = write_text("bad.mtx.gz", truncated);
  EXPECT_CONTAINS(thrown_message<FormatError>([&] { read_matrix(bad); }),
                  bad.string() + ": corrupt gzip data");
  EXPECT_CONTAINS(thrown_message<FormatError>([&] { read_matrix(gzip("m.txt.gz", market)); }),
                  "unknown matrix file extension '.txt.gz'");
}

// SuiteSparse stores most of its matrices so: one triangle, each off-diagonal entry
// standing for its mirror (negated when skew-symmetric).
TEST_F(MatrixIoTest, MarketSymmetricFilesMirrored) {
  const CsrMatrix sym = read_matrix_market(write_text(
      "sym.mtx",
      "%%MatrixMarket matrix coordinate real Symmetric\n3 3 4\n1 1 5\n3 1 -2\n2 3 7\n3 3 1\n"));
  const CsrMatrix general =
      read_matrix_market(write_text("gen.mtx",
                                    "%%MatrixMarket matrix coordinate real general\n3 3 6\n"
                                    "1 1 5\n1 3 -2\n2 3 7\n3 1 -2\n3 2 7\n3 3 1\n"));
  expect_same_pattern(sym, general);
  EXPECT_EQ(sym.values(), general.values());

  const CsrMatrix skew = read_matrix_market(write_text(
      "skew.mtx",
      "%%MatrixMarket matrix coordinate integer skew-symmetric\n3 3 2\n2 1 4\n3 2 -1\n"));
  EXPECT_EQ(skew.row_offsets(), (std::vector<std::int64_t>{0, 1, 3, 4}));
  EXPECT_EQ(skew.col_indices(), (std::vector<std::uint32_t>{1, 0, 2, 1}));
  EXPECT_EQ(skew.values(), (std::vector<float>{-4.0F, 4.0F, 1.0F, -1.0F}));

  const CsrMatrix pattern = read_matrix_market(
      write_text("psym.mtx", "%%MatrixMarket matrix coordinate pattern symmetric\n2 2 1\n2 1\n"));
  EXPECT_EQ(pattern.col_indices(), (std::vector<std::uint32_t>{1, 0}));
  for (const float v : pattern.values()) EXPECT_NE(v, 0.0F);
}

TEST_F(MatrixIoTest, MarketSymmetricFilesChecked) {
  const std::string sym = "%%MatrixMarket matrix coordinate real symmetric\n";
  expect_bad_market("rect.mtx", sym + "2 3 1\n1 1 1\n", 2,
                    "a symmetric matrix must be square, not 2x3");
  expect_bad_market("both.mtx", sym + "3 3 2\n3 1 1\n% c\n1 3 1\n", 5,
                    "duplicate entry (1, 3), first given on line 3 (in a symmetric file");
  expect_bad_market("count.mtx", sym + "3 3 2\n3 1 1\n", 4, "file ends after 1 of 2 entries");
  expect_bad_market("extra.mtx", sym + "3 3 1\n3 1 1\n2 1 1\n", 4, "extra entry");
  expect_bad_market("skewdiag.mtx",
                    "%%MatrixMarket matrix coordinate real skew-symmetric\n2 2 1\n2 2 1\n", 3,
                    "entry (2, 2) on the diagonal of a skew-symmetric matrix");
  expect_bad_market("pskew.mtx",
                    "%%MatrixMarket matrix coordinate pattern skew-symmetric\n2 2 1\n2 1\n", 1,
                    "a pattern cannot be skew-symmetric");
}

TEST_F(MatrixIoTest, MarketUnsupportedKindsRefused) {
  expect_bad_market("herm.mtx", "%%MatrixMarket matrix coordinate real hermitian\n2 2 1\n1 1 1\n",
                    1, "hermitian' is not supported");
  expect_bad_market("cx.mtx", "%%MatrixMarket matrix coordinate complex general\n2 2 1\n1 1 1 0\n",
                    1, "complex' is not supported");
  expect_bad_market("arr.mtx", "%%MatrixMarket matrix array real general\n2 2\n1\n2\n3\n4\n", 1,
                    "array' is not supported");
  expect_bad_market("vec.mtx", "%%MatrixMarket vector coordinate real general\n", 1,
                    "vector' is not supported");
  expect_bad_market("nohdr.mtx", "2 2 1\n1 1 1\n", 1, "missing '%%MatrixMarket' header");
  expect_bad_market("short.mtx", "%%MatrixMarket matrix coordinate\n", 1, "5 words");
  expect_bad_market("empty.mtx", "", 1, "empty file");
}

TEST_F(MatrixIoTest, MarketCorruptFilesRefused) {
  const std::string real = "%%MatrixMarket matrix coordinate real general\n";
  const std::string pat = "%%MatrixMarket matrix coordinate pattern general\n";
  expect_bad_market("dup.mtx", real + "3 3 3\n1 2 1\n% c\n2 2 1\n1 2 5\n", 6,
                    "duplicate entry (1, 2), first given on line 3");
  expect_bad_market("dup_unsorted.mtx", real + "3 3 3\n3 3 1\n1 1 1\n3 3 1\n", 5,
                    "first given on line 3");
  expect_bad_market("word.mtx", real + "2 2 1\n1 1 abc\n", 3, "value 'abc' is not a number");
  expect_bad_market("nan.mtx", real + "2 2 2\n1 1 1\n2 2 nan\n", 4, "not finite");
  expect_bad_market("inf.mtx", real + "2 2 1\n1 1 -inf\n", 3, "not finite");
  expect_bad_market("big.mtx", real + "2 2 1\n1 1 1e39\n", 3, "does not fit in a float");
  expect_bad_market("frac.mtx",
                    "%%MatrixMarket matrix coordinate integer general\n2 2 1\n1 1 1.5\n", 3,
                    "not an integer");
  expect_bad_market("missing.mtx", real + "2 2 2\n1 1 1\n2 2\n", 4, "missing field");
  expect_bad_market("extra_field.mtx", real + "2 2 1\n1 1 1 1\n", 3, "extra field");
  expect_bad_market("extra_field_pattern.mtx", pat + "2 2 1\n1 1 1\n", 3, "extra field");
  expect_bad_market("extra_entry.mtx", real + "2 2 1\n1 1 1\n2 2 2\n", 4,
                    "extra entry: the size line declares only 1");
  expect_bad_market("fewer.mtx", real + "4 4 3\n1 1 1.000000\n2 2 2.000000\n", 5,
                    "file ends after 2 of 3 entries");
  expect_bad_market("cut_mid_line.mtx", real + "4 4 2\n1 1 1.000000\n2 ", 4, "missing field");
  expect_bad_market("row0.mtx", real + "2 2 1\n0 1 1\n", 3, "row index 0 out of range 1..2");
  expect_bad_market("col_big.mtx", real + "2 2 1\n1 3 1\n", 3, "column index 3 out of range");
  expect_bad_market("row_word.mtx", real + "2 2 1\nx 1 1\n", 3, "row index 'x' is not an integer");
  expect_bad_market("neg_size.mtx", real + "-2 2 0\n", 2, "must be positive");
  expect_bad_market("zero_size.mtx", real + "2 0 0\n", 2, "must be positive");
  expect_bad_market("neg_nnz.mtx", real + "2 2 -1\n", 2, "negative entry count");
  expect_bad_market("size_word.mtx", real + "2 two 1\n", 2, "cols 'two' is not an integer");
  expect_bad_market("size_fields.mtx", real + "2 2\n", 2, "size line needs 3 numbers");
  expect_bad_market("no_size.mtx", real + "% only a comment\n", 3, "before the size line");
  expect_bad_market("too_many.mtx", real + "2 2 5\n" + std::string(100, '\n'), 2,
                    "5 non-zeros do not fit in a 2x2 matrix");
  // Corrupt headers are refused before anything is allocated for them.
  expect_bad_market("huge_nnz.mtx", real + "1000000 1000000 1000000000000\n1 1 1\n", 2,
                    "bytes follow");
  expect_bad_market("huge_rows.mtx", real + "4000000000 4000000000 1\n1 1 1\n", 2, "too large");
  expect_bad_market("overflow.mtx", real + "99999999999999999999 2 1\n1 1 1\n", 2,
                    "rows '99999999999999999999' is not an integer");
}

// ---- .smtx -------------------------------------------------------------------------

TEST_F(MatrixIoTest, SmtxRoundTrip) {
  const CsrMatrix m = CsrMatrix::random(300, 200, 0.9, 8, RowDistribution::powerlaw);
  const fs::path path = dir_ / "m.smtx";
  write_smtx(m, path);
  const CsrMatrix back = read_smtx(path, 17);
  expect_same_pattern(m, back);
  CsrMatrix expected = m;
  expected.fill_values(17);
  EXPECT_EQ(back.values(), expected.values());
  expect_same_pattern(m, read_matrix(path, 3));
  EXPECT_EQ(files_in_dir(), std::vector<std::string>{"m.smtx"});

  for (const auto& empty : {CsrMatrix(), CsrMatrix(3, 4, {0, 0, 0, 0}, {}, {})}) {
    write_smtx(empty, path);
    expect_same_pattern(empty, read_smtx(path));
  }
}

TEST_F(MatrixIoTest, SmtxDlmcStyle) {
  // As in the DLMC files: a trailing space on the number lines.
  const fs::path path = write_text("d.smtx", "3, 5, 4\n0 2 2 4 \n1 4 0 3 \n");
  const CsrMatrix m = read_smtx(path);
  EXPECT_EQ(m.rows(), 3);
  EXPECT_EQ(m.cols(), 5);
  EXPECT_EQ(m.row_offsets(), (std::vector<std::int64_t>{0, 2, 2, 4}));
  EXPECT_EQ(m.col_indices(), (std::vector<std::uint32_t>{1, 4, 0, 3}));
}

TEST_F(MatrixIoTest, SmtxCorruptFilesRefused) {
  expect_bad_smtx("empty.smtx", "", 1, "empty file");
  expect_bad_smtx("hdr_fields.smtx", "3, 5\n0 0 0 0\n\n", 1, "needs 3 numbers");
  expect_bad_smtx("hdr_word.smtx", "3, x, 0\n0 0 0 0\n\n", 1, "cols 'x'");
  expect_bad_smtx("hdr_neg.smtx", "-3, 5, 0\n0\n\n", 1, "rows '-3' is not a non-negative");
  expect_bad_smtx("hdr_dense.smtx", "2, 2, 5\n0 5 5\n0 1 0 1 1\n", 1, "do not fit");
  expect_bad_smtx("hdr_huge.smtx", "1000000000, 1000000000, 10\n0 10\n", 1, "bytes follow");
  expect_bad_smtx("hdr_wide.smtx", "1, 3000000000, 0\n0 0\n", 1, "too large");
  // Truncated after the header: too few bytes for the offsets it declares.
  expect_bad_smtx("no_offsets.smtx", "3, 5, 0\n", 1, "but only 0 bytes follow");
  expect_bad_smtx("few_offsets.smtx", "3, 5, 2\n0 1 2\n0 1\n", 2,
                  "expected 4 row offsets, found 3");
  expect_bad_smtx("many_offsets.smtx", "3, 5, 2\n0 1 2 2 2\n0 1\n", 2, "more than the 4");
  expect_bad_smtx("offset_word.smtx", "3, 5, 2\n0 1 x 2\n0 1\n", 2, "row offset 2: 'x'");
  expect_bad_smtx("offset_neg.smtx", "3, 5, 2\n0 1 -1 2\n0 1\n", 2, "'-1'");
  expect_bad_smtx("offset_start.smtx", "3, 5, 2\n1 1 2 2\n0 1\n", 2, "first row offset is 1");
  expect_bad_smtx("offset_down.smtx", "3, 5, 2\n0 2 1 2\n0 1\n", 2,
                  "row offsets decrease at row 1");
  expect_bad_smtx("offset_end.smtx", "3, 5, 3\n0 1 2 2\n0 1 2\n", 2, "last row offset is 2");
  expect_bad_smtx("no_cols.smtx", "3, 5, 2\n0 1 1 2\n", 3, "before the column indices");
  expect_bad_smtx("few_cols.smtx", "3, 5, 3\n0 1 1 3\n0 1\n", 3,
                  "expected 3 column indices, found 2");
  expect_bad_smtx("many_cols.smtx", "3, 5, 2\n0 1 1 2\n0 1 2\n", 3, "more than the 2");
  expect_bad_smtx("col_range.smtx", "3, 5, 3\n0 1 1 3\n0 1 5\n", 3,
                  "row 2, position 1: column index 5 out of range");
  expect_bad_smtx("col_unsorted.smtx", "3, 5, 3\n0 1 1 3\n0 4 2\n", 3,
                  "row 2, position 1: column index 2 after 4");
  expect_bad_smtx("col_dup.smtx", "3, 5, 3\n0 2 2 3\n3 3 2\n", 3,
                  "row 0, position 1: column index 3 is a duplicate");
  expect_bad_smtx("col_word.smtx", "3, 5, 2\n0 1 1 2\n0 1.5\n", 3, "'1.5'");
  expect_bad_smtx("trailing.smtx", "3, 5, 2\n0 1 1 2\n0 1\n\n7\n", 5, "unexpected content");
}

// ---- dispatch and I/O errors ---------------------------------------------------------

TEST_F(MatrixIoTest, ReadMatrixByExtension) {
  const fs::path path = write_text("x.txt", "3, 5, 0\n0 0 0 0\n\n");
  const auto msg = thrown_message<FormatError>([&] { read_matrix(path); });
  EXPECT_CONTAINS(msg, "x.txt");
  EXPECT_CONTAINS(msg, ".smtx or .mtx");
  const fs::path upper = write_text("X.SMTX", "3, 5, 0\n0 0 0 0\n\n");
  EXPECT_EQ(read_matrix(upper).rows(), 3);
}

TEST_F(MatrixIoTest, MissingFileIsIoError) {
  const fs::path path = dir_ / "absent.mtx";
  auto msg = thrown_message<IoError>([&] { read_matrix_market(path); });
  EXPECT_CONTAINS(msg, "absent.mtx");
  msg = thrown_message<IoError>([&] { read_smtx(dir_ / "absent.smtx"); });
  EXPECT_CONTAINS(msg, "absent.smtx");
  EXPECT_THROW(read_matrix(dir_ / "absent.smtx"), IoError);
  fs::create_directory(dir_ / "folder.smtx");
  EXPECT_THROW(read_smtx(dir_ / "folder.smtx"), IoError);
}

TEST_F(MatrixIoTest, UnwritableLocationThrowsAndLeavesNothing) {
  const CsrMatrix m = CsrMatrix::random(5, 5, 0.5, 1);
  // A directory that does not exist (works even as root, unlike chmod).
  const fs::path absent_dir = dir_ / "no_such_dir" / "m.mtx";
  auto msg = thrown_message<IoError>([&] { write_matrix_market(m, absent_dir); });
  EXPECT_CONTAINS(msg, "m.mtx");
  EXPECT_THROW(write_smtx(m, dir_ / "no_such_dir" / "m.smtx"), IoError);
  // The target is a directory: the rename fails and the temporary is removed.
  fs::create_directory(dir_ / "taken.mtx");
  fs::create_directory(dir_ / "taken.smtx");
  EXPECT_THROW(write_matrix_market(m, dir_ / "taken.mtx"), IoError);
  EXPECT_THROW(write_smtx(m, dir_ / "taken.smtx"), IoError);
  auto names = files_in_dir();
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"taken.mtx", "taken.smtx"}));
  EXPECT_TRUE(fs::is_empty(dir_ / "taken.mtx"));
}

TEST_F(MatrixIoTest, EmptyShapeNotWrittenAsMarket) {
  EXPECT_THROW(write_matrix_market(CsrMatrix(), dir_ / "e.mtx"), ShapeError);
  EXPECT_FALSE(fs::exists(dir_ / "e.mtx"));
}

}  // namespace
}  // namespace sluice
