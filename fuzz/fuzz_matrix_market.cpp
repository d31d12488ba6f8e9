// libFuzzer target: the Matrix Market reader, as fuzz_smtx.cpp.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include "fuzz_input_file.hpp"
#include "sluice/csr_matrix.hpp"
#include "sluice/error.hpp"

namespace {

/// The row count on the size line (the first line that is neither a comment nor blank),
/// or 0. A few bytes may declare up to 2^31 - 1 rows, whose offsets the reader then
/// rightly allocates (16 GiB): past libFuzzer's 2 GiB limit, but no parser bug.
long long declared_rows(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    if (line.empty() || line[0] == '%' || line.find_first_not_of(" \t\r") == std::string::npos) {
      continue;
    }
    return std::strtoll(line.c_str(), nullptr, 10);
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (declared_rows(data, size) > (1LL << 24)) return 0;
  const auto path = sluice::fuzz::input_file(data, size, ".mtx");
  std::optional<sluice::CsrMatrix> m;
  try {
    m.emplace(sluice::read_matrix_market(path, 1));
  } catch (const sluice::Error&) {
    return 0;  // refused: what malformed input must get
  }
  // Outside the try: an accepted matrix that is not valid CSR escapes as an uncaught
  // exception, which libFuzzer reports.
  m->validate();
  return 0;
}
