#pragma once
// MpiFabric's wire format: the fixed-size records rank 0 and the engine ranks exchange,
// and the MPI datatypes a stream frame travels as. Every rank runs the same build, so the
// records go as raw bytes. Internal.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sluice/stream.hpp"

namespace sluice::mpi {

enum class Op : std::int32_t {
  forward = 1,
  backward = 2,
  stop = 3,
  probe = 4,
  probe_echo = 5,
  // Layer operations on the engines' activation stores.
  load_batch = 6,
  forward_layer = 7,
  loss = 8,
  backward_layer = 9,
  gather_output = 10,
  layer_activations = 11,
  load_samples = 12,
  // Block operations on the engines' block stores (a GPT's step).
  load_tokens = 13,
  block_op = 14,
  block_logits = 15,
  // RigL's growth scores on the engines' activations.
  growth_top_k = 16,
};
constexpr std::int32_t kLastOp = static_cast<std::int32_t>(Op::growth_top_k);

struct ChunkMeta {
  std::int64_t packets = 0;
  std::uint32_t first_output = 0;
  std::uint32_t outputs = 0;
  std::uint64_t address = 0;  ///< of the packets in rank 0's memory, for direct reads
};

// Chunks travel in frames: one Ibcast moves several chunks (an hindexed datatype over
// their packet buffers, no copy), so small chunks do not pay MPI's per-message cost.
constexpr std::int32_t kMaxFrameChunks = 64;
// Frames start at this many bytes and double up to MpiFabricOptions::frame_bytes, so
// that the engines start on the first chunks sooner.
constexpr std::size_t kFirstFrameBytes = std::size_t{256} << 10;

/// What the receivers need to post a frame's broadcast; chunks 0: the stream has ended.
struct FrameMeta {
  std::int32_t chunks = 0;
  std::int32_t unused = 0;
  ChunkMeta chunk[kMaxFrameChunks];
};

/// Broadcast from rank 0 at the start of every operation.
struct Command {
  std::int32_t op = 0;
  std::int32_t want_dx = 0;  ///< any engine wants dX (then dX is gathered)
  std::uint32_t kind = 0, outputs = 0, inputs = 0;
  std::uint32_t precision = 0;  ///< the weight stream's: which packets its frames carry
  std::uint32_t order = 0;      ///< by output or by input: which of outputs/inputs is X's
  std::uint32_t unused = 0;
  std::uint64_t nnz = 0;
  // Layer operations: the layer, flags (see kFlag...), the batch's tokens.
  std::int32_t layer = 0;
  std::int32_t flags = 0;
  std::int64_t total_tokens = 0;
  // block_op: the BlockOp (layer holds the block); growth_top_k of a block model's
  // projection the same way (0: an MLP layer's).
  std::int32_t block_op = 0;
  std::int32_t unused2 = 0;
  FrameMeta first;  ///< the stream's first frame
};
// Command::flags of the layer operations.
constexpr std::int32_t kFlagLabels = 1;    // load_batch: labels follow
constexpr std::int32_t kFlagTargets = 2;   // load_batch: targets follow
constexpr std::int32_t kFlagTraining = 4;  // load_batch: a training pass
constexpr std::int32_t kFlagBias = 8;      // forward_layer: a bias follows; backward: wanted
constexpr std::int32_t kFlagDelta = 16;    // loss: the delta is wanted

/// load_tokens: the block model's shape, broadcast after the command (whose total_tokens
/// is the batch's tokens, flags kFlagTargets and kFlagTraining).
struct WireShape {
  std::int64_t vocab = 0, context = 0, d_model = 0, heads = 0, blocks = 0;
};

/// The stream header a command carries; FormatError for a precision or order no build
/// knows.
StreamHeader header_of(const Command& command);

/// An engine's LossSums on the wire.
struct WireLoss {
  double loss = 0;
  std::int64_t correct = 0, tokens = 0, non_finite = 0;
};

/// Scattered from rank 0: one engine's share of the operation.
struct Job {
  std::int64_t tokens = 0;
  std::int32_t lanes = 1;
  std::int32_t want_dx = 0;
};

/// Gathered to rank 0 after every operation.
struct Reply {
  double busy_seconds = 0, intake_seconds = 0;
  double arrival_seconds = 0, overlapped_seconds = 0;
  std::uint64_t packets = 0, bytes = 0;
  std::uint64_t grad_packets = 0;
  std::uint64_t grad_values = 0;  ///< weight packets in the gradient stream: values sent
  std::uint32_t grad_kind = 0, grad_outputs = 0, grad_inputs = 0, grad_order = 0;
  std::uint64_t grad_nnz = 0;
};

/// Engine options as rank 0 sends them, and what each engine rank resolved.
struct WireEngine {
  std::int32_t lanes = 0, blocks = 0, tile_tokens = 0, threads = 0;
  std::int32_t isa = -1, pin = 0, shares = 0, path = 0;  ///< path: ProductPath
  std::int64_t tile_cache_bytes = 0;
};

/// What rank 0 tells the engine ranks at the start, to decide on direct reads: its process,
/// and a word of its memory they must read back.
struct DirectProbe {
  std::int32_t wanted = 0;  ///< shared_memory and every rank on rank 0's node
  std::int32_t unused = 0;
  std::int64_t pid = 0;
  std::uint64_t address = 0;
  std::uint64_t expected[2] = {0, 0};
};

// Point-to-point tags on the fabric's communicator.
constexpr int kGradientTag = 17;   // gradient values, up the engines' tree and to rank 0
constexpr int kFrameReadTag = 18;  // direct reads: an engine has read a frame
constexpr int kPingTag = 19;       // peer timeout: are you there?
constexpr int kGrowthTag = 20;     // RigL: gradient tiles along the engines, candidates back
constexpr int kPongTag = 20;       // ... yes

// Gradient values travel in segments of this many floats: the reduction tree and rank 0's
// unpacking work on one segment while the next is in transfer.
constexpr std::uint64_t kSegmentValues = std::uint64_t{1} << 18;

/// Throws IoError naming `what` unless rc is MPI_SUCCESS.
void mpi_check(int rc, const char* what);
/// n as an MPI count; ResourceError if it is over INT_MAX.
int to_count(std::uint64_t n, const char* what);

/// A chunk's packet buffer of the stream's precision; FormatError if it carries the other.
const void* packet_data(const StreamChunk& c, Precision precision);
/// One datatype over a frame's packet buffers (of the stream's precision), with absolute
/// addresses (used with MPI_BOTTOM). The caller frees it.
MPI_Datatype chunks_type(Precision precision, const std::vector<const void*>& buffers,
                         const std::vector<std::size_t>& sizes);

}  // namespace sluice::mpi
