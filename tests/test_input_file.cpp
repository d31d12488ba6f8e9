// Reading an input file whole, within a bound: a file up to the bound is read as it is, one
// byte more is refused naming it, before it is read; a device that never ends is refused
// as soon as it passes the bound.
#include "core/input_file.hpp"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "sluice/error.hpp"
#include "test_support.hpp"

namespace {

using sluice::detail::append_file_bytes;
using sluice::detail::read_file_bytes;
using InputFile = sluice::testing::TempDirTest;

TEST_F(InputFile, AFileUpToTheBoundIsReadAsItIsAndOneByteMoreIsRefused) {
  std::string bytes(3 << 20, '\0');  // several of the reader's chunks, NULs included
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + 3);
  const auto file = dir_ / "input.bin";
  std::ofstream(file, std::ios::binary) << bytes;
  EXPECT_EQ(read_file_bytes(file, bytes.size()), bytes);
  const std::string message = sluice::testing::thrown_message<sluice::ResourceError>(
      [&] { read_file_bytes(file, bytes.size() - 1); });
  EXPECT_CONTAINS(message, file.string() + ": more than " + std::to_string(bytes.size() - 1));
  // What is already held counts: two files appended share one bound.
  std::string text = "ab";
  EXPECT_THROW(append_file_bytes(file, text, bytes.size() + 1), sluice::ResourceError);
  EXPECT_EQ(text, "ab");  // refused before it was read
  append_file_bytes(file, text, bytes.size() + 2);
  EXPECT_EQ(text, "ab" + bytes);
}

TEST_F(InputFile, ADeviceThatNeverEndsIsRefusedAtTheBound) {
  EXPECT_CONTAINS(sluice::testing::thrown_message<sluice::ResourceError>(
                      [] { read_file_bytes("/dev/zero", std::size_t{5} << 20); }),
                  "/dev/zero: more than 5242880 bytes");
  EXPECT_CONTAINS(sluice::testing::thrown_message<sluice::IoError>(
                      [&] { read_file_bytes(dir_ / "missing", 100); }),
                  "missing");
  EXPECT_GT(sluice::detail::max_input_bytes(), 0U);
}

}  // namespace
