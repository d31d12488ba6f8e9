// libFuzzer target: the DLMC .smtx reader must refuse anything malformed with a
// sluice::Error, and whatever it accepts must be a valid CSR matrix.
#include <optional>

#include "fuzz_input_file.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = sluice::fuzz::input_file(data, size, ".smtx");
  std::optional<sluice::CsrMatrix> m;
  try {
    m.emplace(sluice::read_smtx(path, 1));
  } catch (const sluice::Error&) {
    return 0;  // refused: what malformed input must get
  }
  // Outside the try: an accepted matrix that is not valid CSR escapes as an uncaught
  // exception, which libFuzzer reports.
  m->validate();
  return 0;
}
