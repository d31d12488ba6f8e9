#include "sluice/topology.hpp"

#include <hwloc.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

namespace sluice {
namespace {

struct HwlocTopology {
  hwloc_topology_t handle = nullptr;
  HwlocTopology() {
    if (hwloc_topology_init(&handle) != 0) {
      handle = nullptr;
      return;
    }
    if (hwloc_topology_load(handle) != 0) {
      hwloc_topology_destroy(handle);
      handle = nullptr;
    }
  }
  ~HwlocTopology() {
    if (handle != nullptr) hwloc_topology_destroy(handle);
  }
};

HwlocTopology& hwloc() {
  static HwlocTopology instance;
  return instance;
}

std::int64_t cache_size(hwloc_topology_t t, hwloc_obj_type_t type) {
  hwloc_obj_t obj = hwloc_get_obj_by_type(t, type, 0);
  return obj != nullptr && obj->attr != nullptr ? static_cast<std::int64_t>(obj->attr->cache.size)
                                                : 0;
}

std::int32_t mask_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  return CPU_COUNT(&set);
}

// True when the environment tells an OpenMP runtime to bind its threads: it then binds the
// main thread too, to the first place, when it loads (before any code of ours runs).
bool openmp_binds() {
  const char* bind = std::getenv("OMP_PROC_BIND");
  const char* places = std::getenv("OMP_PLACES");
  if (bind != nullptr) return std::strcmp(bind, "false") != 0 && std::strcmp(bind, "FALSE") != 0;
  return places != nullptr && *places != '\0';
}

// The process's CPUs, settled once as the library loads: an OpenMP runtime's binding of
// the main thread is undone (the thread is widened to the cgroup's allowed set) before
// oneTBB starts and copies the main thread's mask to its workers. A mask the process was
// started with (taskset) is kept: without OpenMP binding, the mask is the user's.
std::int32_t settle_process_cpus() {
  const std::int32_t now = mask_cpus();
  if (!openmp_binds()) return now;
  hwloc_topology_t h = hwloc().handle;
  if (h == nullptr) return now;
  hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(h);
  const int count = allowed != nullptr ? hwloc_bitmap_weight(allowed) : -1;
  if (count <= now) return now;
  if (hwloc_set_cpubind(h, allowed, HWLOC_CPUBIND_THREAD) != 0) return now;
  return count;
}

const std::int32_t kProcessCpus = settle_process_cpus();

}  // namespace

std::int32_t process_cpus() {
  return kProcessCpus > 0 ? kProcessCpus : mask_cpus();
}

std::int32_t thread_cpus() {
  return mask_cpus();
}

std::int32_t allowed_cpus() {
  hwloc_topology_t h = hwloc().handle;
  hwloc_const_cpuset_t allowed = h != nullptr ? hwloc_topology_get_allowed_cpuset(h) : nullptr;
  const int count = allowed != nullptr ? hwloc_bitmap_weight(allowed) : -1;
  return count > 0 ? count : topology().hardware_threads;
}

std::int64_t Topology::cache_share_bytes() const {
  // No core has more than 12 MiB of L3 to itself (the most shipping so far: 96 MiB over 8
  // cores). A VM may claim more: it sees its few cores, not the host's that share the
  // cache (a 2-core VM may report the host's whole L3, twice).
  constexpr std::int64_t kMostL3PerCore = std::int64_t{12} << 20;
  const std::int64_t l3_total = l3_bytes * std::max(1, l3_caches);
  return std::max(l2_bytes, std::min(kMostL3PerCore, l3_total / std::max(1, cores)));
}

std::string Topology::to_string() const {
  std::ostringstream s;
  s << packages << " package(s), " << cores << " core(s), " << hardware_threads
    << " hardware thread(s), " << numa_nodes << " NUMA node(s); L1d " << l1d_bytes / 1024
    << " KiB, L2 " << l2_bytes / 1024 << " KiB per core, L3 " << l3_bytes / 1024 << " KiB x "
    << l3_caches;
  return s.str();
}

const Topology& topology() {
  static const Topology detected = [] {
    Topology t;
    hwloc_topology_t h = hwloc().handle;
    if (h != nullptr) {
      t.packages = hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_PACKAGE);
      t.cores = hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_CORE);
      t.hardware_threads = hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_PU);
      t.numa_nodes = hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_NUMANODE);
      t.l1d_bytes = cache_size(h, HWLOC_OBJ_L1CACHE);
      t.l2_bytes = cache_size(h, HWLOC_OBJ_L2CACHE);
      t.l3_bytes = cache_size(h, HWLOC_OBJ_L3CACHE);
      t.l3_caches = hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_L3CACHE);
    }
    // Conservative defaults where hwloc saw nothing.
    const auto hw = static_cast<std::int32_t>(std::max(1U, std::thread::hardware_concurrency()));
    if (t.cores <= 0) t.cores = hw;
    if (t.hardware_threads <= 0) t.hardware_threads = hw;
    if (t.packages <= 0) t.packages = 1;
    if (t.numa_nodes <= 0) t.numa_nodes = 1;
    if (t.l1d_bytes <= 0) t.l1d_bytes = 32 << 10;
    if (t.l2_bytes <= 0) t.l2_bytes = 512 << 10;
    if (t.l3_bytes <= 0) t.l3_bytes = 8 << 20;
    if (t.l3_caches <= 0) t.l3_caches = t.packages;
    return t;
  }();
  return detected;
}

bool pin_current_thread_to_core(std::int32_t core) {
  static std::mutex mutex;  // hwloc calls on one topology object are not all thread-safe
  std::lock_guard lock(mutex);
  hwloc_topology_t h = hwloc().handle;
  if (h == nullptr) return false;
  const int cores = hwloc_get_nbobjs_by_type(h, HWLOC_OBJ_CORE);
  if (cores <= 0) return false;
  hwloc_obj_t obj = hwloc_get_obj_by_type(h, HWLOC_OBJ_CORE, core % cores);
  if (obj == nullptr || obj->cpuset == nullptr) return false;
  return hwloc_set_cpubind(h, obj->cpuset, HWLOC_CPUBIND_THREAD) == 0;
}

}  // namespace sluice
