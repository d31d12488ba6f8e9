// bench_mpi_fabric: MpiFabric's weight-stream broadcast and gradient return against plain
// MPI collectives moving the same bytes. Run under mpirun with >= 2 ranks, e.g.
//   mpirun -np 2 build/bench/bench_mpi_fabric [stream MB, default 64] [repetitions, default 5]
// Transport (MpiFabric::probe, no engine work): the weight-stream broadcast of a ~MB
// megabyte stream against one MPI_Bcast of as many bytes; the broadcast with the gradient
// values coming back and summed (probe echo) against MPI_Bcast + MPI_Reduce of the values.
// Whole operations: forward (one token per engine, so the engines' arithmetic is small)
// and backward (mask stream, no dX), with the local engine time (the same work on one
// CpuEngine in rank 0, no MPI): an operation cannot beat max(plain transfer, engine).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sluice/engine.hpp"
#include "sluice/fabric.hpp"
#include "sluice/mpi_fabric.hpp"
#include "sluice/planner.hpp"
#include "sluice/stream.hpp"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename Fn>
double best_of(int reps, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    fn();
    best = std::min(best, now() - t0);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const double megabytes = argc > 1 ? std::atof(argv[1]) : 64.0;
  const int reps = argc > 2 ? std::max(1, std::atoi(argv[2])) : 5;
  if (size < 2) {
    if (rank == 0) std::fprintf(stderr, "bench_mpi_fabric: run under mpirun with >= 2 ranks\n");
    MPI_Finalize();
    return 2;
  }
  try {
    using namespace sluice;
    // The layer: 4096 outputs, 16384 inputs, density chosen for the stream's size.
    const std::int64_t outputs = 4096, inputs = 16384;
    const double packets = megabytes * 1e6 / sizeof(Packet);
    const double density = std::min(1.0, packets / static_cast<double>(outputs * inputs));
    const std::uint64_t stream_bytes =
        static_cast<std::uint64_t>(density * static_cast<double>(outputs * inputs)) *
        sizeof(Packet);
    const std::uint64_t value_count = stream_bytes / sizeof(Packet);

    // Plain collectives of the same sizes, on every rank.
    std::vector<char> buffer(stream_bytes, 1);
    std::vector<float> values(value_count, 1.0F), sums(rank == 0 ? value_count : 0);
    MPI_Barrier(MPI_COMM_WORLD);
    const double plain_bcast = best_of(reps, [&] {
      for (std::uint64_t off = 0; off < stream_bytes; off += 1 << 30) {
        const auto n = static_cast<int>(std::min<std::uint64_t>(1 << 30, stream_bytes - off));
        MPI_Bcast(buffer.data() + off, n, MPI_BYTE, 0, MPI_COMM_WORLD);
      }
      MPI_Barrier(MPI_COMM_WORLD);
    });
    const double plain_reduce = best_of(reps, [&] {
      MPI_Reduce(values.data(), sums.data(), static_cast<int>(value_count), MPI_FLOAT, MPI_SUM, 0,
                 MPI_COMM_WORLD);
      MPI_Barrier(MPI_COMM_WORLD);
    });

    MpiFabricOptions options;
    MpiFabric fabric(options);
    if (!fabric.is_driver()) {
      fabric.serve();
    } else {
      const std::int32_t engines = fabric.engine_count();
      CsrMatrix w = CsrMatrix::random(outputs, inputs, 1.0 - density, 1);
      w.fill_values(2, 0.01F);
      const WeightStream stream = encode_stream(w, StreamKind::weights);
      const WeightStream mask = encode_stream(w, StreamKind::mask);
      const Geometry g = fabric.engine(0).geometry_for(outputs, inputs, 1);
      const Placement placement = round_robin_placement(w, std::max(1, g.lanes));
      std::vector<DenseMatrix> x, y, dy;
      std::vector<const Placement*> ps(static_cast<std::size_t>(engines), &placement);
      std::vector<ConstMatrixView> xs, dys;
      std::vector<MutableMatrixView> ys;
      for (std::int32_t k = 0; k < engines; ++k) {
        x.emplace_back(inputs, 1);
        x.back().fill(1.0F);
        y.emplace_back(outputs, 1);
        dy.emplace_back(outputs, 1);
        dy.back().fill(1.0F);
      }
      for (std::int32_t k = 0; k < engines; ++k) {
        xs.push_back(x[static_cast<std::size_t>(k)].view());
        ys.push_back(y[static_cast<std::size_t>(k)].view());
        dys.push_back(dy[static_cast<std::size_t>(k)].view());
      }
      const double probe_bcast = best_of(reps, [&] {
        MemoryStreamSource source(stream);
        (void)fabric.probe(source, false);
      });
      const double probe_echo = best_of(reps, [&] {
        MemoryStreamSource source(stream);
        (void)fabric.probe(source, true);
      });
      const double fabric_forward = best_of(reps, [&] {
        MemoryStreamSource source(stream);
        fabric.forward(source, ps, xs, ys);
      });
      const double fabric_backward = best_of(reps, [&] {
        MemoryStreamSource source(mask);
        (void)fabric.backward(source, ps, xs, dys, {}, false);
      });
      fabric.stop();
      // The engines' own work, in this process, for the bound.
      CpuEngine local(EngineOptions{.threads = fabric.engine(0).threads()});
      DenseMatrix ly(outputs, 1);
      const double engine_forward =
          best_of(reps, [&] { local.forward(stream, placement, x[0].view(), ly.view()); });
      const double engine_backward = best_of(
          reps, [&] { (void)local.backward(mask, placement, x[0].view(), dy[0].view(), nullptr); });

      const double gb = 1e9;
      const double plain_back = plain_bcast + plain_reduce;
      std::printf("ranks %d (%d engines), stream %.1f MB (%llu packets), best of %d\n", size,
                  engines, static_cast<double>(stream_bytes) / 1e6,
                  static_cast<unsigned long long>(value_count), reps);
      std::printf(
          "transport broadcast: fabric %.2f ms (%.2f GB/s) | plain MPI_Bcast %.2f ms "
          "(%.2f GB/s) | ratio %.2f\n",
          probe_bcast * 1e3, static_cast<double>(stream_bytes) / probe_bcast / gb,
          plain_bcast * 1e3, static_cast<double>(stream_bytes) / plain_bcast / gb,
          plain_bcast / probe_bcast);
      std::printf(
          "transport broadcast + gradient return: fabric %.2f ms | plain MPI_Bcast + "
          "MPI_Reduce %.2f ms | ratio %.2f\n",
          probe_echo * 1e3, plain_back * 1e3, plain_back / probe_echo);
      std::printf(
          "forward : fabric %.2f ms (%.2f GB/s) | plain MPI_Bcast %.2f ms (%.2f GB/s) | "
          "engine alone %.2f ms | ratio plain/fabric %.2f, max(plain,engine)/fabric %.2f\n",
          fabric_forward * 1e3, static_cast<double>(stream_bytes) / fabric_forward / gb,
          plain_bcast * 1e3, static_cast<double>(stream_bytes) / plain_bcast / gb,
          engine_forward * 1e3, plain_bcast / fabric_forward,
          std::max(plain_bcast, engine_forward) / fabric_forward);
      std::printf(
          "backward: fabric %.2f ms | plain MPI_Bcast + MPI_Reduce %.2f ms (reduce %.2f ms, "
          "%.2f GB/s) | engine alone %.2f ms | ratio plain/fabric %.2f, "
          "max(plain,engine)/fabric %.2f\n",
          fabric_backward * 1e3, plain_back * 1e3, plain_reduce * 1e3,
          static_cast<double>(value_count * sizeof(float)) / plain_reduce / gb,
          engine_backward * 1e3, plain_back / fabric_backward,
          std::max(plain_back, engine_backward) / fabric_backward);
    }
  } catch (const std::exception& e) {
    sluice::abort_all_ranks(e);
  }
  MPI_Finalize();
  return 0;
}
