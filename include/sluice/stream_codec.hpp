#pragma once
// A layer's CSR matrix to a weight stream and back, and a stream to bytes and back (the
// format: sluice/stream_packets.hpp).
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "sluice/bf16.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/stream_packets.hpp"

namespace sluice {

/// Default chunk size in packets: large enough to amortise the hand-over, small enough
/// that the first chunk reaches the engine early.
inline constexpr std::size_t kDefaultChunkPackets = 1 << 15;

/// Encodes a layer's CSR matrix as a stream of the given kind (`mask` sends zeros as
/// values), by output or by input (then the stream carries the matrix's transpose).
/// In bf16 the values are rounded to nearest even; a stream whose tags would exceed
/// 65534 (inputs by output, outputs by input) is refused with UnsupportedError, and a finite
/// weight too large for bf16 with ArgumentError.
WeightStream encode_stream(const CsrMatrix& matrix, StreamKind kind = StreamKind::weights,
                           std::size_t chunk_packets = kDefaultChunkPackets,
                           Precision precision = Precision::fp32,
                           StreamOrder order = StreamOrder::by_output);

/// Whether a layer of `outputs` rows and `nnz` non-zeros can be streamed by input in
/// `precision`: a bf16 stream's tags by input address at most 65535 outputs, and a
/// layer's transposed positions are 32-bit.
bool streams_by_input(std::int64_t outputs, std::int64_t nnz, Precision precision);

/// The pieces of encode_stream, for producers that encode a layer chunk by chunk:
/// the stream's header (UnsupportedError if the layer cannot be streamed so), where the chunk
/// that starts at run `first` ends (whole runs, about `chunk_packets` packets, at least
/// one run), and the chunk of runs [first, last) (end-of-layer after the last run). By
/// input, the runs are the transpose's rows, its values read through its positions in
/// the layer's values (so a producer needs no second copy of them).
StreamHeader stream_header_for(const CsrMatrix& matrix, StreamKind kind,
                               Precision precision = Precision::fp32,
                               StreamOrder order = StreamOrder::by_output);
/// The same from the layer's shape alone (`rows` x `cols` with `nnz` non-zeros), for a
/// producer that does not hold the matrix.
StreamHeader stream_header_for(std::int64_t rows, std::int64_t cols, std::int64_t nnz,
                               StreamKind kind, Precision precision = Precision::fp32,
                               StreamOrder order = StreamOrder::by_output);
std::int64_t chunk_end(const CsrMatrix& matrix, std::int64_t first, std::size_t chunk_packets);
std::int64_t chunk_end(const TransposedPattern& transposed, std::int64_t first,
                       std::size_t chunk_packets);
ChunkPtr encode_chunk(const CsrMatrix& matrix, StreamKind kind, std::int64_t first,
                      std::int64_t last, Precision precision = Precision::fp32);
ChunkPtr encode_chunk(const TransposedPattern& transposed, std::span<const float> values,
                      StreamKind kind, std::int64_t first, std::int64_t last,
                      Precision precision = Precision::fp32);

/// Decodes a complete, valid stream back into the layer's CSR matrix (values from the
/// packets, widened to fp32 from a bf16 stream; a stream by input is transposed back).
CsrMatrix decode_stream(const WeightStream& stream);

/// Serialises a stream to bytes (magic "SLWS", version, header, framed chunks, CRC-32 per
/// chunk), for files and for fabrics that cross process boundaries.
std::vector<std::byte> serialize_stream(const WeightStream& stream);
/// Parses and fully validates serialised bytes; throws FormatError on any corruption.
WeightStream deserialize_stream(std::span<const std::byte> bytes);

}  // namespace sluice
