#include "model_memory/layer_streams.hpp"

#include <cstdio>
#include <vector>

#include "core/parallel.hpp"
#include "sluice/error.hpp"
#include "sluice/model_memory.hpp"

namespace sluice::detail {
namespace {

std::string describe_packet(const Packet& p) {
  if (p.tag == kCarriageReturn) return "a carriage return";
  if (p.tag == kEndOfLayer) return "end-of-layer";
  if (is_control(p)) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%08X", p.tag);
    return std::string("unknown control packet ") + hex;
  }
  return "tag " + std::to_string(p.tag);
}

struct ChunkScan {
  double sum_of_squares = 0;
  std::string error;  // empty if the chunk matched the mask
};

/// What a gradient stream of one order must carry: the mask's runs and tags in that order,
/// and where each value goes in the layer's CSR order (`position` null: in place).
struct GradientOrder {
  const std::vector<std::int64_t>& offsets;
  const std::uint32_t* tags;
  const std::uint32_t* position;
  const char* run;  ///< what a run is: "output", or "input" by input
  const char* tag;

  static GradientOrder of(const CsrMatrix& mask) {
    return {mask.row_offsets(), mask.col_indices().data(), nullptr, "output", "input"};
  }
  static GradientOrder of(const TransposedPattern& t) {
    return {t.row_offsets, t.col_indices.data(), t.source.data(), "input", "output"};
  }
};

// Copies one gradient chunk into `gradient` (CSR order) while checking that its packets
// are exactly the mask's in the stream's order: the same tags in the same order, a
// carriage return after each run, end-of-layer after the last.
ChunkScan scan_gradient_chunk(std::int32_t layer, const GradientOrder& mask,
                              const StreamChunk& chunk, std::size_t chunk_index, bool last_chunk,
                              float* gradient) {
  ChunkScan scan;
  const auto& offsets = mask.offsets;
  const std::uint32_t* indices = mask.tags;
  const Packet* packets = chunk.packets.data();
  const std::size_t count = chunk.packets.size();
  std::size_t pos = 0;
  double sum = 0;
  auto fail = [&](const std::string& what) {
    scan.error =
        "gradient of " + layer_name(layer) + ", chunk " + std::to_string(chunk_index) + ": " + what;
    return scan;
  };
  const std::int64_t first = chunk.first_output;
  const std::int64_t last = first + chunk.outputs;
  for (std::int64_t o = first; o < last; ++o) {
    const std::int64_t begin = offsets[o];
    const std::int64_t end = offsets[o + 1];
    for (std::int64_t k = begin; k < end; ++k) {
      if (pos == count || packets[pos].tag != indices[k]) {
        const std::string found =
            pos == count ? std::string("the end of the chunk") : describe_packet(packets[pos]);
        return fail(std::string(mask.run) + " " + std::to_string(o) + ", position " +
                    std::to_string(k - begin) + ": found " + found + " where the mask has " +
                    mask.tag + " " + std::to_string(indices[k]));
      }
      const float g = packets[pos++].value;
      gradient[mask.position != nullptr ? mask.position[k] : k] = g;
      sum += static_cast<double>(g) * g;
    }
    if (pos == count || packets[pos].tag != kCarriageReturn) {
      return fail(
          std::string(mask.run) + " " + std::to_string(o) + ", position " +
          std::to_string(end - begin) + ": expected the carriage return after its " +
          std::to_string(end - begin) + " gradients, found " +
          (pos == count ? std::string("the end of the chunk") : describe_packet(packets[pos])));
    }
    ++pos;
  }
  if (last_chunk) {
    if (pos == count || packets[pos].tag != kEndOfLayer) {
      return fail(
          "expected end-of-layer after " + std::string(mask.run) + " " + std::to_string(last - 1) +
          ", found " +
          (pos == count ? std::string("the end of the stream") : describe_packet(packets[pos])));
    }
    ++pos;
  }
  if (pos != count) {
    return fail(std::to_string(count - pos) + " packet(s) after the chunk's last " + mask.run +
                " " + std::to_string(last - 1) + ", the first is " + describe_packet(packets[pos]));
  }
  scan.sum_of_squares = sum;
  return scan;
}

}  // namespace

std::string layer_name(std::int32_t layer) {
  return "layer " + std::to_string(layer);
}

void encode_layer(const CsrMatrix& w, const TransposedPattern* transposed, StreamKind kind,
                  StreamChannel& channel, std::size_t chunk_packets, Precision precision,
                  StreamOrder order) {
  // One chunk at a time: the channel's capacity bounds the memory in flight, and the
  // consumer starts on the first chunk while the rest are still being encoded.
  auto send = [&](std::int64_t runs, auto chunk_end_of, auto encode) {
    std::int64_t first = 0;
    do {
      const std::int64_t last = chunk_end_of(first);
      channel.push(encode(first, last));
      first = last;
    } while (first < runs);
  };
  if (order == StreamOrder::by_input) {
    const TransposedPattern& t = *transposed;
    send(
        t.rows, [&](std::int64_t first) { return chunk_end(t, first, chunk_packets); },
        [&](std::int64_t first, std::int64_t last) {
          return encode_chunk(t, w.values(), kind, first, last, precision);
        });
  } else {
    send(
        w.rows(), [&](std::int64_t first) { return chunk_end(w, first, chunk_packets); },
        [&](std::int64_t first, std::int64_t last) {
          return encode_chunk(w, kind, first, last, precision);
        });
  }
}

double scan_gradient(std::int32_t layer, const WeightStream& gradient, const CsrMatrix& mask,
                     const TransposedPattern* transposed, float* out) {
  // The chunks' runs must follow each other and cover the layer; then each chunk can be
  // checked and copied on its own, in parallel.
  const auto& chunks = gradient.chunks;
  if (chunks.empty()) {
    throw FormatError("gradient of " + layer_name(layer) + ": the stream is empty");
  }
  // (The header matched the layer: by input, the runs are its inputs.)
  const bool by_input = gradient.header.by_input();
  const std::int64_t rows = by_input ? mask.cols() : mask.rows();
  const std::string run = by_input ? "input" : "output";
  std::int64_t next_output = 0;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    if (!chunks[c]) {
      throw FormatError("gradient of " + layer_name(layer) + ": chunk " + std::to_string(c) +
                        " is null");
    }
    if (chunks[c]->first_output != next_output) {
      throw FormatError("gradient of " + layer_name(layer) + ": chunk " + std::to_string(c) +
                        " starts at " + run + " " + std::to_string(chunks[c]->first_output) +
                        ", expected " + std::to_string(next_output));
    }
    next_output += chunks[c]->outputs;
    if (next_output > rows) {
      throw FormatError("gradient of " + layer_name(layer) + ": chunk " + std::to_string(c) +
                        " runs to " + run + " " + std::to_string(next_output - 1) +
                        ", the layer has " + std::to_string(rows) + " " + run + "s");
    }
  }
  if (next_output != rows) {
    throw FormatError("gradient of " + layer_name(layer) + ": the chunks cover " +
                      std::to_string(next_output) + " of " + std::to_string(rows) + " " + run +
                      "s");
  }
  const GradientOrder order = by_input ? GradientOrder::of(*transposed) : GradientOrder::of(mask);
  std::vector<ChunkScan> scans(chunks.size());
  auto scan = [&](std::size_t c) {
    scans[c] = scan_gradient_chunk(layer, order, *chunks[c], c, c + 1 == chunks.size(), out);
  };
  if (chunks.size() == 1) {
    scan(0);
  } else {
    parallel_for(std::size_t{0}, chunks.size(), scan);
  }
  double sum_of_squares = 0;
  for (const ChunkScan& s : scans) {
    if (!s.error.empty()) throw FormatError(s.error);
    sum_of_squares += s.sum_of_squares;
  }
  return sum_of_squares;
}

void throw_skipped_step(const std::vector<std::int32_t>& bad_layers, std::int64_t step) {
  std::string names;
  for (std::int32_t i : bad_layers) names += (names.empty() ? "" : ", ") + std::to_string(i);
  throw NumericError("commit_step: non-finite gradient or update in layer(s) " + names + "; step " +
                     std::to_string(step) + " skipped, weights and optimizer state unchanged");
}

}  // namespace sluice::detail
