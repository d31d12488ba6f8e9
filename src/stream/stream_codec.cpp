#include "sluice/stream_codec.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "core/crc32.hpp"
#include "sluice/error.hpp"
#include "sluice/stream_validator.hpp"

namespace sluice {

bool streams_by_input(std::int64_t outputs, std::int64_t nnz, Precision precision) {
  return static_cast<std::uint64_t>(nnz) <= std::numeric_limits<std::uint32_t>::max() &&
         (precision == Precision::fp32 || outputs <= static_cast<std::int64_t>(kMaxBf16Inputs));
}

StreamHeader stream_header_for(const CsrMatrix& matrix, StreamKind kind, Precision precision,
                               StreamOrder order) {
  return stream_header_for(matrix.rows(), matrix.cols(), matrix.nnz(), kind, precision, order);
}

StreamHeader stream_header_for(std::int64_t rows, std::int64_t cols, std::int64_t nnz,
                               StreamKind kind, Precision precision, StreamOrder order) {
  if (order != StreamOrder::by_output && order != StreamOrder::by_input) {
    throw ArgumentError("encode: unknown order " +
                        std::to_string(static_cast<std::uint32_t>(order)));
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
    throw ArgumentError("encode: unknown precision " +
                        std::to_string(static_cast<std::uint32_t>(precision)));
  }
  if (precision == Precision::bf16 && tags > kMaxBf16Inputs) {
    throw UnsupportedError("a bf16 stream addresses at most " + std::to_string(kMaxBf16Inputs) +
                           " " + (by_input ? "outputs (its tags by input)" : "inputs") +
                           "; this layer has " + std::to_string(tags) + " (stream it in fp32)");
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
  if (chunk_packets == 0) throw ArgumentError("chunk_end: chunks of 0 packets");
  if (first < 0 || first > runs) {
    throw ArgumentError("chunk_end: output " + std::to_string(first) + " outside the matrix's " +
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
    throw ArgumentError("encode_chunk: outputs [" + std::to_string(first) + ", " +
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

/// How many non-zeros ahead the by-input gather asks for its value's cache line: about a
/// column's worth of a wide layer, so a row's next line is on its way by the next column.
constexpr std::int64_t kGatherAhead = 512;
/// Values of fewer bytes than about a core's L2 stay there between columns: asking for
/// their lines only costs instructions.
constexpr std::size_t kGatherAheadFromBytes = std::size_t{1} << 20;

auto runs_of(const TransposedPattern& transposed, std::span<const float> values) {
  const std::uint32_t* source = transposed.source.data();
  const float* layer = values.data();
  const auto last = static_cast<std::int64_t>(transposed.source.size()) - 1;
  // In the transposed order each value lies on another row's cache line, an address the
  // hardware's prefetchers cannot guess but the pattern gives ahead of time.
  const bool ahead = values.size_bytes() >= kGatherAheadFromBytes;
  return run_source(transposed.row_offsets, transposed.col_indices.data(),
                    [source, layer, last, ahead](std::int64_t k) {
                      if (ahead)
                        __builtin_prefetch(layer + source[std::min(k + kGatherAhead, last)]);
                      return layer[source[k]];
                    });
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
  /// A u32 field holding one of an enum's values, first ... last.
  template <typename E>
  E get_enum(const char* what, E first, E last) {
    const auto v = get<std::uint32_t>(what);
    if (v < static_cast<std::uint32_t>(first) || v > static_cast<std::uint32_t>(last)) {
      throw FormatError(std::string("serialized stream: unknown ") + what + " " +
                        std::to_string(v));
    }
    return static_cast<E>(v);
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
  stream.header.kind = in.get_enum<StreamKind>("kind", StreamKind::weights, StreamKind::gradient);
  if (version >= 2) {
    stream.header.precision = in.get_enum<Precision>("precision", Precision::fp32, Precision::bf16);
  }
  if (version >= 3) {
    stream.header.order =
        in.get_enum<StreamOrder>("order", StreamOrder::by_output, StreamOrder::by_input);
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

}  // namespace sluice
