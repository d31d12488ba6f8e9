#include "fabric/mpi/link.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "core/background_work.hpp"
#include "fabric/mpi/wire.hpp"
#include "sluice/mpi_fabric.hpp"

namespace sluice::mpi {
namespace {

using Seconds = std::chrono::duration<double>;

// How long a wait yields between polls before it sleeps. A frame's wait is shorter, and a
// sleep's wake-up would add to each; a wait for an engine's whole pass is longer, and a
// rank that yields for all of it stays runnable beside the engine's threads, taking turns
// with them where ranks share cores. While this process's own background work runs
// (ModelMemory's producers and optimizer, background_work.hpp) a wait sleeps at once:
// yielding would take turns with that work, which the engines are waiting for.
constexpr Seconds kYieldFor{0.001};
// How long ranks have to answer a roll call.
constexpr double kMaxGraceSeconds = 2.0;

std::string rank_name(int r) {
  return "rank " + std::to_string(r) +
         (r == 0 ? " (the driver)" : " (engine " + std::to_string(r - 1) + ")");
}

std::string seconds_text(double s) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", s);
  return text;
}

}  // namespace

Link::Link(MPI_Comm comm, double peer_timeout_seconds)
    : comm_(comm), peer_timeout_(peer_timeout_seconds) {
  mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
}

void Link::wait_all(int count, MPI_Request* requests, const char* what) {
  Clock::time_point since = Clock::now();
  while (true) {
    int done = 0;
    mpi_check(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), what);
    if (done) return;
    pause(since, what);
  }
}

void Link::wait_until(const std::function<bool()>& ready, const char* what) {
  Clock::time_point since = Clock::now();
  while (!ready()) pause(since, what);
}

void Link::pause(Clock::time_point& since, const char* what) {
  answer_roll_calls();
  const Clock::time_point now = Clock::now();
  const Seconds waited = now - since;
  if (peer_timeout_ > 0 && waited.count() >= peer_timeout_) {
    call_roll(what);
    since = Clock::now();  // every rank answered: slow, not stalled
    return;
  }
  if (waited < kYieldFor && !detail::background_work_running()) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(waited < Seconds(1) ? std::chrono::microseconds(100)
                                                    : std::chrono::microseconds(1000));
  }
}

void Link::answer_roll_calls() {
  while (true) {
    int pinged = 0;
    MPI_Status status;
    mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, kPingTag, comm_, &pinged, &status), "roll call");
    if (!pinged) return;
    std::int64_t call = 0;
    mpi_check(
        MPI_Recv(&call, 1, MPI_INT64_T, status.MPI_SOURCE, kPingTag, comm_, MPI_STATUS_IGNORE),
        "roll call");
    mpi_check(MPI_Send(&call, 1, MPI_INT64_T, status.MPI_SOURCE, kPongTag, comm_), "roll call");
  }
}

void Link::call_roll(const char* what) {
  const std::int64_t call = (std::int64_t{rank_} << 40) | ++roll_calls_;
  std::vector<MPI_Request> pings(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) {
      mpi_check(
          MPI_Isend(&call, 1, MPI_INT64_T, r, kPingTag, comm_, &pings[static_cast<std::size_t>(r)]),
          "roll call");
    }
  }
  std::vector<char> answered(static_cast<std::size_t>(size_), 0);
  answered[static_cast<std::size_t>(rank_)] = 1;
  int missing = size_ - 1;
  const Clock::time_point end = Clock::now() + std::chrono::duration_cast<Clock::duration>(Seconds(
                                                   std::min(peer_timeout_, kMaxGraceSeconds)));
  while (missing > 0 && Clock::now() < end) {
    answer_roll_calls();  // another rank may be calling the roll too
    int in = 0;
    MPI_Status status;
    mpi_check(MPI_Iprobe(MPI_ANY_SOURCE, kPongTag, comm_, &in, &status), "roll call");
    if (!in) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      continue;
    }
    std::int64_t echo = 0;
    mpi_check(
        MPI_Recv(&echo, 1, MPI_INT64_T, status.MPI_SOURCE, kPongTag, comm_, MPI_STATUS_IGNORE),
        "roll call");
    char& seen = answered[static_cast<std::size_t>(status.MPI_SOURCE)];
    if (echo == call && seen == 0) {
      seen = 1;
      --missing;
    }
  }
  if (missing > 0) {
    std::string silent;
    for (int r = 0; r < size_; ++r) {
      if (answered[static_cast<std::size_t>(r)] == 0) {
        silent += (silent.empty() ? "" : ", ") + rank_name(r);
      }
    }
    abort_all_ranks(("MpiFabric: peer timeout: " + silent + (missing > 1 ? " have" : " has") +
                     " not answered for " + seconds_text(peer_timeout_) + " s while " +
                     rank_name(rank_) + " waited in " + what +
                     " (--peer-timeout; 0 waits forever); ending the job")
                        .c_str());
  }
  mpi_check(MPI_Waitall(size_, pings.data(), MPI_STATUSES_IGNORE), "roll call");
}

void Link::bcast(void* data, int count, MPI_Datatype type, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(MPI_Ibcast(data, count, type, 0, comm_, &r), what);
  wait(r, what);
}

void Link::scatter(const void* all, void* mine, int count, MPI_Datatype type, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(MPI_Iscatter(all, count, type, mine, count, type, 0, comm_, &r), what);
  wait(r, what);
}

void Link::scatterv(const void* all, const int* counts, const int* displs, void* mine, int count,
                    MPI_Datatype type, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(MPI_Iscatterv(all, counts, displs, type, mine, count, type, 0, comm_, &r), what);
  wait(r, what);
}

void Link::gather(const void* mine, int count, MPI_Datatype type, void* all, const char* what) {
  MPI_Request r = start_gather(mine, count, type, all, what);
  wait(r, what);
}

MPI_Request Link::start_gather(const void* mine, int count, MPI_Datatype type, void* all,
                               const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(MPI_Igather(mine, count, type, all, count, type, 0, comm_, &r), what);
  return r;
}

void Link::gatherv(const void* mine, int count, void* all, const int* counts, const int* displs,
                   MPI_Datatype type, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(MPI_Igatherv(mine, count, type, all, counts, displs, type, 0, comm_, &r), what);
  wait(r, what);
}

void Link::allreduce_min(int& value, MPI_Comm comm, const char* what) {
  MPI_Request r = MPI_REQUEST_NULL;
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, &value, 1, MPI_INT, MPI_MIN, comm, &r), what);
  wait(r, what);
}

}  // namespace sluice::mpi
