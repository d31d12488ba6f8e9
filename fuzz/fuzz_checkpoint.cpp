// libFuzzer target: the checkpoint loader refuses anything corrupt with a sluice::Error
// and leaves the model as it was.
#include "fuzz_checkpoint_load.hpp"
#include "fuzz_input_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  sluice::HostModelMemory memory;
  sluice::fuzz::load_checked(sluice::fuzz::input_file(data, size, ".ckpt"), memory);
  return 0;
}
