// TextCorpus on text the tests write: the split, the windows, the directory rules, the errors.
#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "sluice/error.hpp"
#include "sluice/text_corpus.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::TempDirTest;

void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

/// 1900 training bytes below 127, then 100 held-out bytes from 128 up: every byte says
/// which part it came from.
std::string two_part_text() {
  std::string text;
  for (int i = 0; i < 1900; ++i) text.push_back(static_cast<char>(i % 127));
  for (int i = 0; i < 100; ++i) text.push_back(static_cast<char>(128 + i));
  return text;
}

class TextCorpusFiles : public TempDirTest {};

TEST_F(TextCorpusFiles, SplitsOffTheLastFivePercent) {
  const std::string text = two_part_text();
  write(dir_ / "text", text);
  const TextCorpus corpus = TextCorpus::load(dir_ / "text", 8);
  EXPECT_EQ(corpus.bytes(), 2000);
  ASSERT_EQ(corpus.train().size(), 1900U);
  ASSERT_EQ(corpus.held_out().size(), 100U);
  EXPECT_TRUE(std::equal(corpus.train().begin(), corpus.train().end(),
                         reinterpret_cast<const std::uint8_t*>(text.data())));
  EXPECT_EQ(corpus.held_out().front(), 128);  // bytes are symbols 0..255, never negative
  EXPECT_EQ(corpus.held_out().back(), 227);
}

TEST(TextCorpus, SamplesSeededTrainingWindows) {
  const TextCorpus corpus(two_part_text(), 8);
  const TextBatch a = corpus.sample(2000, 42, 3);
  ASSERT_EQ(a.sequences, 2000);
  ASSERT_EQ(a.context, 8);
  ASSERT_EQ(a.inputs.size(), 16000U);
  ASSERT_EQ(a.targets.size(), 16000U);
  std::set<std::int32_t> first_bytes;
  for (std::int64_t s = 0; s < a.sequences; ++s) {
    for (std::int64_t i = 0; i < 8; ++i) {
      const auto at = static_cast<std::size_t>(s * 8 + i);
      ASSERT_LT(a.targets[at], 127) << "a window reached the held-out part";
      // Consecutive bytes of the text (which counts up modulo 127).
      ASSERT_EQ(a.targets[at], (a.inputs[at] + 1) % 127);
      if (i + 1 < 8) ASSERT_EQ(a.inputs[at + 1], a.targets[at]);
    }
    first_bytes.insert(a.inputs[static_cast<std::size_t>(s * 8)]);
  }
  EXPECT_EQ(first_bytes.size(), 127U) << "offsets should spread over the whole training part";
  const TextBatch again = corpus.sample(2000, 42, 3);
  EXPECT_EQ(a.inputs, again.inputs);
  EXPECT_NE(a.inputs, corpus.sample(2000, 42, 4).inputs);
  EXPECT_NE(a.inputs, corpus.sample(2000, 43, 3).inputs);
  EXPECT_TRUE(corpus.sample(0, 1, 1).inputs.empty());
}

TEST(TextCorpus, HeldOutWindowsInOrder) {
  const TextCorpus corpus(two_part_text(), 8);
  ASSERT_EQ(corpus.held_out_windows(), 12);  // 99 bytes after the first, 8 per window
  const TextBatch all = corpus.held_out_batch(0, 12);
  for (std::size_t i = 0; i < all.inputs.size(); ++i) {
    ASSERT_EQ(all.inputs[i], static_cast<std::int32_t>(128 + i));
    ASSERT_EQ(all.targets[i], static_cast<std::int32_t>(129 + i));
  }
  const TextBatch tail = corpus.held_out_batch(11, 1);
  EXPECT_EQ(tail.inputs.front(), 128 + 88);
  EXPECT_EQ(tail.targets.back(), 128 + 96);
  testing::thrown_message<ArgumentError>([&] { corpus.held_out_batch(5, 8); });
}

TEST_F(TextCorpusFiles, ReadsADirectoryOfFortuneFilesInNameOrder) {
  const std::string a(1000, 'a'), b(1100, 'b');
  write(dir_ / "b", b);
  write(dir_ / "a", a);
  write(dir_ / "a.dat", std::string(500, 'x'));  // strfile's index
  write(dir_ / ".hidden", std::string(500, 'h'));
  std::filesystem::create_symlink("a", dir_ / "a.u8");
  std::filesystem::create_directory(dir_ / "off");
  write(dir_ / "off" / "c", std::string(500, 'c'));
  const TextCorpus corpus = TextCorpus::load(dir_, 16);
  ASSERT_EQ(corpus.bytes(), 2100);
  std::string read(corpus.train().begin(), corpus.train().end());
  read.append(corpus.held_out().begin(), corpus.held_out().end());
  EXPECT_EQ(read, a + b);
}

// A gzip'd text (enwik8.gz) is its text, alone or in a directory; a corrupt one is refused.
TEST_F(TextCorpusFiles, GzippedTextIsReadDecompressed) {
  const auto gzip = [&](const std::filesystem::path& path, const std::string& text) {
    gzFile gz = gzopen(path.c_str(), "wb");
    ASSERT_NE(gz, nullptr);
    gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
    gzclose(gz);
  };
  const auto all = [](const TextCorpus& c) {
    std::string read(c.train().begin(), c.train().end());
    return read.append(c.held_out().begin(), c.held_out().end());
  };
  std::string text;
  for (int i = 0; i < 300; ++i) text += "line " + std::to_string(i) + "\n";
  gzip(dir_ / "text.gz", text);
  EXPECT_EQ(all(TextCorpus::load(dir_ / "text.gz", 16)), text);
  std::filesystem::create_directory(dir_ / "books");
  gzip(dir_ / "books" / "a.gz", text);
  write(dir_ / "books" / "b", "plain");
  EXPECT_EQ(all(TextCorpus::load(dir_ / "books", 16)), text + "plain");
  write(dir_ / "bad.gz", std::string("\x1f\x8b\x08", 3));
  EXPECT_CONTAINS(
      testing::thrown_message<FormatError>([&] { TextCorpus::load(dir_ / "bad.gz", 16); }),
      "bad.gz: corrupt gzip data");
}

TEST_F(TextCorpusFiles, BadSourcesNameThePath) {
  const auto missing = dir_ / "missing.txt";
  auto message = testing::thrown_message<IoError>([&] { TextCorpus::load(missing, 8); });
  EXPECT_CONTAINS(message, missing.string());

  write(dir_ / "empty.txt", "");
  message = testing::thrown_message<FormatError>([&] { TextCorpus::load(dir_ / "empty.txt", 8); });
  EXPECT_CONTAINS(message, (dir_ / "empty.txt").string());
  EXPECT_CONTAINS(message, "0 bytes");

  write(dir_ / "short.txt", std::string(179, 'z'));  // 8 held-out bytes: no window of 9
  message = testing::thrown_message<FormatError>([&] { TextCorpus::load(dir_ / "short.txt", 8); });
  EXPECT_CONTAINS(message, (dir_ / "short.txt").string());
  EXPECT_CONTAINS(message, "at least 180 bytes");
  write(dir_ / "enough.txt", std::string(180, 'z'));
  EXPECT_EQ(TextCorpus::load(dir_ / "enough.txt", 8).held_out_windows(), 1);

  std::filesystem::create_directory(dir_ / "nothing");
  write(dir_ / "nothing" / "x.dat", "index");
  message = testing::thrown_message<FormatError>([&] { TextCorpus::load(dir_ / "nothing", 8); });
  EXPECT_CONTAINS(message, (dir_ / "nothing").string());
  EXPECT_CONTAINS(message, "no text files");
  EXPECT_EQ(message.find("subdirectories"), std::string::npos) << message;
  std::filesystem::create_directories(dir_ / "nothing" / "books");
  message = testing::thrown_message<FormatError>([&] { TextCorpus::load(dir_ / "nothing", 8); });
  EXPECT_CONTAINS(message, "one directory's files; its subdirectory is not read");

  testing::thrown_message<ArgumentError>([&] { TextCorpus::load(dir_ / "enough.txt", 0); });
}

}  // namespace
}  // namespace sluice
