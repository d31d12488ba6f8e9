#include "core/available_memory.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

// The limit in a cgroup file ("max" or a number of bytes); 0 when there is none.
std::uint64_t read_limit(const std::string& file) {
  std::ifstream in(file);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    return std::stoull(text);
  } catch (const std::exception&) {
    return 0;
  }
}

// The cgroup (v2, else v1's memory controller) this process is in, from /proc/self/cgroup.
std::uint64_t cgroup_limit() {
  std::ifstream in("/proc/self/cgroup");
  std::uint64_t limit = 0;
  auto lower = [&limit](std::uint64_t value) {
    if (value > 0 && (limit == 0 || value < limit)) limit = value;
  };
  for (std::string line; std::getline(in, line);) {
    const auto first = line.find(':');
    const auto second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (controllers.empty()) {
      lower(read_limit("/sys/fs/cgroup" + path + "/memory.max"));
      lower(read_limit("/sys/fs/cgroup/unified" + path + "/memory.max"));
    } else if (controllers == "memory") {
      lower(read_limit("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes"));
    }
  }
  return limit;
}

}  // namespace

MemoryLimit available_memory() {
  MemoryLimit m;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    m.bytes = static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
    m.source = "physical memory";
  }
  // v1 reports "no limit" as a page-rounded INT64_MAX, above the physical memory anyway.
  if (const std::uint64_t c = cgroup_limit(); c > 0 && (m.bytes == 0 || c < m.bytes)) {
    m.bytes = c;
    m.source = "the memory cgroup's limit";
  }
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY &&
      (m.bytes == 0 || as.rlim_cur < m.bytes)) {
    m.bytes = static_cast<std::uint64_t>(as.rlim_cur);
    m.source = "RLIMIT_AS";
  }
  return m;
}

std::string bytes_text(double bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.0f bytes (%.3g GB)", bytes, bytes * 1e-9);
  return text;
}

void require_memory(double bytes, const std::string& what) {
  const MemoryLimit m = available_memory();
  if (m.bytes == 0 || bytes <= static_cast<double>(m.bytes)) return;
  char limit[64];
  std::snprintf(limit, sizeof limit, "%.3g GB", static_cast<double>(m.bytes) * 1e-9);
  throw ResourceError(what + " needs " + bytes_text(bytes) + ", more than the " + limit + " of " +
                      m.source + " this process can have");
}

}  // namespace sluice::detail
