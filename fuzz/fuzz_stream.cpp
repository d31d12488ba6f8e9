// libFuzzer target: serialised weight/gradient streams. Whatever deserialises must be a
// valid stream that decodes to a valid CSR matrix and serialises back to the same bytes.
#include <cstdlib>
#include <cstring>
#include <span>

#include "sluice/error.hpp"
#include "sluice/stream.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const sluice::WeightStream s = sluice::deserialize_stream(bytes);
    s.validate();
    const std::vector<std::byte> again = sluice::serialize_stream(s);
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) std::abort();
    if (s.header.kind != sluice::StreamKind::gradient) (void)sluice::decode_stream(s);
  } catch (const sluice::Error&) {
  }
  return 0;
}
