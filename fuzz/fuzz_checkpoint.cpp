// libFuzzer target: the checkpoint loader refuses anything corrupt with a sluice::Error
// and leaves the model as it was.
#include "fuzz_input_file.hpp"
#include "sluice/error.hpp"
#include "sluice/model_memory.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = sluice::fuzz::input_file(data, size, ".ckpt");
  sluice::HostModelMemory memory;
  memory.add_layer(sluice::CsrMatrix::random(3, 4, 0.5, 7), {0.5F, -0.5F, 1.0F});
  try {
    memory.load(path);
  } catch (const sluice::Error&) {
    // A refused load changes nothing.
    if (memory.layer_count() != 1 || memory.weights(0).rows() != 3) std::abort();
  }
  return 0;
}
