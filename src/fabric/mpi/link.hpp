#pragma once
// The fabric's communicator as every rank uses it: waits that give the core away and
// answer other ranks' roll calls, and the peer timeout. Internal.
//
// MPI's own waits spin on a core (the engine's threads, or another rank on the node, need
// it), and a peer that stopped answering leaves them spinning forever. So every wait of
// the fabric polls, yields the core, then sleeps between polls the longer it waits; and a
// wait that has seen no progress for the peer timeout calls the roll: it pings every
// other rank, which answer from inside their own waits. A rank that does not answer within
// a grace period is named and the job ends (MPI_Abort, exit code 1). If every rank
// answers, the job is slow, not stalled, and the wait goes on.
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>

namespace sluice::mpi {

class Link {
 public:
  using Clock = std::chrono::steady_clock;

  /// `peer_timeout_seconds` 0: wait forever.
  Link(MPI_Comm comm, double peer_timeout_seconds);

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  std::int32_t engines() const { return size_ - 1; }

  /// Waits for all `requests` (see above); `what` names the wait in errors.
  void wait_all(int count, MPI_Request* requests, const char* what);
  void wait(MPI_Request& request, const char* what) { wait_all(1, &request, what); }
  /// Waits until `ready()` (polled between pauses).
  void wait_until(const std::function<bool()>& ready, const char* what);
  /// For a caller's own polling loop, when a poll made no progress since `since`: answers
  /// roll calls, calls one after the peer timeout, and yields or sleeps.
  void pause(Clock::time_point& since, const char* what);

  // Collectives rooted at rank 0 (buffers that do not matter on a rank may be null),
  // started non-blocking and finished by wait_all.
  void bcast(void* data, int count, MPI_Datatype type, const char* what);
  void scatter(const void* all, void* mine, int count, MPI_Datatype type, const char* what);
  void scatterv(const void* all, const int* counts, const int* displs, void* mine, int count,
                MPI_Datatype type, const char* what);
  void gather(const void* mine, int count, MPI_Datatype type, void* all, const char* what);
  /// gather, started only: finished by wait (the buffers stay the caller's until then).
  MPI_Request start_gather(const void* mine, int count, MPI_Datatype type, void* all,
                           const char* what);
  void gatherv(const void* mine, int count, void* all, const int* counts, const int* displs,
               MPI_Datatype type, const char* what);
  /// The minimum of `value` over `comm` (this fabric's, or a part of it).
  void allreduce_min(int& value, MPI_Comm comm, const char* what);

 private:
  void answer_roll_calls();
  void call_roll(const char* what);

  MPI_Comm comm_;
  int rank_ = 0, size_ = 0;
  double peer_timeout_;
  std::int64_t roll_calls_ = 0;
};

}  // namespace sluice::mpi
