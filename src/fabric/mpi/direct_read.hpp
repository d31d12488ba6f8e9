#pragma once
// Direct reads: when every rank shares rank 0's node, engines read each stream frame
// straight out of rank 0's memory with one process_vm_readv, a single copy by the engine
// (the one Open MPI's shared-memory transport makes for a contiguous message; a frame of
// several chunk buffers would go through its bounce buffers instead, two copies and a
// handshake every 32 KB, which needs both ranks running at once). Internal.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fabric/mpi/link.hpp"
#include "fabric/mpi/wire.hpp"

namespace sluice::mpi {

/// Collective: whether the engines read frames directly. Rank 0 offers it when `wanted`
/// (shared memory allowed and every rank on its node); each engine rank reads back a word
/// of rank 0's memory, and all agree (any refusal, and frames go by broadcast). Returns
/// rank 0's process id if they do, 0 if not.
std::int64_t agree_on_direct_reads(Link& link, bool wanted);

/// Reads the frame `meta` describes from rank 0's process `pid` into `buffers` (of
/// `sizes` packets of `packet_bytes`); IoError if the OS refuses.
void read_frame(std::int64_t pid, const FrameMeta& meta, const std::vector<void*>& buffers,
                const std::vector<std::size_t>& sizes, std::size_t packet_bytes);

}  // namespace sluice::mpi
