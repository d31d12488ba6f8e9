#pragma once
// How much memory this process can have at most: the smallest of the machine's physical
// memory, the memory cgroup's limit and RLIMIT_AS. Sizes that input declares (a matrix
// file's rows, a data set's classes) are checked against it before anything that size is
// allocated, so a short file cannot make sluice take (or be killed for) gigabytes.
#include <cstdint>
#include <string>

namespace sluice::detail {

struct MemoryLimit {
  std::uint64_t bytes = 0;
  const char* source = "";  ///< "physical memory", "the memory cgroup's limit" or "RLIMIT_AS"
};

/// The binding limit, read once per call (the cgroup's file, sysconf, getrlimit).
MemoryLimit available_memory();

/// "17179869184 bytes (17.2 GB)".
std::string bytes_text(double bytes);

/// ResourceError "<what> needs N bytes (x GB), more than the y GB of <source> this process
/// can have" when `bytes` is above available_memory(). `what` says what and where.
void require_memory(double bytes, const std::string& what);

}  // namespace sluice::detail
