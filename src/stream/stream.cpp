#include "sluice/stream.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <type_traits>

#include "core/crc32.hpp"
#include "engine/kernels/stream_scan.hpp"
#include "sluice/error.hpp"
#include "sluice/isa.hpp"
#include "stream/stream_check.hpp"

namespace sluice {

const char* to_string(StreamKind kind) {
  switch (kind) {
    case StreamKind::weights:
      return "weights";
    case StreamKind::mask:
      return "mask";
    case StreamKind::gradient:
      return "gradient";
  }
  return "unknown";
}

const char* to_string(StreamOrder order) {
  switch (order) {
    case StreamOrder::by_output:
      return "by_output";
    case StreamOrder::by_input:
      return "by_input";
  }
  return "unknown";
}

namespace detail {

std::string describe_chunk(const StreamChunk& chunk, std::uint64_t chunk_index) {
  return "stream chunk " + std::to_string(chunk_index) + " (outputs " +
         std::to_string(chunk.first_output) + ".." +
         std::to_string(std::uint64_t{chunk.first_output} + chunk.outputs) + ")";
}

namespace {

/// The vectorised scan for this CPU (capped by SLUICE_ISA, so tests reach the others).
const StreamScan& scan() {
  static const StreamScan& chosen = stream_scan(default_isa());
  return chosen;
}
bool scan_chunk(const Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
                bool check_values, std::uint32_t* carriage_returns) {
  return scan().fp32(p, n, inputs, outputs, check_values, carriage_returns);
}
bool scan_chunk(const Bf16Packet* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
                bool check_values, std::uint32_t* carriage_returns) {
  return scan().bf16(p, n, inputs, outputs, check_values, carriage_returns);
}

template <typename PacketT>
ChunkFacts check_packets(const StreamHeader& header, const StreamChunk& chunk,
                         std::span<const PacketT> packets, std::uint64_t chunk_index,
                         std::uint32_t* carriage_returns) {
  auto fail = [&](std::size_t k, const std::string& what) {
    throw FormatError(describe_chunk(chunk, chunk_index) + ", packet " + std::to_string(k) + ": " +
                      what);
  };
  const bool check_values = header.kind != StreamKind::mask;
  ChunkFacts facts;
  const PacketT* p = packets.data();
  const std::size_t n = packets.size();
  // Well-formed chunks (all but corrupt ones) pass the vectorised scan; only a chunk it
  // does not accept goes packet by packet below, to say what is wrong and where.
  if (scan_chunk(p, n, header.inputs, chunk.outputs, check_values, carriage_returns)) {
    facts.ends_layer = n > 0 && tag_of(p[n - 1]) == kEndOfLayer;
    facts.weights = n - chunk.outputs - (facts.ends_layer ? 1 : 0);
    return facts;
  }
  std::uint64_t closed = 0;
  std::int64_t previous = -1;  // last input index in the current output
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint32_t tag = tag_of(p[k]);
    if ((tag & kControlBit) == 0) {
      if (tag >= header.inputs) {
        fail(k, "input index " + std::to_string(tag) + " out of range (layer has " +
                    std::to_string(header.inputs) + " inputs)");
      }
      if (static_cast<std::int64_t>(tag) <= previous) {
        fail(k, "input index " + std::to_string(tag) +
                    (tag == previous ? " repeated" : " unsorted") + " in output " +
                    std::to_string(chunk.first_output + closed) +
                    " (indices must increase within an output)");
      }
      if (check_values && !std::isfinite(value_of(p[k]))) {
        fail(k, "non-finite value in output " + std::to_string(chunk.first_output + closed));
      }
      if (closed == chunk.outputs) {
        fail(k, "weight after the chunk's last carriage return (missing carriage return?)");
      }
      previous = tag;
      ++facts.weights;
    } else if (tag == kCarriageReturn) {
      if (closed == chunk.outputs) {
        fail(k, "more carriage returns than the chunk's " + std::to_string(chunk.outputs) +
                    " outputs");
      }
      if (carriage_returns != nullptr) carriage_returns[closed] = static_cast<std::uint32_t>(k);
      ++closed;
      previous = -1;
    } else if (tag == kEndOfLayer) {
      if (k + 1 != n) fail(k, "packets after end-of-layer");
      if (previous != -1) fail(k, "end-of-layer before the last output's carriage return");
      facts.ends_layer = true;
    } else {
      fail(
          k, "unknown control packet 0x" + [&] {
            char buf[16];
            std::snprintf(buf, sizeof buf, "%08x", tag);
            return std::string(buf);
          }());
    }
  }
  if (closed != chunk.outputs) {
    throw FormatError(describe_chunk(chunk, chunk_index) + ": " + std::to_string(closed) +
                      " carriage returns for " + std::to_string(chunk.outputs) +
                      " outputs (truncated or missing carriage return)");
  }
  return facts;
}

}  // namespace

void check_header(const StreamHeader& header) {
  if (header.kind != StreamKind::weights && header.kind != StreamKind::mask &&
      header.kind != StreamKind::gradient) {
    throw FormatError("stream header: unknown kind " +
                      std::to_string(static_cast<std::uint32_t>(header.kind)));
  }
  if (header.precision != Precision::fp32 && header.precision != Precision::bf16) {
    throw FormatError("stream header: unknown precision " +
                      std::to_string(static_cast<std::uint32_t>(header.precision)));
  }
  if (header.order != StreamOrder::by_output && header.order != StreamOrder::by_input) {
    throw FormatError("stream header: unknown order " +
                      std::to_string(static_cast<std::uint32_t>(header.order)));
  }
  if (header.precision == Precision::bf16 && header.kind == StreamKind::gradient) {
    throw FormatError("stream header: gradient streams are fp32, this one says bf16");
  }
  if (header.precision == Precision::bf16 && header.inputs > kMaxBf16Inputs) {
    throw FormatError("stream header: a bf16 stream addresses at most " +
                      std::to_string(kMaxBf16Inputs) + " inputs, this one says " +
                      std::to_string(header.inputs));
  }
}

ChunkFacts check_chunk(const StreamHeader& header, const StreamChunk& chunk,
                       std::uint64_t chunk_index, std::uint32_t* carriage_returns) {
  const bool bf16 = header.precision == Precision::bf16;
  if (bf16 ? !chunk.packets.empty() : !chunk.packets_bf16.empty()) {
    throw FormatError(describe_chunk(chunk, chunk_index) + ": carries " + (bf16 ? "fp32" : "bf16") +
                      " packets in a " + to_string(header.precision) + " stream");
  }
  if (bf16) {
    return check_packets<Bf16Packet>(header, chunk, chunk.packets_bf16, chunk_index,
                                     carriage_returns);
  }
  return check_packets<Packet>(header, chunk, chunk.packets, chunk_index, carriage_returns);
}

void check_sequence(const StreamHeader& header, const StreamChunk& chunk, std::uint64_t chunk_index,
                    std::uint64_t outputs_closed, bool ended) {
  if (ended) {
    throw FormatError(describe_chunk(chunk, chunk_index) + ": data after end-of-layer");
  }
  if (chunk.first_output != outputs_closed) {
    throw FormatError(describe_chunk(chunk, chunk_index) + ": expected first output " +
                      std::to_string(outputs_closed) + " (chunk lost or out of order)");
  }
  if (std::uint64_t{chunk.first_output} + chunk.outputs > header.outputs) {
    throw FormatError(describe_chunk(chunk, chunk_index) + ": layer has only " +
                      std::to_string(header.outputs) + " outputs");
  }
}

void check_finished(const StreamHeader& header, std::uint64_t outputs_closed, std::uint64_t weights,
                    bool ended) {
  if (!ended) {
    throw FormatError("stream ended without end-of-layer after " + std::to_string(outputs_closed) +
                      " of " + std::to_string(header.outputs) + " outputs (truncated)");
  }
  if (outputs_closed != header.outputs) {
    throw FormatError("stream closed " + std::to_string(outputs_closed) + " outputs, header says " +
                      std::to_string(header.outputs));
  }
  if (weights != header.nnz) {
    throw FormatError("stream carried " + std::to_string(weights) + " weights, header says " +
                      std::to_string(header.nnz));
  }
}

}  // namespace detail

StreamValidator::StreamValidator(const StreamHeader& header) : header_(header) {
  detail::check_header(header);
}

void StreamValidator::check(const StreamChunk& chunk) {
  detail::check_sequence(header_, chunk, chunks_seen_, outputs_closed_, ended_);
  const detail::ChunkFacts facts = detail::check_chunk(header_, chunk, chunks_seen_);
  ++chunks_seen_;
  outputs_closed_ += chunk.outputs;
  weights_seen_ += facts.weights;
  ended_ = facts.ends_layer;
  if (weights_seen_ > header_.nnz) {
    throw FormatError("stream carries more than the header's " + std::to_string(header_.nnz) +
                      " weights (at chunk " + std::to_string(chunks_seen_ - 1) + ")");
  }
}

void StreamValidator::finish() const {
  detail::check_finished(header_, outputs_closed_, weights_seen_, ended_);
}

void WeightStream::validate() const {
  StreamValidator validator(header);
  for (const ChunkPtr& chunk : chunks) {
    if (!chunk) throw FormatError("stream has a missing (null) chunk");
    validator.check(*chunk);
  }
  validator.finish();
}

std::uint64_t WeightStream::packet_count() const {
  std::uint64_t n = 0;
  for (const ChunkPtr& chunk : chunks) n += chunk->size();
  return n;
}

std::uint64_t WeightStream::byte_size() const {
  std::uint64_t n = 0;
  for (const ChunkPtr& chunk : chunks) n += chunk->byte_size();
  return n;
}

StreamHeader stream_header_for(const CsrMatrix& matrix, StreamKind kind, Precision precision,
                               StreamOrder order) {
  return stream_header_for(matrix.rows(), matrix.cols(), matrix.nnz(), kind, precision, order);
}

StreamHeader stream_header_for(std::int64_t rows, std::int64_t cols, std::int64_t nnz,
                               StreamKind kind, Precision precision, StreamOrder order) {
  if (order != StreamOrder::by_output && order != StreamOrder::by_input) {
    throw ShapeError("encode: unknown order " + std::to_string(static_cast<std::uint32_t>(order)));
  }
  const bool by_input = order == StreamOrder::by_input;
  // The stream's runs and tags: the layer's outputs and inputs, or the other way round.
  const std::int64_t runs = by_input ? cols : rows;
  const std::int64_t tags = by_input ? rows : cols;
  if (runs > 0xFFFF'FFFFLL || tags >= kControlBit) {
    throw ShapeError("matrix too large for a stream " + std::string(to_string(order)) + ": " +
                     std::to_string(rows) + "x" + std::to_string(cols));
  }
  if (kind != StreamKind::weights && kind != StreamKind::mask) {
    throw ShapeError(
        "encode: weights and masks are encoded; a gradient stream comes from an "
        "engine");
  }
  if (precision != Precision::fp32 && precision != Precision::bf16) {
    throw ShapeError("encode: unknown precision " +
                     std::to_string(static_cast<std::uint32_t>(precision)));
  }
  if (precision == Precision::bf16 && tags > kMaxBf16Inputs) {
    throw ShapeError("a bf16 stream addresses at most " + std::to_string(kMaxBf16Inputs) + " " +
                     (by_input ? "outputs (its tags by input)" : "inputs") + "; this layer has " +
                     std::to_string(tags) + " (stream it in fp32)");
  }
  return {kind,
          static_cast<std::uint32_t>(runs),
          static_cast<std::uint32_t>(tags),
          static_cast<std::uint64_t>(nnz),
          precision,
          order};
}

namespace {

std::int64_t chunk_end(const std::vector<std::int64_t>& offsets, std::int64_t first,
                       std::size_t chunk_packets) {
  const auto runs = static_cast<std::int64_t>(offsets.size()) - 1;
  if (chunk_packets == 0) throw ShapeError("chunk_end: chunks of 0 packets");
  if (first < 0 || first > runs) {
    throw ShapeError("chunk_end: output " + std::to_string(first) + " outside the matrix's " +
                     std::to_string(runs));
  }
  std::int64_t last = first;
  std::size_t packets = 0;
  while (last < runs) {
    const auto need = static_cast<std::size_t>(offsets[last + 1] - offsets[last]) + 1;
    if (last > first && packets + need > chunk_packets) break;
    packets += need;
    ++last;
  }
  return last;
}

}  // namespace

std::int64_t chunk_end(const CsrMatrix& matrix, std::int64_t first, std::size_t chunk_packets) {
  return chunk_end(matrix.row_offsets(), first, chunk_packets);
}
std::int64_t chunk_end(const TransposedPattern& transposed, std::int64_t first,
                       std::size_t chunk_packets) {
  return chunk_end(transposed.row_offsets, first, chunk_packets);
}

namespace {

// Packet makers. Neither throws, so the encoding loop vectorises (a check per weight that
// could throw kept the compiler from vectorising the bf16 loop): a bf16 weight too large
// for bf16 only sets `overflow`.
Packet make_packet(std::uint32_t index, float value, std::uint32_t& /*overflow*/) {
  return {index, value};
}
/// A finite weight that rounded to bf16's infinity (`rounded` is to_bf16(value)).
bool overflows_bf16(float value, std::uint16_t rounded) {
  const bool finite = (std::bit_cast<std::uint32_t>(value) & 0x7F80'0000U) != 0x7F80'0000U;
  return finite && (rounded & 0x7F80U) == 0x7F80U;
}
Bf16Packet make_bf16_packet(std::uint32_t index, float value, std::uint32_t& overflow) {
  const std::uint16_t rounded = to_bf16(value);
  overflow |= static_cast<std::uint32_t>(overflows_bf16(value, rounded));
  return {static_cast<std::uint16_t>(index), rounded};
}

/// The rows of a CSR pattern as a stream's runs: its offsets and tags, and each
/// non-zero's value by position (`value(k)`).
template <typename Value>
struct RunSource {
  const std::vector<std::int64_t>& offsets;
  const std::uint32_t* tags;
  Value value;
  std::int64_t runs() const { return static_cast<std::int64_t>(offsets.size()) - 1; }
};

// Runs [first, last) as packets made by `make`, each closed by a carriage return, and
// end-of-layer after the last run.
template <typename PacketT, typename Make, typename Value>
void fill_chunk(std::vector<PacketT, ChunkAllocator<PacketT>>& out, const RunSource<Value>& rows,
                bool send_values, std::int64_t first, std::int64_t last, Make make,
                PacketT carriage_return, PacketT end_of_layer) {
  const auto& offsets = rows.offsets;
  const bool ends = last == rows.runs();
  out.resize(static_cast<std::size_t>(offsets[last] - offsets[first] + (last - first)) +
             (ends ? 1 : 0));
  PacketT* p = out.data();
  std::uint32_t overflow = 0;
  for (std::int64_t row = first; row < last; ++row) {
    const std::int64_t end = offsets[row + 1];
    for (std::int64_t k = offsets[row]; k < end; ++k) {
      *p++ = make(rows.tags[k], send_values ? rows.value(k) : 0.0F, overflow);
    }
    *p++ = carriage_return;
  }
  if (ends) *p++ = end_of_layer;
  if (overflow != 0) {  // only bf16 sets it: name the first such weight
    for (std::int64_t row = first; row < last; ++row) {
      for (std::int64_t k = offsets[row]; k < offsets[row + 1]; ++k) {
        const float value = rows.value(k);
        if (overflows_bf16(value, to_bf16(value))) {
          throw ShapeError("weight " + std::to_string(value) + " at (" + std::to_string(row) +
                           ", " + std::to_string(rows.tags[k]) + ") is too large for bf16");
        }
      }
    }
  }
}

// (A function, not aggregate deduction, which Clang 14 — the fuzz builds' compiler — lacks.)
template <typename Value>
RunSource<Value> run_source(const std::vector<std::int64_t>& offsets, const std::uint32_t* tags,
                            Value value) {
  return {offsets, tags, value};
}

template <typename Value>
ChunkPtr encode_runs(const RunSource<Value>& rows, StreamKind kind, std::int64_t first,
                     std::int64_t last, Precision precision) {
  if (first < 0 || last < first || last > rows.runs()) {
    throw ShapeError("encode_chunk: outputs [" + std::to_string(first) + ", " +
                     std::to_string(last) + ") outside the matrix's " +
                     std::to_string(rows.runs()));
  }
  auto chunk = std::make_shared<StreamChunk>();
  chunk->first_output = static_cast<std::uint32_t>(first);
  chunk->outputs = static_cast<std::uint32_t>(last - first);
  const bool send_values = kind == StreamKind::weights;
  if (precision == Precision::bf16) {
    fill_chunk(chunk->packets_bf16, rows, send_values, first, last, make_bf16_packet,
               bf16_control(kCarriageReturn), bf16_control(kEndOfLayer));
  } else {
    fill_chunk(chunk->packets, rows, send_values, first, last, make_packet,
               Packet{kCarriageReturn, 0.0F}, Packet{kEndOfLayer, 0.0F});
  }
  return chunk;
}

auto runs_of(const CsrMatrix& matrix) {
  const float* values = matrix.values().data();
  return run_source(matrix.row_offsets(), matrix.col_indices().data(),
                    [values](std::int64_t k) { return values[k]; });
}

auto runs_of(const TransposedPattern& transposed, std::span<const float> values) {
  const std::uint32_t* source = transposed.source.data();
  const float* layer = values.data();
  return run_source(transposed.row_offsets, transposed.col_indices.data(),
                    [source, layer](std::int64_t k) { return layer[source[k]]; });
}

}  // namespace

ChunkPtr encode_chunk(const CsrMatrix& matrix, StreamKind kind, std::int64_t first,
                      std::int64_t last, Precision precision) {
  return encode_runs(runs_of(matrix), kind, first, last, precision);
}

ChunkPtr encode_chunk(const TransposedPattern& transposed, std::span<const float> values,
                      StreamKind kind, std::int64_t first, std::int64_t last, Precision precision) {
  if (values.size() != transposed.source.size()) {
    throw ShapeError("encode_chunk: " + std::to_string(values.size()) + " values for a layer of " +
                     std::to_string(transposed.source.size()) + " non-zeros");
  }
  return encode_runs(runs_of(transposed, values), kind, first, last, precision);
}

WeightStream encode_stream(const CsrMatrix& matrix, StreamKind kind, std::size_t chunk_packets,
                           Precision precision, StreamOrder order) {
  WeightStream stream;
  stream.header = stream_header_for(matrix, kind, precision, order);
  auto encode = [&](const auto& rows) {
    std::int64_t first = 0;
    do {
      const std::int64_t last = chunk_end(rows.offsets, first, chunk_packets);
      stream.chunks.push_back(encode_runs(rows, kind, first, last, precision));
      first = last;
    } while (first < rows.runs());
  };
  if (order == StreamOrder::by_input) {
    const TransposedPattern transposed = transposed_pattern(matrix);
    encode(runs_of(transposed, matrix.values()));
  } else {
    encode(runs_of(matrix));
  }
  return stream;
}

CsrMatrix decode_stream(const WeightStream& stream) {
  stream.validate();
  std::vector<std::int64_t> offsets;
  offsets.reserve(stream.header.outputs + 1);
  offsets.push_back(0);
  std::vector<std::uint32_t> idx;
  std::vector<float> val;
  idx.reserve(stream.header.nnz);
  val.reserve(stream.header.nnz);
  auto take = [&](const auto& packets) {
    for (const auto& p : packets) {
      if (!is_control(p)) {
        idx.push_back(tag_of(p));
        val.push_back(value_of(p));
      } else if (tag_of(p) == kCarriageReturn) {
        offsets.push_back(static_cast<std::int64_t>(idx.size()));
      }
    }
  };
  for (const ChunkPtr& chunk : stream.chunks) {
    take(chunk->packets);
    take(chunk->packets_bf16);
  }
  CsrMatrix carried(stream.header.outputs, stream.header.inputs, std::move(offsets), std::move(idx),
                    std::move(val));
  return stream.header.by_input() ? transpose(carried) : carried;
}

// --- serialisation -------------------------------------------------------------------
// Little-endian. "SLWS" u32 version | u32 kind | u32 precision (version 2 on) | u32 order
// (version 3 on) | u32 outputs | u32 inputs | u64 nnz | u64 chunk count | u32 CRC-32 of all
// that | per chunk: u32 first_output | u32 outputs | u64 packet count | packets (fp32: u32
// tag, f32 value; bf16: u16 index, u16 value) | u32 CRC-32 of the chunk's fields and
// packets. Version 1 had no precision field and was always fp32, versions 1 and 2 no order
// and were always by output; both are still read.
namespace {

constexpr char kMagic[4] = {'S', 'L', 'W', 'S'};
constexpr std::uint32_t kVersion = 3;

template <typename T>
void put(std::vector<std::byte>& out, T v) {
  const auto* b = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), b, b + sizeof v);
}

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  void need(std::uint64_t n, const char* what) const {
    if (n > bytes_.size() - pos_) {
      throw FormatError("serialized stream truncated at byte " + std::to_string(pos_) +
                        " while reading " + what);
    }
  }
  const std::byte* here() const { return bytes_.data() + pos_; }
  void skip(std::size_t n) { pos_ += n; }
  std::size_t left() const { return bytes_.size() - pos_; }
  std::size_t pos() const { return pos_; }

 private:
  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
};

}  // namespace

std::vector<std::byte> serialize_stream(const WeightStream& stream) {
  std::vector<std::byte> out;
  out.reserve(48 + stream.byte_size() + stream.chunks.size() * 20);
  for (char c : kMagic) out.push_back(static_cast<std::byte>(c));
  put(out, kVersion);
  put(out, static_cast<std::uint32_t>(stream.header.kind));
  put(out, static_cast<std::uint32_t>(stream.header.precision));
  put(out, static_cast<std::uint32_t>(stream.header.order));
  put(out, stream.header.outputs);
  put(out, stream.header.inputs);
  put(out, stream.header.nnz);
  put(out, static_cast<std::uint64_t>(stream.chunks.size()));
  put(out, crc32(std::span<const std::byte>(out.data(), out.size())));
  for (const ChunkPtr& chunk : stream.chunks) {
    const std::size_t start = out.size();
    put(out, chunk->first_output);
    put(out, chunk->outputs);
    const bool bf16 = stream.header.precision == Precision::bf16;
    put(out, static_cast<std::uint64_t>(bf16 ? chunk->packets_bf16.size() : chunk->packets.size()));
    const auto* b = bf16 ? reinterpret_cast<const std::byte*>(chunk->packets_bf16.data())
                         : reinterpret_cast<const std::byte*>(chunk->packets.data());
    out.insert(out.end(), b,
               b + (bf16 ? chunk->packets_bf16.size() * sizeof(Bf16Packet)
                         : chunk->packets.size() * sizeof(Packet)));
    put(out, crc32(std::span<const std::byte>(out.data() + start, out.size() - start)));
  }
  return out;
}

WeightStream deserialize_stream(std::span<const std::byte> bytes) {
  Reader in(bytes);
  in.need(4, "magic");
  if (std::memcmp(in.here(), kMagic, 4) != 0) {
    throw FormatError("not a serialized sluice stream (bad magic)");
  }
  in.skip(4);
  const auto version = in.get<std::uint32_t>("version");
  if (version < 1 || version > kVersion) {
    throw FormatError("serialized stream version " + std::to_string(version) + ", expected 1 to " +
                      std::to_string(kVersion));
  }
  WeightStream stream;
  const auto kind = in.get<std::uint32_t>("kind");
  if (kind < 1 || kind > 3)
    throw FormatError("serialized stream: unknown kind " + std::to_string(kind));
  stream.header.kind = static_cast<StreamKind>(kind);
  if (version >= 2) {
    const auto precision = in.get<std::uint32_t>("precision");
    if (precision != static_cast<std::uint32_t>(Precision::fp32) &&
        precision != static_cast<std::uint32_t>(Precision::bf16)) {
      throw FormatError("serialized stream: unknown precision " + std::to_string(precision));
    }
    stream.header.precision = static_cast<Precision>(precision);
  }
  if (version >= 3) {
    const auto order = in.get<std::uint32_t>("order");
    if (order != static_cast<std::uint32_t>(StreamOrder::by_output) &&
        order != static_cast<std::uint32_t>(StreamOrder::by_input)) {
      throw FormatError("serialized stream: unknown order " + std::to_string(order));
    }
    stream.header.order = static_cast<StreamOrder>(order);
  }
  const bool bf16 = stream.header.precision == Precision::bf16;
  const std::size_t packet_bytes = bf16 ? sizeof(Bf16Packet) : sizeof(Packet);
  stream.header.outputs = in.get<std::uint32_t>("outputs");
  stream.header.inputs = in.get<std::uint32_t>("inputs");
  stream.header.nnz = in.get<std::uint64_t>("nnz");
  const auto chunks = in.get<std::uint64_t>("chunk count");
  const std::uint32_t header_crc = crc32(bytes.first(in.pos()));
  if (in.get<std::uint32_t>("header checksum") != header_crc) {
    throw FormatError("serialized stream: header checksum mismatch");
  }
  // Every chunk takes at least 20 bytes: refuse counts the data cannot hold before allocating.
  if (chunks > in.left() / 20 + 1) {
    throw FormatError("serialized stream claims " + std::to_string(chunks) +
                      " chunks, more than its size allows");
  }
  StreamValidator validator(stream.header);
  for (std::uint64_t c = 0; c < chunks; ++c) {
    const std::size_t start = in.pos();
    const std::byte* start_ptr = in.here();
    auto chunk = std::make_shared<StreamChunk>();
    chunk->first_output = in.get<std::uint32_t>("chunk header");
    chunk->outputs = in.get<std::uint32_t>("chunk header");
    const auto n = in.get<std::uint64_t>("chunk header");
    if (n > in.left() / packet_bytes) {
      throw FormatError("serialized stream truncated in chunk " + std::to_string(c) + ": " +
                        std::to_string(n) + " packets announced");
    }
    void* packets = nullptr;
    if (bf16) {
      chunk->packets_bf16.resize(n);
      packets = chunk->packets_bf16.data();
    } else {
      chunk->packets.resize(n);
      packets = chunk->packets.data();
    }
    if (n > 0) std::memcpy(packets, in.here(), n * packet_bytes);
    in.skip(n * packet_bytes);
    const std::uint32_t computed = crc32(std::span<const std::byte>(start_ptr, in.pos() - start));
    const auto stored = in.get<std::uint32_t>("chunk checksum");
    if (stored != computed) {
      throw FormatError("serialized stream: checksum mismatch in chunk " + std::to_string(c));
    }
    validator.check(*chunk);
    stream.chunks.push_back(std::move(chunk));
  }
  if (in.left() != 0) {
    throw FormatError("serialized stream: " + std::to_string(in.left()) +
                      " stray bytes after the last chunk");
  }
  validator.finish();
  return stream;
}

// --- channel -------------------------------------------------------------------------
struct StreamChannel::State {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<ChunkPtr> queue;
  std::size_t capacity;
  bool closed = false;
  std::exception_ptr error;
};

StreamChannel::StreamChannel(std::size_t capacity) : state_(std::make_unique<State>()) {
  state_->capacity = std::max<std::size_t>(1, capacity);
}
StreamChannel::~StreamChannel() = default;

void StreamChannel::push(ChunkPtr chunk) {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] {
    return state_->queue.size() < state_->capacity || state_->closed || state_->error;
  });
  if (state_->closed || state_->error) throw Error("StreamChannel: push after close");
  state_->queue.push_back(std::move(chunk));
  state_->changed.notify_all();
}

void StreamChannel::close() {
  std::lock_guard lock(state_->mutex);
  state_->closed = true;
  state_->changed.notify_all();
}

void StreamChannel::fail(std::exception_ptr error) {
  std::lock_guard lock(state_->mutex);
  state_->error = std::move(error);
  state_->changed.notify_all();
}

ChunkPtr StreamChannel::pop() {
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock,
                       [&] { return !state_->queue.empty() || state_->closed || state_->error; });
  if (state_->error) std::rethrow_exception(state_->error);
  if (state_->queue.empty()) return nullptr;
  ChunkPtr chunk = std::move(state_->queue.front());
  state_->queue.pop_front();
  state_->changed.notify_all();
  return chunk;
}

}  // namespace sluice
