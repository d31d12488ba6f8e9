#include "stream/stream_check.hpp"

#include <cmath>
#include <cstring>
#include <span>
#include <string>

#include "engine/kernels/stream_scan.hpp"
#include "sluice/error.hpp"
#include "sluice/isa.hpp"
#include "sluice/stream_validator.hpp"

namespace sluice {

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

}  // namespace sluice
