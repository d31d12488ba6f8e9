// The model store's state files (src/model_memory/model_store_files.hpp): a file large
// enough that its writer takes the direct-I/O path, written by ranges that start and end
// inside 4 KiB blocks, reads back bit for bit with every section's CRC, as the
// page-cache path (a small file) does; a file left unfinished is removed.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <random>
#include <vector>

#include "model_memory/model_store_files.hpp"
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

}  // namespace
}  // namespace sluice
