// The weight stream: encoding, validation of every kind of corruption, serialisation,
// and the bounded channel between a producer and an engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <thread>

#include <cstring>

#include "core/crc32.hpp"
#include "engine/kernels/stream_scan.hpp"
#include "reference.hpp"
#include "sluice/bf16.hpp"
#include "sluice/error.hpp"
#include "sluice/isa.hpp"
#include "sluice/stream.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using testing::thrown_message;

std::string error_of(const WeightStream& s) {
  try {
    s.validate();
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

WeightStream small_stream(std::size_t chunk = 6) {
  // 4 outputs x 5 inputs; output 2 is empty.
  const CsrMatrix w(4, 5, {0, 2, 3, 3, 6}, {0, 3, 4, 1, 2, 4}, {1, 2, 3, 4, 5, 6});
  return encode_stream(w, StreamKind::weights, chunk);
}

// Copies chunk c so a test can change it without touching the shared original.
StreamChunk& edit(WeightStream& s, std::size_t c) {
  auto copy = std::make_shared<StreamChunk>(*s.chunks.at(c));
  StreamChunk& ref = *copy;
  s.chunks[c] = std::move(copy);
  return ref;
}

TEST(Stream, EncodesOnePacketPerNonZeroAndACarriageReturnPerOutput) {
  const WeightStream s = small_stream(1000);
  ASSERT_EQ(s.chunks.size(), 1U);
  const auto& p = s.chunks[0]->packets;
  ASSERT_EQ(p.size(), 6U + 4U + 1U);
  EXPECT_EQ(p[0].tag, 0U);
  EXPECT_EQ(p[1].tag, 3U);
  EXPECT_EQ(p[2].tag, kCarriageReturn);
  EXPECT_EQ(p[5].tag, kCarriageReturn);  // output 2: nothing but its carriage return
  EXPECT_EQ(p.back().tag, kEndOfLayer);
  EXPECT_EQ(s.header.nnz, 6U);
  EXPECT_NO_THROW(s.validate());
}

TEST(Stream, ChunksHoldWholeOutputsAndRoundTrip) {
  const CsrMatrix w = CsrMatrix::random(97, 53, 0.8, 3, RowDistribution::powerlaw);
  for (std::size_t chunk : {1, 2, 7, 64, 100000}) {
    const WeightStream s = encode_stream(w, StreamKind::weights, chunk);
    std::uint32_t next = 0;
    for (const auto& c : s.chunks) {
      EXPECT_EQ(c->first_output, next);
      EXPECT_GE(c->outputs, 1U);
      next += c->outputs;
    }
    EXPECT_EQ(next, 97U);
    const CsrMatrix back = decode_stream(s);
    EXPECT_EQ(back.row_offsets(), w.row_offsets());
    EXPECT_EQ(back.col_indices(), w.col_indices());
    EXPECT_EQ(back.values(), w.values());
  }
}

TEST(Stream, MaskStreamsCarryNoValues) {
  const CsrMatrix w = CsrMatrix::random(10, 10, 0.5, 1);
  const WeightStream s = encode_stream(w, StreamKind::mask);
  for (const auto& c : s.chunks) {
    for (const Packet& p : c->packets) EXPECT_EQ(p.value, 0.0F);
  }
}

TEST(Stream, EmptyLayersStillEndWithEndOfLayer) {
  const WeightStream s = encode_stream(CsrMatrix(0, 7, {0}, {}, {}));
  ASSERT_EQ(s.chunks.size(), 1U);
  EXPECT_EQ(s.chunks[0]->packets.back().tag, kEndOfLayer);
  EXPECT_NO_THROW(s.validate());
}

TEST(Stream, ChunkingRefusesArgumentsItCannotMeet) {
  const CsrMatrix w = CsrMatrix::random(9, 5, 0.5, 3);
  EXPECT_THROW(encode_stream(w, StreamKind::weights, 0), ArgumentError);  // was taken as 1
  EXPECT_THROW(chunk_end(w, -5, 4), ArgumentError);
  EXPECT_THROW(chunk_end(w, 100, 4), ArgumentError);
  EXPECT_EQ(chunk_end(w, 9, 4), 9);  // the end is where the last chunk stops
}

TEST(Stream, ValidatorNamesEveryCorruption) {
  {
    WeightStream s = small_stream();
    s.header.kind = static_cast<StreamKind>(99);
    EXPECT_NE(error_of(s).find("unknown kind 99"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    edit(s, 0).packets[0].tag = 5;
    EXPECT_NE(error_of(s).find("out of range"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    edit(s, 0).packets[1].tag = 0;  // same index twice in output 0
    EXPECT_NE(error_of(s).find("repeated"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream(1000);
    StreamChunk& c = edit(s, 0);
    std::swap(c.packets[6].tag, c.packets[7].tag);  // output 3: 2, 1, 4: unsorted
    EXPECT_NE(error_of(s).find("unsorted"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream(1000);
    auto& p = edit(s, 0).packets;
    p.erase(p.begin() + 2);  // output 0 loses its carriage return
    EXPECT_NE(error_of(s).find("carriage return"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream(1000);
    edit(s, 0).packets.push_back({1, 1.0F});  // a weight after end-of-layer
    EXPECT_NE(error_of(s).find("after end-of-layer"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    s.chunks.pop_back();  // truncated
    EXPECT_NE(error_of(s).find("truncated"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    s.chunks.erase(s.chunks.begin());  // a lost chunk
    EXPECT_NE(error_of(s).find("expected first output"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    s.header.nnz = 7;  // wrong count
    EXPECT_NE(error_of(s).find("weights, header says"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    edit(s, 0).packets[0].value = INFINITY;
    EXPECT_NE(error_of(s).find("non-finite"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    edit(s, 0).packets[0].tag = 0x9000'0000U;
    EXPECT_NE(error_of(s).find("unknown control"), std::string::npos) << error_of(s);
  }
  {
    WeightStream s = small_stream();
    s.header.outputs = 3;
    EXPECT_NE(error_of(s).find("only 3 outputs"), std::string::npos) << error_of(s);
  }
}

TEST(Stream, SerialisationRoundTripsAndRefusesEveryTruncation) {
  const WeightStream s = encode_stream(CsrMatrix::random(30, 20, 0.6, 9), StreamKind::weights, 16);
  const std::vector<std::byte> bytes = serialize_stream(s);
  const WeightStream back = deserialize_stream(bytes);
  EXPECT_EQ(decode_stream(back).values(), decode_stream(s).values());
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THROW(deserialize_stream(std::span(bytes.data(), n)), FormatError) << n;
  }
  std::vector<std::byte> longer = bytes;
  longer.push_back(std::byte{0});
  EXPECT_THROW(deserialize_stream(longer), FormatError);
}

TEST(Stream, SerialisationRefusesFlippedBytes) {
  const WeightStream s = encode_stream(CsrMatrix::random(30, 20, 0.6, 9), StreamKind::weights, 16);
  const std::vector<std::byte> bytes = serialize_stream(s);
  std::mt19937 rng(4);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<std::byte> bad = bytes;
    const std::size_t at = rng() % bad.size();
    bad[at] ^= std::byte{static_cast<unsigned char>(1U << (rng() % 8))};
    EXPECT_THROW(deserialize_stream(bad), FormatError) << "flip at byte " << at;
  }
}

TEST(Bf16, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(to_bf16(1.0F), 0x3F80);
  EXPECT_EQ(from_bf16(0x3F80), 1.0F);
  EXPECT_EQ(to_bf16(-2.0F), 0xC000);
  EXPECT_EQ(to_bf16(-0.0F), 0x8000);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(to_bf16(1.0F + 0x1p-8F), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
  EXPECT_EQ(to_bf16(1.0F + 3 * 0x1p-8F), 0x3F82);
  EXPECT_EQ(to_bf16(1.0F + 0x1p-8F + 0x1p-20F), 0x3F81);  // just above half: up
  EXPECT_EQ(to_bf16(INFINITY), 0x7F80);
  EXPECT_EQ(to_bf16(-INFINITY), 0xFF80);
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(NAN))));
  // A NaN whose payload sits only in the dropped bits must not become infinity.
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::bit_cast<float>(0x7F800001U)))));
  EXPECT_TRUE(std::isinf(from_bf16(to_bf16(3.4e38F))));  // beyond bf16's largest
  // Subnormals round the same way (a tie here, to even).
  EXPECT_EQ(to_bf16(std::bit_cast<float>(0x0001'8000U)), 0x0002);
  for (float v : {0.1F, -3.7F, 1e-20F, 6.5e4F, 1e30F}) {
    EXPECT_LE(std::fabs(round_to_bf16(v) - v), std::fabs(v) * 0x1p-8F) << v;
  }
  EXPECT_EQ(parse_precision("bf16"), Precision::bf16);
  EXPECT_THROW(parse_precision("fp16"), ArgumentError);
}

TEST(Stream, Bf16StreamsHalveTheBytesAndRoundTrip) {
  const CsrMatrix w = CsrMatrix::random(37, 300, 0.8, 4, RowDistribution::powerlaw);
  const WeightStream fp32 = encode_stream(w);
  const WeightStream bf16 = encode_stream(w, StreamKind::weights, 50, Precision::bf16);
  EXPECT_EQ(bf16.header.precision, Precision::bf16);
  EXPECT_EQ(bf16.packet_count(), fp32.packet_count());
  EXPECT_EQ(2 * bf16.byte_size(), fp32.byte_size());
  EXPECT_GT(bf16.chunks.size(), 1U);
  for (const auto& c : bf16.chunks) EXPECT_TRUE(c->packets.empty());
  const CsrMatrix back = decode_stream(bf16);
  ASSERT_EQ(back.col_indices(), w.col_indices());
  ASSERT_EQ(back.row_offsets(), w.row_offsets());
  for (std::size_t k = 0; k < w.values().size(); ++k) {
    EXPECT_EQ(back.values()[k], round_to_bf16(w.values()[k])) << k;
  }
  const WeightStream again = deserialize_stream(serialize_stream(bf16));
  EXPECT_EQ(again.header.precision, Precision::bf16);
  EXPECT_EQ(decode_stream(again).values(), back.values());
  // A mask stream in bf16 carries the pattern only.
  const WeightStream mask = encode_stream(w, StreamKind::mask, 50, Precision::bf16);
  EXPECT_NO_THROW(mask.validate());
  EXPECT_THROW(encode_stream(CsrMatrix(1, 2, {0, 1}, {1}, {3.4e38F}), StreamKind::weights, 50,
                             Precision::bf16),
               ShapeError);
  // bf16's largest finite value encodes as it is; a weight that rounds past it is named
  // by its place, wherever it lies in the chunk.
  const float largest = from_bf16(0x7F7F);
  const WeightStream edge = encode_stream(CsrMatrix(1, 2, {0, 1}, {1}, {-largest}),
                                          StreamKind::weights, 50, Precision::bf16);
  EXPECT_EQ(decode_stream(edge).values()[0], -largest);
  try {
    encode_stream(CsrMatrix(3, 4, {0, 2, 3, 4}, {0, 3, 2, 1}, {1.0F, 2.0F, -3.4e38F, 4.0F}),
                  StreamKind::weights, 50, Precision::bf16);
    ADD_FAILURE() << "no error for a weight beyond bf16's range";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("at (1, 2)"), std::string::npos) << e.what();
  }
}

TEST(Stream, Bf16ValidatorNamesEveryCorruption) {
  const CsrMatrix w(4, 5, {0, 2, 3, 3, 6}, {0, 3, 4, 1, 2, 4}, {1, 2, 3, 4, 5, 6});
  auto corrupt = [&](auto mutate) {
    WeightStream s = encode_stream(w, StreamKind::weights, 6, Precision::bf16);
    auto chunk = std::make_shared<StreamChunk>(*s.chunks[0]);
    mutate(*chunk, s);
    s.chunks[0] = chunk;
    return error_of(s);
  };
  EXPECT_EQ(corrupt([](StreamChunk&, WeightStream&) {}), "");
  EXPECT_NE(corrupt([](StreamChunk& c, WeightStream&) {
              c.packets_bf16[0].index = 5;
            }).find("out of range"),
            std::string::npos);
  EXPECT_NE(
      corrupt([](StreamChunk& c, WeightStream&) { c.packets_bf16[1].index = 0; }).find("repeated"),
      std::string::npos);
  EXPECT_NE(corrupt([](StreamChunk& c, WeightStream&) {
              c.packets_bf16[0].value = 0x7FC0;
            }).find("non-finite"),
            std::string::npos);
  EXPECT_NE(corrupt([](StreamChunk& c, WeightStream&) {
              c.packets_bf16[2].value = 0x1234;
            }).find("unknown control"),
            std::string::npos);
  EXPECT_NE(corrupt([](StreamChunk& c, WeightStream&) {
              c.packets.push_back({0, 1.0F});
            }).find("fp32 packets in a bf16 stream"),
            std::string::npos);
  EXPECT_NE(corrupt([](StreamChunk&, WeightStream& s) {
              s.header.precision = Precision{7};
            }).find("unknown precision"),
            std::string::npos);
  EXPECT_NE(corrupt([](StreamChunk&, WeightStream& s) {
              s.header.kind = StreamKind::gradient;
            }).find("gradient streams are fp32"),
            std::string::npos);
}

// The bytes an older version wrote: version 1 had neither the precision nor the order
// field (bytes 12-20 of version 3), version 2 no order field (bytes 16-20).
std::vector<std::byte> as_version(const std::vector<std::byte>& v3, std::uint32_t version) {
  const std::size_t dropped = version == 1 ? 8 : 4;
  std::vector<std::byte> old(v3.begin(), v3.begin() + static_cast<std::ptrdiff_t>(20 - dropped));
  old.insert(old.end(), v3.begin() + 20, v3.end());
  std::memcpy(old.data() + 4, &version, 4);
  const std::size_t header_bytes = 4 + 4 + 4 + 8 + 4 + 4 + 8 + 8 - dropped;
  const std::uint32_t crc = crc32(std::span<const std::byte>(old.data(), header_bytes));
  std::memcpy(old.data() + header_bytes, &crc, 4);
  return old;
}

TEST(Stream, ReadsVersionOneAndTwoSerialisations) {
  const WeightStream s = small_stream(4);
  for (std::uint32_t version : {1U, 2U}) {
    SCOPED_TRACE(version);
    std::vector<std::byte> old = as_version(serialize_stream(s), version);
    const WeightStream back = deserialize_stream(old);
    EXPECT_EQ(back.header.precision, Precision::fp32);
    EXPECT_EQ(back.header.order, StreamOrder::by_output);
    EXPECT_EQ(decode_stream(back).values(), decode_stream(s).values());
  }
  std::vector<std::byte> future = serialize_stream(s);
  const std::uint32_t four = 4;
  std::memcpy(future.data() + 4, &four, 4);
  EXPECT_CONTAINS(thrown_message<FormatError>([&] { deserialize_stream(future); }), "version 4");
}

// A stream by input carries W^T: runs are input features, tags output features, and it
// decodes, serialises and validates like any other, back to the layer's W.
TEST(Stream, ByInputCarriesTheTransposeAndDecodesToTheLayer) {
  const CsrMatrix w = CsrMatrix::random(37, 23, 0.7, 5, RowDistribution::powerlaw);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(to_string(precision));
    const WeightStream s =
        encode_stream(w, StreamKind::weights, 16, precision, StreamOrder::by_input);
    EXPECT_EQ(s.header.order, StreamOrder::by_input);
    EXPECT_EQ(s.header.outputs, 23U);  // runs: the layer's inputs
    EXPECT_EQ(s.header.inputs, 37U);
    EXPECT_EQ(s.header.layer_outputs(), 37U);
    EXPECT_EQ(s.header.layer_inputs(), 23U);
    EXPECT_GT(s.chunks.size(), 2U);
    EXPECT_NO_THROW(s.validate());
    const CsrMatrix expected = precision == Precision::bf16 ? testing::rounded_to_bf16(w) : w;
    const CsrMatrix back = decode_stream(s);
    EXPECT_EQ(back.row_offsets(), w.row_offsets());
    EXPECT_EQ(back.col_indices(), w.col_indices());
    EXPECT_EQ(back.values(), expected.values());
    const WeightStream again = deserialize_stream(serialize_stream(s));
    EXPECT_EQ(again.header.order, StreamOrder::by_input);
    EXPECT_EQ(decode_stream(again).values(), expected.values());
    // Packet by packet: run i holds column i of W, rows increasing.
    std::uint32_t run = 0;
    std::int64_t last_tag = -1;
    for (const auto& chunk : s.chunks) {
      for (std::size_t k = 0; k < chunk->size(); ++k) {
        const std::uint32_t tag = precision == Precision::bf16 ? tag_of(chunk->packets_bf16[k])
                                                               : tag_of(chunk->packets[k]);
        if (tag == kCarriageReturn) {
          ++run;
          last_tag = -1;
        } else if (tag != kEndOfLayer) {
          EXPECT_GT(static_cast<std::int64_t>(tag), last_tag);
          last_tag = tag;
          const auto& cols = w.col_indices();
          const auto begin = cols.begin() + w.row_offsets()[tag];
          const auto end = cols.begin() + w.row_offsets()[tag + 1];
          EXPECT_TRUE(std::binary_search(begin, end, run)) << "W(" << tag << ", " << run << ")";
        }
      }
    }
    EXPECT_EQ(run, 23U);
  }
  // bf16 tags are 16-bit: by input they are the layer's outputs.
  const CsrMatrix tall = CsrMatrix::random(70000, 3, 0.999, 1);
  EXPECT_NO_THROW(encode_stream(tall, StreamKind::weights, 64, Precision::bf16));
  EXPECT_CONTAINS(thrown_message<UnsupportedError>([&] {
                    encode_stream(tall, StreamKind::weights, 64, Precision::bf16,
                                  StreamOrder::by_input);
                  }),
                  "outputs (its tags by input)");
  WeightStream bad = encode_stream(w);
  bad.header.order = StreamOrder{7};
  EXPECT_CONTAINS(thrown_message<FormatError>([&] { bad.validate(); }), "unknown order");
  EXPECT_CONTAINS(thrown_message<FormatError>([&] { deserialize_stream(serialize_stream(bad)); }),
                  "unknown order");
}

// The rules of a chunk, packet by packet, as plainly as they can be written: what the
// vectorised scans must agree with.
template <typename PacketT>
bool plain_rules(const std::vector<PacketT>& p, std::uint32_t inputs, std::uint32_t outputs,
                 bool values, std::vector<std::uint32_t>& returns) {
  std::uint64_t closed = 0;
  std::int64_t prev = -1;
  for (std::size_t k = 0; k < p.size(); ++k) {
    const std::uint32_t t = tag_of(p[k]);
    if ((t & kControlBit) == 0) {
      if (t >= inputs || static_cast<std::int64_t>(t) <= prev ||
          (values && !std::isfinite(value_of(p[k]))) || closed == outputs) {
        return false;
      }
      prev = t;
    } else if (t == kCarriageReturn) {
      if (closed == outputs) return false;
      ++closed;
      prev = -1;
      returns.push_back(static_cast<std::uint32_t>(k));
    } else if (t != kEndOfLayer || k + 1 != p.size() || prev != -1) {
      return false;
    }
  }
  return closed == outputs;
}

// Each ISA's scan against the plain rules; an ISA this CPU cannot run is skipped.
class StreamScanByIsa : public testing::ByIsa {};

TEST_P(StreamScanByIsa, AgreesWithThePlainRulesOnRandomCorruptions) {
  const std::vector<const detail::StreamScan*> scans = {&detail::stream_scan(GetParam())};
  std::mt19937 rng(11);
  int accepted_long = 0;
  for (int it = 0; it < 20000; ++it) {
    const std::uint32_t inputs = 1 + rng() % 60, outputs = rng() % 6;
    const bool values = rng() % 4 != 0;
    // A valid chunk of random outputs, then up to two corruptions.
    std::vector<Packet> ps;
    for (std::uint32_t o = 0; o < outputs; ++o) {
      for (std::uint32_t i = 0; i < inputs; ++i) {
        if (rng() % 3 == 0) ps.push_back({i, static_cast<float>(rng() % 100) - 50});
      }
      ps.push_back({kCarriageReturn, 0});
    }
    if (rng() % 2 != 0) ps.push_back({kEndOfLayer, 0});
    for (int m = static_cast<int>(rng() % 3); m > 0 && !ps.empty(); --m) {
      const std::size_t k = rng() % ps.size();
      switch (rng() % 7) {
        case 0:
          ps[k].tag = rng() % (inputs + 2);
          break;
        case 1:
          ps[k].value = NAN;
          break;
        case 2:
          ps[k].value = INFINITY;
          break;
        case 3:
          std::swap(ps[k], ps[rng() % ps.size()]);
          break;
        case 4:
          ps.erase(ps.begin() + static_cast<std::ptrdiff_t>(k));
          break;
        case 5:
          ps[k].tag = rng() % 2 != 0 ? kCarriageReturn : kEndOfLayer;
          break;
        default:  // a control that is neither
          ps[k].tag = rng() % 2 != 0 ? kControlBit | (rng() % 4) : kEndOfLayer - 1 - rng() % 4;
          break;
      }
    }
    std::vector<Bf16Packet> bs;
    for (const Packet& q : ps) {
      bs.push_back(is_control(q) ? bf16_control(q.tag)
                                 : Bf16Packet{static_cast<std::uint16_t>(q.tag), to_bf16(q.value)});
    }
    std::vector<std::uint32_t> want32, want16;
    const bool ok32 = plain_rules(ps, inputs, outputs, values, want32);
    const bool ok16 = plain_rules(bs, inputs, outputs, values, want16);
    accepted_long += ok32 && ps.size() >= 32 ? 1 : 0;
    for (const detail::StreamScan* scan : scans) {
      std::vector<std::uint32_t> got32(outputs), got16(outputs);
      ASSERT_EQ(scan->fp32(ps.data(), ps.size(), inputs, outputs, values, got32.data()), ok32)
          << "iteration " << it;
      ASSERT_EQ(scan->bf16(bs.data(), bs.size(), inputs, outputs, values, got16.data()), ok16)
          << "iteration " << it;
      if (ok32) EXPECT_EQ(got32, want32) << "iteration " << it;
      if (ok16) EXPECT_EQ(got16, want16) << "iteration " << it;
    }
  }
  EXPECT_GT(accepted_long, 1000);  // the vector paths saw many long valid chunks
}

// The vector scan takes steps between neighbours as 32-bit differences, which it trusts
// only up to 2^30 inputs: tags at the top of every range, and no inputs at all.
TEST_P(StreamScanByIsa, AgreesOnTagsNearTheirLimit) {
  const std::vector<const detail::StreamScan*> scans = {&detail::stream_scan(GetParam())};
  for (const std::uint32_t inputs : {0U, 1U, 1U << 30, (1U << 30) + 1, 0x7FFF'FFFFU}) {
    const std::uint32_t width = std::min<std::uint32_t>(inputs, 20);
    for (int fault = 0; fault < 4; ++fault) {
      std::vector<Packet> ps;
      for (std::uint32_t o = 0; o < 3; ++o) {
        for (std::uint32_t i = inputs - width; i < inputs; ++i) ps.push_back({i, 1.0F});
        ps.push_back({kCarriageReturn, 0});
      }
      if (fault == 1 && width > 0) ps[width - 1].tag = inputs;             // out of range
      if (fault == 2 && width > 1) ps[width - 1].tag = ps[width - 2].tag;  // repeated
      if (fault == 3) ps.push_back({kEndOfLayer, 0});                      // (valid)
      std::vector<std::uint32_t> want;
      const bool ok = plain_rules(ps, inputs, 3, true, want);
      for (const detail::StreamScan* scan : scans) {
        std::vector<std::uint32_t> got(3);
        ASSERT_EQ(scan->fp32(ps.data(), ps.size(), inputs, 3, true, got.data()), ok)
            << "inputs " << inputs << ", fault " << fault;
        if (ok) EXPECT_EQ(got, want);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, StreamScanByIsa, ::testing::ValuesIn(testing::kAllIsas),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(StreamChannel, HandsChunksOverInOrderAndBlocksWhenFull) {
  const WeightStream s = encode_stream(CsrMatrix::random(200, 50, 0.5, 2), StreamKind::weights, 8);
  StreamChannel channel(1);
  std::thread producer([&] {
    for (const auto& c : s.chunks) channel.push(c);
    channel.close();
  });
  std::size_t n = 0;
  while (ChunkPtr c = channel.pop()) {
    ASSERT_LT(n, s.chunks.size());
    EXPECT_EQ(c.get(), s.chunks[n].get());  // shared, not copied
    ++n;
  }
  producer.join();
  EXPECT_EQ(n, s.chunks.size());
}

TEST(StreamChannel, AProducersErrorReachesTheConsumer) {
  StreamChannel channel(2);
  std::thread producer([&] {
    try {
      throw FormatError("producer broke");
    } catch (...) {
      channel.fail(std::current_exception());
    }
  });
  EXPECT_THROW(channel.pop(), FormatError);
  producer.join();
}

}  // namespace
}  // namespace sluice
