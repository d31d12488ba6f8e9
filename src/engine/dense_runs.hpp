#pragma once
// The dense path's intake (docs/dense_path.md): the stream's chunks taken in with the
// checks that need their order, cut into groups of whole chunks (one per task), and each
// group's runs walked in its task: a chunk checked (check_chunk, the stream scan) as it
// is reached, then, where a product needs the weights, its runs written whole (zeros
// between them, each slot once) into the rows of a dense tile while the chunk is in cache.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "sluice/engine.hpp"
#include "sluice/stream.hpp"

namespace sluice::detail {

/// Where a run of the stream's matrix lies: packets [begin, end) of chunk `chunk` (its
/// carriage return at `end`).
struct RowRun {
  std::uint32_t chunk = 0, begin = 0, end = 0;
};

struct DenseStream {
  StreamHeader header;
  std::vector<ChunkPtr> chunks;
  /// Group g is chunks [group_start[g], group_start[g + 1]).
  std::vector<std::size_t> group_start;
  std::uint64_t packets = 0, bytes = 0;

  bool bf16() const { return header.precision == Precision::bf16; }
  std::size_t groups() const { return group_start.size() - 1; }

  /// Takes every chunk in, checks their order and counts (FormatError as the sparse path
  /// says it), and groups them by about `rows_per_group` runs.
  static DenseStream take(StreamSource& source, std::int64_t rows_per_group);
  /// After every group was walked, with the weights they held.
  void finish(std::uint64_t weights) const;
};

/// Walks one group's runs in order. T is the tile's element: float for an fp32 stream,
/// the 16 bits of a bf16 one. Throws FormatError (check_chunk's) at a faulty chunk.
template <typename T>
class RunWalker {
 public:
  RunWalker(const DenseStream& stream, std::size_t group);

  /// Up to `rows` more runs, from run first_row() on: written whole into tile rows `ld`
  /// apart (ld >= inputs; nothing past a row's inputs is written) where `tile` is given; their
  /// places into `runs`. Returns how many, 0 at the group's end.
  std::int64_t next(std::int64_t rows, T* tile, std::int64_t ld, RowRun* runs);
  /// The stream row the next call starts at.
  std::int64_t first_row() const { return row_; }
  std::uint64_t weights() const { return weights_; }

 private:
  const DenseStream& s_;
  std::size_t chunk_, end_chunk_;
  bool checked_ = false;                ///< chunk_ is checked, its returns_ found
  std::vector<std::uint32_t> returns_;  ///< chunk_'s carriage returns
  std::uint32_t run_in_chunk_ = 0;
  std::int64_t row_ = 0;
  std::uint64_t weights_ = 0;
};

extern template class RunWalker<float>;
extern template class RunWalker<std::uint16_t>;

}  // namespace sluice::detail
