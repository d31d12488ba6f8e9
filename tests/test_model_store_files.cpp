// The model store's state files (src/model_memory/model_store_files.hpp): a file large
// enough that its writer takes the direct-I/O path, written by ranges that start and end
// inside 4 KiB blocks, reads back bit for bit with every section's CRC, as the
// page-cache path (a small file) does; a file left unfinished is removed. DirectInput
// (direct_input.hpp) reads byte ranges back exactly, with their CRC, into memory at any
// place or at the file's place in a block, up to and past the file's end; on tmpfs as on
// the temporary directory's file system (tmpfs refuses O_DIRECT before Linux 6.6), and under
// SLUICE_DIRECT_IO=0 (a second registration of this test) through the page cache only.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <bit>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/crc32.hpp"
#include "model_memory/direct_input.hpp"
#include "model_memory/model_store_files.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::TempDirTest;

class StateFiles : public TempDirTest {
 protected:
  /// Writes a state file of `nnz` values and two slots by ranges of `range` floats, reads
  /// it back by ranges of another length, and compares every float's bits.
  void round_trip(std::int64_t nnz, std::int64_t range) {
    const std::int64_t bias = 37;
    const detail::StateLayout layout = detail::StateLayout::of(nnz, bias, 2);
    std::mt19937 rng(static_cast<std::uint32_t>(nnz));
    std::uniform_real_distribution<float> u(-1.0F, 1.0F);
    std::vector<std::vector<float>> sections(6);
    for (int i = 0; i < 6; ++i) {
      sections[i].resize(static_cast<std::size_t>(i == 1 || i >= 4 ? bias : nnz));
      for (float& x : sections[i]) x = u(rng);
    }
    const auto path = dir_ / "layer.state";
    detail::IoCounters io;
    {
      detail::StateWriter out(path, layout, io);
      for (std::int64_t lo = 0; lo < nnz;
           lo += range) {  // the sections interleaved, as an update writes them
        const auto n = static_cast<std::size_t>(std::min(range, nnz - lo));
        for (int i : {0, 2, 3}) out.write(i, lo, std::span(sections[i]).subspan(lo, n));
      }
      for (int i : {1, 4, 5}) out.write(i, 0, sections[i]);
      out.finish();
    }
    ASSERT_EQ(std::filesystem::file_size(path), layout.size);
    detail::StateReader in(path, layout, io);
    const std::int64_t read_range = range / 3 + 5;
    const std::uint64_t at[6] = {layout.values,   layout.bias_at,       layout.state[0],
                                 layout.state[1], layout.bias_state[0], layout.bias_state[1]};
    for (int i = 0; i < 6; ++i) {
      const auto n = static_cast<std::int64_t>(sections[i].size());
      std::vector<float> back(sections[i].size());
      std::uint32_t crc = 0;
      for (std::int64_t lo = 0; lo < n; lo += read_range) {
        const auto k = static_cast<std::size_t>(std::min(read_range, n - lo));
        in.read(at[i], lo, std::span(back).subspan(lo, k), crc);
      }
      EXPECT_NO_THROW(in.check_crc(at[i], crc, "section"));
      for (std::size_t k = 0; k < back.size(); ++k) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(back[k]),
                  std::bit_cast<std::uint32_t>(sections[i][k]))
            << "section " << i << ", element " << k;
      }
    }
  }
};

TEST_F(StateFiles, ALargeFileWrittenDirectReadsBackBitForBit) {
  // 12 MB: over the direct path's threshold; ranges of an odd length, so most start and
  // end inside a block, and several longer than the writer's aligned buffer.
  round_trip(1'000'003, 1'300'001);
  round_trip(1'000'003, 65'537);
}

TEST_F(StateFiles, ASmallFileGoesThroughThePageCacheAlike) {
  round_trip(1'001, 97);
}

/// Reads ranges of a file of random bytes a little over 13 MB (more than the bounce
/// buffer, a partial last block) and checks bytes, CRC and the count read.
void read_ranges_back(const std::filesystem::path& dir) {
  const std::size_t size = (std::size_t{13} << 20) + 12'345;
  std::vector<std::byte> file(size);
  std::mt19937_64 rng(7);
  for (auto& b : file) b = static_cast<std::byte>(rng());
  const auto path = dir / "bytes";
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, file.data(), size), static_cast<ssize_t>(size));
    ::close(fd);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  detail::DirectInput in(fd, path, "test");
  struct Range {
    std::uint64_t at;
    std::size_t size;
    bool in_place;  ///< into memory at the file's phase
  };
  const Range ranges[] = {{0, size, false},
                          {100, (std::size_t{5} << 20) + 7, false},
                          {3 * 4096 + 64, (std::size_t{9} << 19) + 3, true},
                          {4096, std::size_t{1} << 20, true},
                          {size - 300'000, 600'000, false},
                          {size - 500'001, std::size_t{1} << 20, true},
                          {size - 10, 1 << 18, true},
                          {size, 1 << 18, false}};
  for (const Range& r : ranges) {
    detail::PhasedBuffer<std::byte> buffer(r.size,
                                           detail::direct_phase(r.at + (r.in_place ? 0 : 8)));
    std::uint32_t crc = 5;
    const std::size_t n = in.read(r.at, buffer.span(), crc);
    const std::size_t want = std::min<std::size_t>(r.size, size - r.at);
    ASSERT_EQ(n, want) << "at " << r.at;
    const auto expected = std::span(file).subspan(r.at, want);
    EXPECT_EQ(crc, crc32(expected, 5)) << "at " << r.at;
    for (std::size_t i = 0; i < want; ++i) {
      ASSERT_EQ(buffer.data()[i], expected[i]) << "at " << r.at << ", byte " << i;
    }
  }
  const int direct = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  EXPECT_EQ(in.direct(), direct >= 0 && detail::direct_io_enabled());
  if (direct >= 0) ::close(direct);
  ::close(fd);
}

TEST_F(StateFiles, DirectInputReadsRangesBackExactly) {
  read_ranges_back(dir_);
}

TEST_F(StateFiles, DirectInputReadsRangesBackExactlyOnTmpfs) {
  const std::filesystem::path shm = "/dev/shm";
  if (!std::filesystem::is_directory(shm)) GTEST_SKIP() << "no /dev/shm";
  const auto dir = shm / dir_.filename();
  std::filesystem::create_directories(dir);
  read_ranges_back(dir);
  std::filesystem::remove_all(dir);
}

TEST_F(StateFiles, AnUnfinishedFileIsRemoved) {
  const auto path = dir_ / "layer.state";
  detail::IoCounters io;
  {
    detail::StateWriter out(path, detail::StateLayout::of(400'000, 3, 0), io);
    std::vector<float> v(400'000, 1.0F);
    out.write(0, 0, v);
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

/// The file size limit at `bytes` (writes past it fail with EFBIG, as on a full disk, with
/// SIGXFSZ ignored) while it lives.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) : old_signal_(std::signal(SIGXFSZ, SIG_IGN)) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    const rlimit limit{bytes, old_.rlim_max};
    ::setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_signal_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  void (*old_signal_)(int);
};

// A manifest or pattern that cannot be written whole leaves no file behind: the manifest
// before it stays, and neither its temporary file nor a pattern's part remains.
TEST_F(StateFiles, AManifestOrPatternNotWrittenWholeLeavesNoFile) {
  detail::Manifest m;
  detail::write_manifest(dir_, m);
  const std::string before = testing::read_file((dir_ / "MANIFEST").string());
  m.class_names.assign(20000, "");
  for (std::size_t c = 0; c < m.class_names.size(); ++c) m.class_names[c] = std::to_string(c);
  const CsrMatrix mask = CsrMatrix::random(300, 300, 0.5, 1);
  {
    const FileSizeLimit limit(4096);
    EXPECT_THROW(detail::write_manifest(dir_, m), IoError);
    EXPECT_THROW(detail::write_pattern(dir_ / "layer.pattern", mask, transposed_pattern(mask)),
                 IoError);
  }
  EXPECT_EQ(testing::read_file((dir_ / "MANIFEST").string()), before);
  EXPECT_FALSE(std::filesystem::exists(dir_ / "MANIFEST.tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir_ / "layer.pattern"));
}

}  // namespace
}  // namespace sluice
