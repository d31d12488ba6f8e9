// The weight stream: encoding, validation of every kind of corruption, serialisation,
// and the bounded channel between a producer and an engine.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <thread>

#include "sluice/error.hpp"
#include "sluice/stream.hpp"

namespace sluice {
namespace {

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

TEST(Stream, ValidatorNamesEveryCorruption) {
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
