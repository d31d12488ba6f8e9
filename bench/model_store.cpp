// bench_model_store: a TieredModelMemory against its file system, in one run.
//
//   bench_model_store DIR [layers] [sparsity] [budget_bytes] [steps] [batch] [rounds]  (--help)
//
// Measures the raw sequential read and write rate of DIR's file system (a scratch file
// written with 8 MiB pwrites and fsync'd, and another with 8 MiB O_DIRECT pwrites as the
// store writes its state files; the first read with 8 MiB preads after dropping its
// pages, and, where liburing is found, through io_uring with 4 reads of 8 MiB in flight,
// through the page cache and with O_DIRECT as the store reads; direct transfers go from
// and to memory in 2 MiB pages, as the store's do), then trains a model in DIR/store
// (created on the first run, resumed after) for `steps` steps per round, alternating with
// the raw measures, and prints per round: step time, the engines' compute time, the
// store's read rate (bytes over the time its reads took, CRC checks included) and its
// fraction of the best raw read, and its disk time at the best raw rates
// (`disk_seconds_at_raw`, `step_over_max` = step / max(compute, disk)); at the end the
// process's peak RSS, and the peak since the executor was built (`training_peak_rss_bytes`:
// creating the store builds each layer whole, its transpose too, which is not what
// training holds). JSON on stdout, progress on stderr. Deletes the scratch files.
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>
#ifdef SLUICE_HAVE_LIBURING
#include <liburing.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/huge_pages.hpp"
#include "sluice/executor.hpp"
#include "sluice/fabric.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "train_options.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kBlock = std::size_t{8} << 20;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Raw {
  double read_bytes_per_s = 0, write_bytes_per_s = 0;
  double uring_read_bytes_per_s = 0;         ///< 0 without liburing
  double uring_direct_read_bytes_per_s = 0;  ///< 0 without liburing or O_DIRECT
  double direct_write_bytes_per_s = 0;       ///< 0 where the file system refuses O_DIRECT
  double best_read() const {
    return std::max({read_bytes_per_s, uring_read_bytes_per_s, uring_direct_read_bytes_per_s});
  }
  double best_write() const { return std::max(write_bytes_per_s, direct_write_bytes_per_s); }
};

// Memory for direct transfers, in 2 MiB pages where the kernel gives them (as the store's
// buffers are: a request to the device holds a bounded number of memory segments), faulted
// in before any timing.
struct FreeHuge {
  void operator()(std::byte* p) const { std::free(p); }
};
using HugeBlock = std::unique_ptr<std::byte, FreeHuge>;
HugeBlock huge_block(std::size_t bytes) {
  HugeBlock block(static_cast<std::byte*>(sluice::detail::allocate_huge_pages(bytes)));
  std::memset(block.get(), 7, bytes);
  return block;
}

// The store writes its state files' whole blocks with O_DIRECT: the same file written so,
// 8 MiB at a time from an aligned buffer, then fsync'd.
double direct_write(const std::filesystem::path& path, std::uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return 0;
  const HugeBlock block = huge_block(kBlock);
  const auto t0 = Clock::now();
  std::uint64_t at = 0;
  for (; at < bytes; at += kBlock) {
    if (::pwrite(fd, block.get(), kBlock, static_cast<off_t>(at)) != static_cast<ssize_t>(kBlock))
      break;
  }
  ::fsync(fd);
  const double rate = at < bytes ? 0 : static_cast<double>(bytes) / since(t0);
  ::close(fd);
  std::filesystem::remove(path);
  return rate;
}

int open_uncached(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path.string());
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return fd;
}

#ifdef SLUICE_HAVE_LIBURING
// The same file read in 8 MiB blocks with `depth` reads in flight through io_uring, with
// O_DIRECT or through the page cache.
double uring_read(const std::filesystem::path& path, std::uint64_t bytes, unsigned depth,
                  bool direct) {
  io_uring ring;
  if (io_uring_queue_init(depth, &ring, 0) != 0) return 0;  // no io_uring in this kernel
  const HugeBlock blocks = huge_block(depth * kBlock);
  const int fd = open_uncached(path);
  const int direct_fd = direct ? ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC) : -1;
  if (direct && direct_fd < 0) {  // the file system refuses O_DIRECT
    ::close(fd);
    io_uring_queue_exit(&ring);
    return 0;
  }
  const auto t0 = Clock::now();
  std::uint64_t next = 0, done = 0;
  std::vector<unsigned> free_blocks;
  for (unsigned i = 0; i < depth; ++i) free_blocks.push_back(i);
  while (done < bytes) {
    while (!free_blocks.empty() && next < bytes) {
      const unsigned b = free_blocks.back();
      free_blocks.pop_back();
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      io_uring_prep_read(sqe, direct ? direct_fd : fd, blocks.get() + b * kBlock, kBlock, next);
      io_uring_sqe_set_data64(sqe, b);
      next += kBlock;
    }
    io_uring_submit(&ring);
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(&ring, &cqe) != 0 || cqe->res != static_cast<int>(kBlock)) {
      throw std::runtime_error("io_uring read failed");
    }
    free_blocks.push_back(static_cast<unsigned>(io_uring_cqe_get_data64(cqe)));
    io_uring_cqe_seen(&ring, cqe);
    done += kBlock;
  }
  const double rate = static_cast<double>(bytes) / since(t0);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (direct_fd >= 0) ::close(direct_fd);
  io_uring_queue_exit(&ring);
  return rate;
}
#endif

// Writes `bytes` to a scratch file and reads it back with its pages dropped first.
Raw raw_sequential(const std::filesystem::path& path, std::uint64_t bytes, bool uring_first) {
  std::vector<char> block(kBlock, 7);
  Raw r;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path.string());
  auto t0 = Clock::now();
  for (std::uint64_t at = 0; at < bytes; at += kBlock) {
    if (::pwrite(fd, block.data(), kBlock, static_cast<off_t>(at)) != static_cast<ssize_t>(kBlock))
      throw std::runtime_error("write failed");
  }
  ::fsync(fd);
  r.write_bytes_per_s = static_cast<double>(bytes) / since(t0);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  r.direct_write_bytes_per_s = direct_write(path.string() + ".direct", bytes);
#ifdef SLUICE_HAVE_LIBURING
  // Alternated by round: each reader goes first as often as the others.
  if (uring_first) {
    r.uring_read_bytes_per_s = uring_read(path, bytes, 4, false);
    r.uring_direct_read_bytes_per_s = uring_read(path, bytes, 4, true);
  }
#endif
  fd = open_uncached(path);
  t0 = Clock::now();
  for (std::uint64_t at = 0; at < bytes; at += kBlock) {
    if (::pread(fd, block.data(), kBlock, static_cast<off_t>(at)) != static_cast<ssize_t>(kBlock))
      throw std::runtime_error("read failed");
  }
  r.read_bytes_per_s = static_cast<double>(bytes) / since(t0);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
#ifdef SLUICE_HAVE_LIBURING
  if (!uring_first) {
    r.uring_direct_read_bytes_per_s = uring_read(path, bytes, 4, true);
    r.uring_read_bytes_per_s = uring_read(path, bytes, 4, false);
  }
#endif
  return r;
}

/// Resets the kernel's peak RSS of this process (VmHWM) to its current RSS; false where
/// the kernel does not let it.
bool reset_peak_rss() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

/// VmHWM of /proc/self/status in bytes, -1 if not found.
std::int64_t peak_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "VmHWM: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

}  // namespace

int run(int argc, char** argv);

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a budget too small for the model, a full disk
    std::fprintf(stderr, "bench_model_store: %s\n", e.what());
    return 1;
  }
}

int run(int argc, char** argv) {
  using namespace sluice;
  std::filesystem::path dir;
  std::string sizes_text = "256,2048,2048,2048,10";
  double sparsity = 0.75;
  std::int64_t budget = std::int64_t{1} << 30;
  int steps = 3;
  std::int64_t batch = 64;
  int rounds = 2;
  CLI::App app{"bench_model_store: a model store against its file system's raw rates"};
  app.add_option("dir", dir, "scratch directory (the store is DIR/store)")->required();
  app.add_option("layers", sizes_text, "layer sizes, as sluice train --layers takes them")
      ->capture_default_str();
  app.add_option("sparsity", sparsity)->check(CLI::Range(0.0, 0.999999))->capture_default_str();
  const auto at_least_one = CLI::Range(std::int64_t{1}, std::numeric_limits<std::int64_t>::max());
  app.add_option("budget", budget, "the store's RAM budget in bytes")
      ->check(at_least_one)
      ->capture_default_str();
  app.add_option("steps", steps, "steps per round")->check(at_least_one)->capture_default_str();
  app.add_option("batch", batch)->check(at_least_one)->capture_default_str();
  app.add_option("rounds", rounds)->check(at_least_one)->capture_default_str();
  std::vector<std::int64_t> sizes;
  try {
    app.parse(argc, argv);
    sizes = cli::parse_layers(sizes_text);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "bench_model_store: %s\n\n%s", e.what(), app.help().c_str());
    return 2;
  } catch (const cli::UsageError& e) {  // the layers, read as `sluice train --layers` reads them
    std::fprintf(stderr, "bench_model_store: %s\n", e.what());
    return 2;
  }
  std::filesystem::create_directories(dir);

  TieredModelMemory memory(dir / "store", budget);
  if (memory.layer_count() == 0) {
    const auto t0 = Clock::now();
    build_sparse_mlp(memory, sizes, sparsity, 1);
    std::fprintf(stderr, "built the store in %.1f s\n", since(t0));
  }
  const ModelStoreCounters built = memory.counters();
  LocalFabric fabric;
  LayerStreamingExecutor exec(memory, fabric);
  const bool training_peak = reset_peak_rss();
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  DenseMatrix x(sizes.front(), batch);
  std::vector<int> labels;
  for (std::int64_t t = 0; t < batch; ++t) {
    for (std::int64_t i = 0; i < x.rows(); ++i) x(i, t) = normal(rng);
    labels.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(sizes.back())));
  }
  const std::uint64_t raw_bytes =
      std::min<std::uint64_t>(built.store_bytes, std::uint64_t{4} << 30);
  double threads = fabric.engine(0).threads();
  std::printf("{\n  \"store_bytes\": %llu,\n  \"budget_bytes\": %lld,\n  \"rounds\": [\n",
              static_cast<unsigned long long>(built.store_bytes), static_cast<long long>(budget));
  for (int r = 0; r < rounds; ++r) {
    const Raw raw = raw_sequential(dir / "raw-read-scratch",
                                   std::max<std::uint64_t>(raw_bytes, kBlock), r % 2 == 1);
    std::filesystem::remove(dir / "raw-read-scratch");
    const ModelStoreCounters before = memory.counters();
    const StepMetrics m0 = exec.totals();
    const auto t0 = Clock::now();
    for (int s = 0; s < steps; ++s) exec.train_step({x.view(), labels, {}});
    const double wall = since(t0) / steps;
    const ModelStoreCounters after = memory.counters();
    const StepMetrics m1 = exec.totals();
    const double compute = (m1.engine_busy_seconds - m0.engine_busy_seconds) / threads / steps;
    const double read_bytes = static_cast<double>(after.read_bytes - before.read_bytes) / steps;
    const double write_bytes = static_cast<double>(after.write_bytes - before.write_bytes) / steps;
    const double read_seconds = (after.read_seconds - before.read_seconds) / steps;
    // Against the best the file system did in this round: a store that streams as fast as
    // its reads and writes can is at 1.0.
    const double disk = read_bytes / raw.best_read() + write_bytes / raw.best_write();
    std::printf(
        "    {\"raw_read_bytes_per_s\": %.4g, \"raw_uring_read_bytes_per_s\": %.4g, "
        "\"raw_uring_direct_read_bytes_per_s\": %.4g, "
        "\"raw_write_bytes_per_s\": %.4g, \"raw_direct_write_bytes_per_s\": %.4g, "
        "\"store_read_bytes_per_s\": %.4g, \"store_read_fraction_of_raw\": %.3f, "
        "\"step_seconds\": %.3f, \"compute_seconds\": %.3f, \"disk_seconds_at_raw\": %.3f, "
        "\"step_over_max\": %.3f, \"read_bytes_per_step\": %.4g, \"write_bytes_per_step\": "
        "%.4g, \"wait_seconds_per_step\": %.3f, \"read_seconds_per_step\": %.3f, "
        "\"write_seconds_per_step\": %.3f, \"optimizer_seconds_per_step\": %.3f}%s\n",
        raw.read_bytes_per_s, raw.uring_read_bytes_per_s, raw.uring_direct_read_bytes_per_s,
        raw.write_bytes_per_s, raw.direct_write_bytes_per_s, read_bytes / read_seconds,
        read_bytes / read_seconds / raw.best_read(), wall, compute, disk,
        wall / std::max(compute, disk), read_bytes, write_bytes,
        (after.wait_seconds - before.wait_seconds) / steps, read_seconds,
        (after.write_seconds - before.write_seconds) / steps,
        (m1.optimizer_seconds - m0.optimizer_seconds) / steps, r + 1 < rounds ? "," : "");
    std::fflush(stdout);
  }
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  std::printf("  ],\n  \"peak_rss_bytes\": %lld,\n  \"training_peak_rss_bytes\": %lld\n}\n",
              static_cast<long long>(usage.ru_maxrss) * 1024,
              static_cast<long long>(training_peak ? peak_rss_bytes() : -1));
  return 0;
}
