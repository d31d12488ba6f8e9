// libFuzzer target: the DLMC .smtx reader must refuse anything malformed with a
// sluice::Error, and whatever it accepts must be a valid CSR matrix.
#include "fuzz_input_file.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = sluice::fuzz::input_file(data, size, ".smtx");
  try {
    const sluice::CsrMatrix m = sluice::read_smtx(path, 1);
    m.validate();
  } catch (const sluice::Error&) {
  }
  return 0;
}
