// bench_mpi_fabric: MpiFabric's weight-stream broadcast and gradient return against plain
// MPI collectives moving the same bytes. Run under mpirun with >= 2 ranks, e.g.
//   mpirun -np 2 build/bench/bench_mpi_fabric [stream MB, default 64] [rounds, default 7]
// (--help for the options).
// Times are medians (the machine may be shared; best-of hides that). The transport
// comparison runs in rounds, plain collectives and the fabric back to back, and reports the
// median of the per-round ratios.
// Transport (MpiFabric::probe, no engine work):
// * broadcast: the fp32 weight stream of ~MB megabytes, and the same layer as a bf16
//   stream (half the bytes), each against one MPI_Bcast of as many bytes;
// * gradient return: what the fabric moves back is one float per weight (the tags are
//   rank 0's own), summed over the engines; timed from the moment every engine holds its
//   gradient stream to the summed, checked stream on rank 0 (last_gradient_seconds),
//   against one MPI_Reduce (MPI_SUM of float, all ranks) of as many values.
// Both sides move the same bytes but do not end in the same state: MPI_Reduce leaves 4-byte
// sums, the fabric a gradient stream (8-byte packets: rank 0 also writes every tag from the
// stream it sent, 2x the output bytes), so the return ratio is a floor on the transport's.
// The plain collectives use Open MPI's single copy (CMA) for a contiguous buffer, whose
// speed here varies from run to run (4-8 GB/s on this VM); on one node the fabric's engines
// read the frames themselves, also a single copy (between nodes, frames are Ibcasts; see
// mpi_fabric.hpp). Such a copy pins every source page, so it is much faster from huge
// pages: the fabric's chunks are in huge pages (ChunkAllocator), the plain buffers are
// std::vectors, so the fp32 broadcast is also compared with MPI_Bcast of a buffer in huge
// pages (the plain collective's best case). Another busy process slows every copy: check
// the load before trusting a ratio.
// Whole operations: forward (one token per engine, so the engines' arithmetic is small)
// and backward (mask stream, no dX), with the local engine time (the same work on one
// CpuEngine in rank 0, no MPI): an operation cannot beat max(plain transfer, engine).
#include <mpi.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <span>
#include <vector>

#include <CLI/CLI.hpp>

#include "sluice/engine.hpp"
#include "sluice/fabric.hpp"
#include "sluice/mpi_fabric.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median wall time of fn() over `reps` calls, after one warm-up call.
template <typename Fn>
double median_of(int reps, Fn&& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    fn();
    t.push_back(now() - t0);
  }
  return median(t);
}

// Plain collectives, on every rank: each repetition starts together (barrier) and is
// timed on rank 0 until its own call returns (for MPI_Reduce: the sum is complete).
template <typename Fn>
double collective_median(int reps, Fn&& fn) {
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = now();
    fn();
    if (r > 0) t.push_back(now() - t0);  // the first call warms up
  }
  return median(t);
}

void plain_bcast(std::span<char> buffer) {
  for (std::size_t off = 0; off < buffer.size(); off += std::size_t{1} << 30) {
    const auto n =
        static_cast<int>(std::min<std::size_t>(std::size_t{1} << 30, buffer.size() - off));
    MPI_Bcast(buffer.data() + off, n, MPI_BYTE, 0, MPI_COMM_WORLD);
  }
}

// A buffer of `bytes` in 2 MB pages where the kernel grants them (a hint: else 4 KB).
struct HugeBuffer {
  static constexpr std::size_t kHuge = std::size_t{2} << 20;
  explicit HugeBuffer(std::size_t bytes) : size((bytes + kHuge - 1) / kHuge * kHuge) {
    data = static_cast<char*>(std::aligned_alloc(kHuge, size));
    if (data == nullptr) throw std::bad_alloc();
#if defined(__linux__)
    (void)madvise(data, size, MADV_HUGEPAGE);
#endif
    std::memset(data, 1, size);
  }
  ~HugeBuffer() {
    std::free(data);
  }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  std::size_t size;
  char* data;
};

/// The layer every rank builds (same seed) and its streams: 4096 outputs, 16384 inputs,
/// the density chosen for the fp32 stream's size, so the plain collectives move exactly
/// its bytes.
struct Layer {
  static constexpr std::int64_t kOutputs = 4096, kInputs = 16384;
  sluice::CsrMatrix w;
  sluice::WeightStream stream, stream_bf16, mask;
  std::uint64_t stream_bytes = 0, bf16_bytes = 0, nnz = 0;  // nnz: the values a return moves

  explicit Layer(double megabytes) {
    using namespace sluice;
    const double packets = megabytes * 1e6 / sizeof(Packet);
    const double density = std::min(1.0, packets / static_cast<double>(kOutputs * kInputs));
    w = CsrMatrix::random(kOutputs, kInputs, 1.0 - density, 1);
    w.fill_values(2, 0.01F);
    stream = encode_stream(w, StreamKind::weights);
    stream_bf16 = encode_stream(w, StreamKind::weights, kDefaultChunkPackets, Precision::bf16);
    mask = encode_stream(w, StreamKind::mask);
    stream_bytes = stream.byte_size();
    bf16_bytes = stream_bf16.byte_size();
    nnz = stream.header.nnz;
  }
};

/// Rank 0's per-round medians of the transport comparison, and the per-round ratios.
struct Transport {
  std::vector<double> bcast, bcast_huge, bcast_bf16, reduce;
  std::vector<double> probe, probe_bf16, gradient_return, echo;
  std::vector<double> bcast_ratio, bcast_huge_ratio, bcast_bf16_ratio, reduce_ratio;
};

/// Rounds of plain collectives and fabric probes back to back (a fresh fabric each round,
/// as serve() holds the engine ranks until stop()), so both see the same load on a shared
/// machine; ratios are taken per round. Every rank calls it; rank 0's result holds the times.
Transport measure_transport(const Layer& layer, int rank, int rounds) {
  using namespace sluice;
  constexpr int kPerRound = 3;
  std::vector<char> buffer(layer.stream_bytes, 1), buffer_bf16(layer.bf16_bytes, 1);
  HugeBuffer huge(layer.stream_bytes);
  std::vector<float> values(layer.nnz, 1.0F), sums(rank == 0 ? layer.nnz : 0);
  Transport t;
  for (int round = 0; round < rounds; ++round) {
    const double bcast = collective_median(kPerRound, [&] { plain_bcast(buffer); });
    const double bcast_huge = collective_median(kPerRound, [&] {
      plain_bcast({huge.data, layer.stream_bytes});
    });
    const double bcast_bf16 = collective_median(kPerRound, [&] { plain_bcast(buffer_bf16); });
    const double reduce = collective_median(kPerRound, [&] {
      MPI_Reduce(values.data(), sums.data(), static_cast<int>(layer.nnz), MPI_FLOAT, MPI_SUM, 0,
                 MPI_COMM_WORLD);
    });
    double probe = 0, probe_bf16 = 0, gradient_return = 0;
    {
      MpiFabric fabric{MpiFabricOptions{}};
      if (!fabric.is_driver()) {
        fabric.serve();
      } else {
        probe = median_of(kPerRound, [&] {
          MemoryStreamSource source(layer.stream);
          (void)fabric.probe(source, false);
        });
        probe_bf16 = median_of(kPerRound, [&] {
          MemoryStreamSource source(layer.stream_bf16);
          (void)fabric.probe(source, false);
        });
        std::vector<double> returns;
        t.echo.push_back(median_of(kPerRound, [&] {
          MemoryStreamSource source(layer.stream);
          (void)fabric.probe(source, true);
          returns.push_back(fabric.last_gradient_seconds());
        }));
        returns.erase(returns.begin());  // the warm-up
        gradient_return = median(returns);
        fabric.stop();
      }
    }
    if (rank != 0) continue;
    t.bcast.push_back(bcast);
    t.bcast_huge.push_back(bcast_huge);
    t.bcast_bf16.push_back(bcast_bf16);
    t.reduce.push_back(reduce);
    t.probe.push_back(probe);
    t.probe_bf16.push_back(probe_bf16);
    t.gradient_return.push_back(gradient_return);
    t.bcast_ratio.push_back(bcast / probe);
    t.bcast_huge_ratio.push_back(bcast_huge / probe);
    t.bcast_bf16_ratio.push_back(bcast_bf16 / probe_bf16);
    t.reduce_ratio.push_back(reduce / gradient_return);
  }
  return t;
}

/// Whole operations through the fabric, and the same engine work on one CpuEngine in this
/// process (no MPI) for the bound.
struct Operations {
  std::int32_t engines = 0;
  double forward = 0, forward_bf16 = 0, backward = 0, backward_return = 0;
  double engine_forward = 0, engine_forward_bf16 = 0, engine_backward = 0;
};

Operations measure_operations(sluice::MpiFabric& fabric, const Layer& layer, int reps) {
  using namespace sluice;
  Operations o;
  o.engines = fabric.engine_count();
  const Geometry g = fabric.engine(0).geometry_for(Layer::kOutputs, Layer::kInputs, 1);
  const Placement placement = round_robin_placement(layer.w, std::max(1, g.lanes));
  std::vector<DenseMatrix> x, y, dy;
  std::vector<const Placement*> ps(static_cast<std::size_t>(o.engines), &placement);
  std::vector<ConstMatrixView> xs, dys;
  std::vector<MutableMatrixView> ys;
  for (std::int32_t k = 0; k < o.engines; ++k) {
    x.emplace_back(Layer::kInputs, 1);
    x.back().fill(1.0F);
    y.emplace_back(Layer::kOutputs, 1);
    dy.emplace_back(Layer::kOutputs, 1);
    dy.back().fill(1.0F);
  }
  for (std::int32_t k = 0; k < o.engines; ++k) {
    xs.push_back(x[static_cast<std::size_t>(k)].view());
    ys.push_back(y[static_cast<std::size_t>(k)].view());
    dys.push_back(dy[static_cast<std::size_t>(k)].view());
  }
  o.forward = median_of(reps, [&] {
    MemoryStreamSource source(layer.stream);
    fabric.forward(source, ps, xs, ys);
  });
  o.forward_bf16 = median_of(reps, [&] {
    MemoryStreamSource source(layer.stream_bf16);
    fabric.forward(source, ps, xs, ys);
  });
  std::vector<double> returns;
  o.backward = median_of(reps, [&] {
    MemoryStreamSource source(layer.mask);
    (void)fabric.backward(source, ps, xs, dys, {}, false);
    returns.push_back(fabric.last_gradient_seconds());
  });
  returns.erase(returns.begin());
  o.backward_return = median(returns);
  fabric.stop();
  CpuEngine local(EngineOptions{.threads = fabric.engine(0).threads()});
  DenseMatrix ly(Layer::kOutputs, 1);
  o.engine_forward =
      median_of(reps, [&] { local.forward(layer.stream, placement, x[0].view(), ly.view()); });
  o.engine_forward_bf16 =
      median_of(reps, [&] { local.forward(layer.stream_bf16, placement, x[0].view(), ly.view()); });
  o.engine_backward = median_of(reps, [&] {
    (void)local.backward(layer.mask, placement, x[0].view(), dy[0].view(), nullptr);
  });
  return o;
}

void print_report(const Layer& layer, const Transport& t, const Operations& o, int ranks,
                  int reps) {
  const double gb = 1e9;
  const auto stream_bytes = static_cast<double>(layer.stream_bytes);
  const auto bf16_bytes = static_cast<double>(layer.bf16_bytes);
  const double value_bytes = static_cast<double>(layer.nnz * sizeof(float));
  std::printf(
      "ranks %d (%d engines); layer %lldx%lld, %llu weights; fp32 stream %.1f MB, bf16 "
      "stream %.1f MB, gradient values %.1f MB; medians over %d rounds\n",
      ranks, o.engines, static_cast<long long>(Layer::kOutputs),
      static_cast<long long>(Layer::kInputs), static_cast<unsigned long long>(layer.nnz),
      stream_bytes / 1e6, bf16_bytes / 1e6, value_bytes / 1e6, reps);
  const double bcast_time = median(t.bcast), bcast_bf16_time = median(t.bcast_bf16);
  const double reduce_time = median(t.reduce);
  const double probe_bcast = median(t.probe), probe_bcast_bf16 = median(t.probe_bf16);
  const double gradient_return = median(t.gradient_return);
  std::printf(
      "broadcast fp32: fabric %.2f ms (%.2f GB/s) | MPI_Bcast %.2f ms (%.2f GB/s) | "
      "ratio %.2f\n",
      probe_bcast * 1e3, stream_bytes / probe_bcast / gb, bcast_time * 1e3,
      stream_bytes / bcast_time / gb, median(t.bcast_ratio));
  const double bcast_huge_time = median(t.bcast_huge);
  std::printf("  the same MPI_Bcast from huge pages: %.2f ms (%.2f GB/s) | ratio %.2f\n",
              bcast_huge_time * 1e3, stream_bytes / bcast_huge_time / gb,
              median(t.bcast_huge_ratio));
  std::printf(
      "broadcast bf16: fabric %.2f ms (%.2f GB/s) | MPI_Bcast %.2f ms (%.2f GB/s) | "
      "ratio %.2f | %.2fx faster than the fp32 stream\n",
      probe_bcast_bf16 * 1e3, bf16_bytes / probe_bcast_bf16 / gb, bcast_bf16_time * 1e3,
      bf16_bytes / bcast_bf16_time / gb, median(t.bcast_bf16_ratio),
      probe_bcast / probe_bcast_bf16);
  std::printf(
      "gradient return: fabric %.2f ms (%.2f GB/s) | MPI_Reduce %.2f ms (%.2f GB/s) | "
      "ratio %.2f (broadcast + return %.2f ms)\n",
      gradient_return * 1e3, value_bytes / gradient_return / gb, reduce_time * 1e3,
      value_bytes / reduce_time / gb, median(t.reduce_ratio), median(t.echo) * 1e3);
  std::printf(
      "forward fp32: fabric %.2f ms | MPI_Bcast %.2f ms | engine alone %.2f ms | "
      "max(plain,engine)/fabric %.2f\n",
      o.forward * 1e3, bcast_time * 1e3, o.engine_forward * 1e3,
      std::max(bcast_time, o.engine_forward) / o.forward);
  std::printf(
      "forward bf16: fabric %.2f ms | MPI_Bcast %.2f ms | engine alone %.2f ms | "
      "max(plain,engine)/fabric %.2f\n",
      o.forward_bf16 * 1e3, bcast_bf16_time * 1e3, o.engine_forward_bf16 * 1e3,
      std::max(bcast_bf16_time, o.engine_forward_bf16) / o.forward_bf16);
  const double plain_back = bcast_time + reduce_time;
  std::printf(
      "backward: fabric %.2f ms (gradient return %.2f ms) | MPI_Bcast + MPI_Reduce "
      "%.2f ms | engine alone %.2f ms | max(plain,engine)/fabric %.2f\n",
      o.backward * 1e3, o.backward_return * 1e3, plain_back * 1e3, o.engine_backward * 1e3,
      std::max(plain_back, o.engine_backward) / o.backward);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  double megabytes = 64.0;
  int reps = 7;
  CLI::App app{"bench_mpi_fabric: MpiFabric's streams against plain MPI collectives"};
  app.add_option("megabytes", megabytes, "the fp32 weight stream's size in MB")
      ->check(CLI::Range(0.01, 4096.0))
      ->capture_default_str();
  app.add_option("rounds", reps)->check(CLI::Range(1, 1000000))->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // --help too: every rank ends, rank 0 says why
    const int code = rank == 0 ? app.exit(e) : (e.get_exit_code() == 0 ? 0 : 2);
    MPI_Finalize();
    return code == 0 ? 0 : 2;
  }
  if (size < 2) {
    if (rank == 0) std::fprintf(stderr, "bench_mpi_fabric: run under mpirun with >= 2 ranks\n");
    MPI_Finalize();
    return 2;
  }
  try {
    const Layer layer(megabytes);
    const Transport transport = measure_transport(layer, rank, reps);
    sluice::MpiFabric fabric{sluice::MpiFabricOptions{}};
    if (!fabric.is_driver()) {
      fabric.serve();
    } else {
      const Operations operations = measure_operations(fabric, layer, reps);
      print_report(layer, transport, operations, size, reps);
    }
  } catch (const std::exception& e) {
    sluice::abort_all_ranks(e);
  }
  MPI_Finalize();
  return 0;
}
