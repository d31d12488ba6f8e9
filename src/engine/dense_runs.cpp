#include "engine/dense_runs.hpp"

#include <algorithm>
#include <type_traits>

#include "engine/kernels/densify.hpp"
#include "sluice/error.hpp"
#include "stream/stream_check.hpp"

namespace sluice::detail {
namespace {

bool ends_layer(const StreamChunk& chunk) {
  if (!chunk.packets.empty()) return chunk.packets.back().tag == kEndOfLayer;
  return !chunk.packets_bf16.empty() && tag_of(chunk.packets_bf16.back()) == kEndOfLayer;
}

template <typename P>
const P* packets_of(const StreamChunk& chunk) {
  if constexpr (std::is_same_v<P, Packet>) {
    return chunk.packets.data();
  } else {
    return chunk.packets_bf16.data();
  }
}

}  // namespace

DenseStream DenseStream::take(StreamSource& source, std::int64_t rows_per_group) {
  DenseStream s;
  s.header = source.header();
  check_header(s.header);
  std::uint64_t outputs = 0;
  bool ended = false;
  std::int64_t group_rows = 0;
  while (ChunkPtr chunk = source.next()) {
    check_sequence(s.header, *chunk, s.chunks.size(), outputs, ended);
    ended = ends_layer(*chunk);
    if (s.chunks.empty() || group_rows >= rows_per_group) {
      s.group_start.push_back(s.chunks.size());
      group_rows = 0;
    }
    group_rows += chunk->outputs;
    outputs += chunk->outputs;
    s.packets += chunk->size();
    s.bytes += chunk->byte_size();
    s.chunks.push_back(std::move(chunk));
  }
  s.group_start.push_back(s.chunks.size());
  if (s.chunks.empty()) s.group_start.push_back(0);  // one empty group
  // The weights are counted as the groups walk them: finish() checks them.
  check_finished(s.header, outputs, s.header.nnz, ended);
  return s;
}

void DenseStream::finish(std::uint64_t weights) const {
  check_finished(header, header.outputs, weights, true);
}

template <typename T>
RunWalker<T>::RunWalker(const DenseStream& stream, std::size_t group)
    : s_(stream), chunk_(stream.group_start[group]), end_chunk_(stream.group_start[group + 1]) {
  if (chunk_ < end_chunk_) row_ = s_.chunks[chunk_]->first_output;
}

template <typename T>
std::int64_t RunWalker<T>::next(std::int64_t rows, T* tile, std::int64_t ld, RowRun* runs) {
  using P = std::conditional_t<std::is_same_v<T, float>, Packet, Bf16Packet>;
  const DensifyKernels& kernels = densify_kernels();
  std::int64_t n = 0;
  while (n < rows && chunk_ < end_chunk_) {
    const StreamChunk& chunk = *s_.chunks[chunk_];
    if (!checked_) {
      returns_.resize(chunk.outputs);
      weights_ += check_chunk(s_.header, chunk, chunk_, returns_.data()).weights;
      checked_ = true;
    }
    if (run_in_chunk_ == chunk.outputs) {
      ++chunk_;
      run_in_chunk_ = 0;
      checked_ = false;
      continue;
    }
    const std::uint32_t begin = run_in_chunk_ == 0 ? 0 : returns_[run_in_chunk_ - 1] + 1;
    const std::uint32_t end = returns_[run_in_chunk_];
    if (tile != nullptr) {
      const P* p = packets_of<P>(chunk) + begin;
      if constexpr (std::is_same_v<T, float>) {
        kernels.fp32(p, end - begin, tile + n * ld, s_.header.inputs);
      } else {
        kernels.bf16(p, end - begin, tile + n * ld, s_.header.inputs);
      }
    }
    runs[n] = {static_cast<std::uint32_t>(chunk_), begin, end};
    ++run_in_chunk_;
    ++row_;
    ++n;
  }
  return n;
}

template class RunWalker<float>;
template class RunWalker<std::uint16_t>;

}  // namespace sluice::detail
