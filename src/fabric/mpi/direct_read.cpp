#include "fabric/mpi/direct_read.hpp"

#include <cstring>
#include <string>

#include "sluice/error.hpp"

#if defined(__linux__)
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <random>
#define SLUICE_MPI_DIRECT_READ 1
#endif

namespace sluice::mpi {

#ifdef SLUICE_MPI_DIRECT_READ
namespace {

// Copies rank 0's buffers (`remote`, in process `pid`) into ours. False if the OS refuses
// (errno says why).
bool read_remote(std::int64_t pid, std::vector<iovec>& local, std::vector<iovec>& remote,
                 std::size_t bytes) {
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = process_vm_readv(static_cast<pid_t>(pid), local.data(), local.size(),
                                       remote.data(), remote.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<std::size_t>(n);
    // A partial read (the kernel stops at a page it cannot take): skip what was read.
    auto advance = [](std::vector<iovec>& v, std::size_t k) {
      std::size_t i = 0;
      for (; i < v.size() && k >= v[i].iov_len; ++i) k -= v[i].iov_len;
      v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i));
      if (!v.empty()) {
        v.front().iov_base = static_cast<char*>(v.front().iov_base) + k;
        v.front().iov_len -= k;
      }
    };
    advance(local, static_cast<std::size_t>(n));
    advance(remote, static_cast<std::size_t>(n));
  }
  return true;
}

}  // namespace

std::int64_t agree_on_direct_reads(Link& link, bool wanted) {
  std::uint64_t probe_word[2] = {0, 0};  // read by the engines within the reduction below
  DirectProbe probe;
  if (link.rank() == 0) {
    std::random_device random;
    probe_word[0] = (std::uint64_t{random()} << 32) | random();
    probe_word[1] = (std::uint64_t{random()} << 32) | random() | 1U;
    probe.wanted = wanted ? 1 : 0;
    probe.pid = getpid();
    probe.address = reinterpret_cast<std::uintptr_t>(&probe_word[0]);
    probe.expected[0] = probe_word[0];
    probe.expected[1] = probe_word[1];
  }
  link.bcast(&probe, sizeof probe, MPI_BYTE, "direct-read probe");
  int ok = probe.wanted;
  if (ok != 0 && link.rank() != 0) {
    std::uint64_t seen[2] = {0, 0};
    std::vector<iovec> local{{seen, sizeof seen}};
    std::vector<iovec> remote{
        {reinterpret_cast<void*>(static_cast<std::uintptr_t>(probe.address)), sizeof seen}};
    ok = read_remote(probe.pid, local, remote, sizeof seen) && seen[0] == probe.expected[0] &&
                 seen[1] == probe.expected[1]
             ? 1
             : 0;
  }
  link.allreduce_min(ok, link.comm(), "direct-read probe");
  return ok != 0 ? probe.pid : 0;
}

void read_frame(std::int64_t pid, const FrameMeta& meta, const std::vector<void*>& buffers,
                const std::vector<std::size_t>& sizes, std::size_t packet_bytes) {
  std::vector<iovec> local, remote;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const std::size_t n = sizes[i] * packet_bytes;
    if (n == 0) continue;
    local.push_back({buffers[i], n});
    remote.push_back(
        {reinterpret_cast<void*>(static_cast<std::uintptr_t>(meta.chunk[i].address)), n});
    bytes += n;
  }
  if (!read_remote(pid, local, remote, bytes)) {
    throw IoError(std::string("MpiFabric: reading a stream frame from rank 0's memory failed: ") +
                  std::strerror(errno));
  }
}

#else

std::int64_t agree_on_direct_reads(Link& link, bool) {
  DirectProbe probe;  // rank 0 offers nothing: frames go by broadcast
  link.bcast(&probe, sizeof probe, MPI_BYTE, "direct-read probe");
  int ok = 0;
  link.allreduce_min(ok, link.comm(), "direct-read probe");
  return 0;
}

void read_frame(std::int64_t, const FrameMeta&, const std::vector<void*>&,
                const std::vector<std::size_t>&, std::size_t) {
  throw IoError("MpiFabric: direct reads are not available on this system");
}

#endif

}  // namespace sluice::mpi
