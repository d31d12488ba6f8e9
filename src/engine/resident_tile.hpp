#pragma once
// How a lane holds its activation rows: which rows are its own (LaneLayout), and the
// resident copy of them, one token tile wide, that stays in its core's cache while the
// stream flows past (ResidentTile). Internal.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/huge_pages.hpp"
#include "engine/kernels/lane_kernels.hpp"
#include "sluice/dense.hpp"
#include "sluice/planner.hpp"

namespace sluice::detail {

/// Which activation rows each lane keeps resident, and where: lane p packs its rows
/// (in increasing feature order) into a buffer of its own, so its tile is contiguous and
/// stays in its core's cache without set conflicts from the matrix's row stride.
struct LaneLayout {
  std::vector<std::vector<std::uint32_t>> rows;  // rows[p]: global features of lane p
  std::vector<std::uint32_t> local;  // local[i]: row of feature i in its lane (lanes > 1)

  // Built for every product, so built in passes that do not grow vectors (a push per
  // feature is a visible part of a very sparse product).
  explicit LaneLayout(const Placement& placement) : rows(placement.lanes) {
    const std::size_t n = placement.lane_of.size();
    if (placement.lanes == 1) {  // every feature in order; one lane routes nothing
      rows[0].resize(n);
      std::iota(rows[0].begin(), rows[0].end(), 0U);
      return;
    }
    std::vector<std::uint32_t> counts(rows.size(), 0);
    for (const std::int32_t lane : placement.lane_of) ++counts[lane];
    for (std::size_t p = 0; p < rows.size(); ++p) rows[p].resize(counts[p]);
    std::fill(counts.begin(), counts.end(), 0U);
    local.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::int32_t lane = placement.lane_of[i];
      local[i] = counts[lane]++;
      rows[lane][local[i]] = static_cast<std::uint32_t>(i);
    }
  }
};

/// Memory for a lane's resident tile: 2 MiB aligned and backed by huge pages where the
/// kernel allows, because a lane reads its tile at random rows and 4 KiB pages would
/// cost a TLB miss on most of those reads.
class HugePageBuffer {
 public:
  HugePageBuffer() = default;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;
  ~HugePageBuffer() { std::free(data_); }

  float* data() const { return data_; }
  std::size_t size() const { return size_; }
  void reserve(std::size_t floats) {
    if (floats <= size_) return;
    const std::size_t bytes = whole_huge_pages(floats * sizeof(float));
    void* p = allocate_huge_pages(bytes);
    std::free(data_);
    data_ = static_cast<float*>(p);
    size_ = bytes / sizeof(float);
  }

 private:
  float* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A lane's resident copy of its rows of a matrix, one token tile wide, in fp32 or (for
/// a bf16 stream's activations) bf16. The memory is the running thread's own and
/// outlives the call: allocating and faulting in fresh pages for every layer would cost
/// more than a small layer's whole product. (A lane task never waits for another lane,
/// so one thread holds one lane's tile at a time.)
class ResidentTile {
 public:
  ResidentTile() : data_(thread_buffer()) {}

  void resize(std::size_t rows, std::int64_t tile, Precision precision = Precision::fp32) {
    const bool bf16 = precision == Precision::bf16;
    // A one-token tile is one contiguous column (in L1), not a 64-byte line per element.
    const std::int64_t align = bf16 ? kBf16RowAlign : tile == 1 ? 1 : 16;
    stride_ = static_cast<std::size_t>((tile + align - 1) / align * align);
    data_.reserve(bf16 ? (rows * stride_ + 1) / 2 : rows * stride_);
    rows_ = rows;
  }
  void load(const std::vector<std::uint32_t>& rows, const float* src, std::int64_t src_stride,
            std::int64_t t0, std::int64_t width) {
    for (std::size_t l = 0; l < rows.size(); ++l) {
      std::memcpy(data_.data() + l * stride_, src + rows[l] * src_stride + t0,
                  sizeof(float) * width);
    }
  }
  /// Rounds the rows to bf16 and pads each with zeros to the stride.
  void load_bf16(const std::vector<std::uint32_t>& rows, const float* src, std::int64_t src_stride,
                 std::int64_t t0, std::int64_t width, const Bf16LaneKernels& kernels) {
    auto* dst = reinterpret_cast<std::uint16_t*>(data_.data());
    for (std::size_t l = 0; l < rows.size(); ++l) {
      // Rows asked for ahead: the rounding is work enough to hide their misses behind (a
      // plain copy of fp32 rows gains nothing from it).
      if (l + 8 < rows.size()) {
        const float* ahead = src + rows[l + 8] * src_stride + t0;
        for (std::int64_t f = 0; f < width; f += 16) __builtin_prefetch(ahead + f, 0, 3);
      }
      kernels.pack(src + rows[l] * src_stride + t0, dst + l * stride_, width,
                   static_cast<std::int64_t>(stride_));
    }
  }
  void zero(std::int64_t width) {
    for (std::size_t l = 0; l < rows_; ++l) std::fill_n(data_.data() + l * stride_, width, 0.0F);
  }
  void store(const std::vector<std::uint32_t>& rows, float* dst, std::int64_t dst_stride,
             std::int64_t t0, std::int64_t width) const {
    for (std::size_t l = 0; l < rows.size(); ++l) {
      std::memcpy(dst + rows[l] * dst_stride + t0, data_.data() + l * stride_,
                  sizeof(float) * width);
    }
  }
  Tile tile() const { return {data_.data(), static_cast<std::int64_t>(stride_)}; }
  MutableTile mutable_tile() { return {data_.data(), static_cast<std::int64_t>(stride_)}; }
  Bf16Tile bf16_tile() const {
    return {reinterpret_cast<const std::uint16_t*>(data_.data()),
            static_cast<std::int64_t>(stride_)};
  }

 private:
  static HugePageBuffer& thread_buffer() {
    thread_local HugePageBuffer buffer;
    return buffer;
  }
  HugePageBuffer& data_;
  std::size_t rows_ = 0, stride_ = 16;
};

}  // namespace sluice::detail

namespace sluice::detail {

/// How a lane holds its rows of a layer's activations for its kernels: read where they
/// are, or copied into its resident tile in fp32 or rounded to bf16.
enum class Hold : std::uint8_t { in_place, fp32, bf16 };

/// A tile of activation rows as a lane's kernels read them: `fp32` (resident or in
/// place) unless held in bf16, then `bf16` (resident).
struct HeldTile {
  Tile fp32{nullptr, 0};
  Bf16Tile bf16{nullptr, 0};
};

/// A lane's rows of an activation matrix, held as its plan says, one tile at a time.
class HeldRows {
 public:
  HeldRows(Hold hold, const std::vector<std::uint32_t>& rows, ConstMatrixView src,
           std::int64_t tile, const Bf16LaneKernels& bf16_kernels)
      : hold_(hold), rows_(rows), src_(src), bf16_kernels_(bf16_kernels) {
    if (hold != Hold::in_place) {
      resident_.resize(rows.size(), tile, hold == Hold::bf16 ? Precision::bf16 : Precision::fp32);
    }
  }
  /// Tokens [t0, t0 + width) of the lane's rows.
  HeldTile hold(std::int64_t t0, std::int64_t width) {
    switch (hold_) {
      case Hold::bf16:
        resident_.load_bf16(rows_, src_.data, src_.stride, t0, width, bf16_kernels_);
        return {{nullptr, 0}, resident_.bf16_tile()};
      case Hold::fp32:
        resident_.load(rows_, src_.data, src_.stride, t0, width);
        return {resident_.tile(), {nullptr, 0}};
      case Hold::in_place:
        break;
    }
    return {{src_.data + t0, src_.stride}, {nullptr, 0}};
  }

 private:
  Hold hold_;
  const std::vector<std::uint32_t>& rows_;
  ConstMatrixView src_;
  const Bf16LaneKernels& bf16_kernels_;
  ResidentTile resident_;
};

}  // namespace sluice::detail
