#pragma once
// What hwloc finds on this machine, and pinning of threads to cores.
#include <cstdint>
#include <string>

namespace sluice {

struct Topology {
  std::int32_t packages = 0;
  std::int32_t cores = 0;
  std::int32_t hardware_threads = 0;
  std::int32_t numa_nodes = 0;
  std::int64_t l1d_bytes = 0;  ///< per core
  std::int64_t l2_bytes = 0;   ///< per core (or per L2 instance)
  std::int64_t l3_bytes = 0;   ///< per L3 instance
  std::int32_t l3_caches = 0;  ///< L3 instances
  /// A core's share of the caches: the L3 over the cores sharing it (at most 12 MiB), at
  /// least the core's own L2.
  std::int64_t cache_share_bytes() const;
  std::string to_string() const;
};

/// Detected once (hwloc), then cached. Falls back to conservative defaults when hwloc
/// reports nothing (e.g. in a restricted container).
const Topology& topology();

/// CPUs (hardware threads) this process may run on: its cgroup's allowed set, or, when
/// the process was started with a narrower affinity mask (taskset, mpirun --bind-to), that
/// mask. An OpenMP runtime told to bind (OMP_PROC_BIND, OMP_PLACES) narrows the main
/// thread to one place as it loads; sluice widens it back to this set when it loads, so
/// its thread pool (which takes the mask it finds) can use every core.
std::int32_t process_cpus();
/// CPUs the calling thread's affinity mask allows now.
std::int32_t thread_cpus();
/// CPUs of the cgroup's allowed set: what an affinity mask may at most allow.
std::int32_t allowed_cpus();

/// Binds the calling thread to core `core % cores`; returns false if the OS refused.
bool pin_current_thread_to_core(std::int32_t core);

}  // namespace sluice
