#include "engine/kernels/stream_scan.hpp"

#include "core/isa_choice.hpp"

namespace sluice::detail {
namespace {

template <typename PacketT>
bool scan(const PacketT* p, std::size_t n, std::uint32_t inputs, std::uint32_t outputs,
          bool check_values, std::uint32_t* carriage_returns) {
  std::uint32_t bad = 0, returns = 0, ends = 0;
  scan_packets(p, 0, n, kCarriageReturn, inputs, outputs, check_values, carriage_returns, bad,
               returns, ends);
  return scan_verdict(p, n, outputs, bad, returns, ends);
}

}  // namespace

const StreamScan kScalarStreamScan{scan<Packet>, scan<Bf16Packet>};

const StreamScan& stream_scan(Isa isa) {
  return *for_isa(isa, &kScalarStreamScan, &kAvx2StreamScan, &kAvx512StreamScan);
}

}  // namespace sluice::detail
