// libFuzzer target: the Matrix Market reader, as fuzz_smtx.cpp.
#include "fuzz_input_file.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = sluice::fuzz::input_file(data, size, ".mtx");
  try {
    const sluice::CsrMatrix m = sluice::read_matrix_market(path, 1);
    m.validate();
  } catch (const sluice::Error&) {
  }
  return 0;
}
