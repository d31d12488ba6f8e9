// libFuzzer target: serialised weight/gradient streams, fp32 and bf16, by output and by
// input. Whatever deserialises must be a valid stream that decodes to a valid CSR matrix
// and serialises back to the same bytes (an older version's input: to bytes in the
// current version that then round-trip exactly).
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/stream.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const sluice::WeightStream s = sluice::deserialize_stream(bytes);
    s.validate();
    const std::vector<std::byte> again = sluice::serialize_stream(s);
    // Bytes in the current version come back identical; older versions are rewritten in
    // the current one, which must then round-trip exactly.
    std::uint32_t version = 0, current = 0;
    std::memcpy(&version, data + 4, sizeof version);
    std::memcpy(&current, again.data() + 4, sizeof current);
    const std::vector<std::byte> expected =
        version != current ? sluice::serialize_stream(sluice::deserialize_stream(again))
                           : std::vector<std::byte>(bytes.begin(), bytes.end());
    if (again.size() != expected.size() ||
        std::memcmp(again.data(), expected.data(), again.size()) != 0) {
      std::abort();
    }
    if (s.header.kind != sluice::StreamKind::gradient) (void)sluice::decode_stream(s);
  } catch (const sluice::Error&) {
  }
  return 0;
}
