// MpiFabric: the fabric across processes. Rank 0 drives (executor, ModelMemory; see
// driver_rank.hpp); every other rank serves one CpuEngine (engine_rank.hpp). This file
// sets them up: the communicator and its link, where the stream and the gradient may go
// through memory, and the engines' options. See include/sluice/mpi_fabric.hpp for the
// protocol.
#include "sluice/mpi_fabric.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "fabric/mpi/direct_read.hpp"
#include "fabric/mpi/driver_rank.hpp"
#include "fabric/mpi/engine_rank.hpp"
#include "fabric/mpi/gradient_tree.hpp"
#include "fabric/mpi/link.hpp"
#include "fabric/mpi/wire.hpp"
#include "sluice/error.hpp"
#include "sluice/topology.hpp"

namespace sluice {

[[noreturn]] void abort_all_ranks(const char* what) {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "sluice[rank %d]: %s\n", rank, what);
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

[[noreturn]] void abort_all_ranks(const std::exception& error) {
  abort_all_ranks(error.what());
}

namespace {

using mpi::mpi_check;

mpi::WireEngine wire_of(const EngineOptions& eo) {
  mpi::WireEngine wire;
  wire.lanes = eo.geometry.lanes;
  wire.blocks = eo.geometry.blocks;
  wire.tile_tokens = eo.geometry.tile_tokens;
  wire.shares = eo.geometry.shares;
  wire.threads = eo.threads;
  wire.isa = eo.isa ? static_cast<std::int32_t>(*eo.isa) : -1;
  wire.pin = eo.pin_threads ? 1 : 0;
  wire.tile_cache_bytes = eo.tile_cache_bytes;
  wire.path = static_cast<std::int32_t>(eo.path);
  return wire;
}

// Only what the wire carries: every engine (and its twin on rank 0) is built from rank 0's
// options alone.
EngineOptions options_from(const mpi::WireEngine& w) {
  EngineOptions o;
  o.geometry.lanes = w.lanes;
  o.geometry.blocks = w.blocks;
  o.geometry.tile_tokens = w.tile_tokens;
  o.geometry.shares = w.shares;
  o.threads = w.threads;
  if (w.isa >= 0) o.isa = static_cast<Isa>(w.isa);
  o.pin_threads = w.pin != 0;
  o.tile_cache_bytes = w.tile_cache_bytes;
  if (w.path < 0 || w.path > static_cast<std::int32_t>(ProductPath::dense)) {
    throw FormatError("MpiFabric: rank 0 sent product path " + std::to_string(w.path));
  }
  o.path = static_cast<ProductPath>(w.path);
  return o;
}

// Checks MPI is ready for the fabric; the rank's role decides the thread support needed.
void check_mpi(const MpiFabricOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw ArgumentError("MpiFabric: MPI is not initialised (call MPI_Init_thread)");
  if (options.window < 1) throw ArgumentError("MpiFabric: window must be >= 1");
  if (!(options.peer_timeout_seconds >= 0)) {
    throw ArgumentError("MpiFabric: peer_timeout_seconds must be >= 0 (0: wait forever)");
  }
  int rank = 0, size = 0;
  mpi_check(MPI_Comm_rank(options.comm, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(options.comm, &size), "MPI_Comm_size");
  if (size < 2) {
    throw ArgumentError(
        "MpiFabric: needs at least 2 ranks (rank 0 drives, the others are engines), got " +
        std::to_string(size));
  }
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  const int needed = rank == 0 ? MPI_THREAD_SERIALIZED : MPI_THREAD_FUNNELED;
  if (provided < needed) {
    throw UnsupportedError("MpiFabric: MPI was initialised without enough thread support (rank " +
                           std::to_string(rank) + " needs MPI_THREAD_" +
                           (rank == 0 ? "SERIALIZED" : "FUNNELED") +
                           "); use MPI_Init_thread with MPI_THREAD_MULTIPLE");
  }
}

struct NodeFacts {
  int ranks = 1;                  ///< ranks on this rank's node
  bool pair_shares_node = false;  ///< engine 0 (rank 1) is on rank 0's node, and may use it
};

// Rank 0 knows whether rank 1 shares its node (and whether shared memory is allowed), and
// tells everyone.
NodeFacts node_facts(mpi::Link& link, bool shared_memory) {
  MPI_Comm node = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split_type(link.comm(), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  NodeFacts facts;
  MPI_Comm_size(node, &facts.ranks);
  int shares = 0;
  if (link.rank() == 0) {
    MPI_Group all = MPI_GROUP_NULL, local = MPI_GROUP_NULL;
    MPI_Comm_group(link.comm(), &all);
    MPI_Comm_group(node, &local);
    const int one = 1;
    int in_node = MPI_UNDEFINED;
    MPI_Group_translate_ranks(all, 1, &one, local, &in_node);
    shares = in_node != MPI_UNDEFINED && shared_memory ? 1 : 0;
    MPI_Group_free(&all);
    MPI_Group_free(&local);
  }
  MPI_Comm_free(&node);
  link.bcast(&shares, 1, MPI_INT, "node broadcast");
  facts.pair_shares_node = shares != 0;
  return facts;
}

// An engine rank's engine, from rank 0's options and what this node has.
std::unique_ptr<CpuEngine> make_engine(mpi::WireEngine& wire, int node_ranks) {
  if (wire.threads <= 0) {
    const int cores = static_cast<int>(std::max(1U, std::thread::hardware_concurrency()));
    wire.threads = std::max(1, cores / node_ranks);
  }
  if (wire.tile_cache_bytes <= 0) wire.tile_cache_bytes = topology().cache_share_bytes();
  auto engine = std::make_unique<CpuEngine>(options_from(wire));
  wire.isa = static_cast<std::int32_t>(engine->isa());
  return engine;
}

}  // namespace

struct MpiFabric::Impl {
  MpiFabricOptions options;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm pair = MPI_COMM_NULL;  // ranks 0 and 1, when they share a node
  std::unique_ptr<mpi::Link> link;
  std::unique_ptr<mpi::GradientTree> tree;
  std::unique_ptr<mpi::DriverRank> driver;  // rank 0
  std::unique_ptr<mpi::EngineRank> engine;  // the others
  bool stopped = false;

  mpi::DriverRank& drive() {
    if (!driver) throw ArgumentError("MpiFabric: only rank 0 drives the fabric");
    if (stopped) throw ArgumentError("MpiFabric: the fabric was stopped");
    return *driver;
  }
};

MpiFabric::MpiFabric(MpiFabricOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.options = std::move(options);
  check_mpi(m.options);
  // A communicator of its own, so the fabric's collectives never match the caller's.
  mpi_check(MPI_Comm_dup(m.options.comm, &m.comm), "MPI_Comm_dup");
  // Errors come back as codes (mpi_check turns them into exceptions, which end every rank
  // with a message), and a window the MPI cannot make is not fatal.
  mpi_check(MPI_Comm_set_errhandler(m.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  m.link = std::make_unique<mpi::Link>(m.comm, m.options.peer_timeout_seconds);
  mpi::Link& link = *m.link;
  const bool driver = link.rank() == 0;

  mpi::WireEngine wire = wire_of(m.options.engine);
  link.bcast(&wire, sizeof wire, MPI_BYTE, "options broadcast");
  // Rank 0's shared_memory decides.
  const bool shared_memory = m.options.shared_memory;
  const NodeFacts node = node_facts(link, shared_memory);
  // Direct reads of the stream need every rank on rank 0's node and the OS's leave to read
  // another process's memory.
  const std::int64_t driver_pid =
      mpi::agree_on_direct_reads(link, shared_memory && node.ranks == link.size());
  if (node.pair_shares_node) {
    mpi_check(MPI_Comm_split(m.comm, link.rank() <= 1 ? 0 : MPI_UNDEFINED, link.rank(), &m.pair),
              "MPI_Comm_split");
  }
  m.tree = std::make_unique<mpi::GradientTree>(link, m.pair);
  const mpi::FrameOptions frames{m.options.window, m.options.frame_bytes, driver_pid != 0};

  std::unique_ptr<CpuEngine> engine;
  if (!driver) engine = make_engine(wire, node.ranks);
  std::vector<mpi::WireEngine> all(static_cast<std::size_t>(driver ? link.size() : 0));
  link.gather(&wire, sizeof wire, MPI_BYTE, all.data(), "engine gather");
  if (driver) {
    // Twins: the same engine as on rank k + 1, for geometry_for (so placements match what
    // that engine would choose) and for its counters.
    std::vector<std::unique_ptr<CpuEngine>> twins;
    for (int k = 1; k < link.size(); ++k) {
      EngineOptions o = options_from(all[static_cast<std::size_t>(k)]);
      o.pin_threads = false;
      twins.push_back(std::make_unique<CpuEngine>(o));
    }
    m.driver =
        std::make_unique<mpi::DriverRank>(link, frames, *m.tree, std::move(twins), counters_);
  } else {
    m.engine =
        std::make_unique<mpi::EngineRank>(link, frames, driver_pid, *m.tree, std::move(engine));
  }
}

MpiFabric::~MpiFabric() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (impl_->driver) {
    try {
      stop();
    } catch (const std::exception& e) {
      abort_all_ranks(e);
    }
  }
  impl_->driver.reset();
  impl_->engine.reset();
  impl_->tree.reset();
  if (impl_->pair != MPI_COMM_NULL) MPI_Comm_free(&impl_->pair);
  if (impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
}

int MpiFabric::rank() const {
  return impl_->link->rank();
}

double MpiFabric::last_gradient_seconds() const {
  return impl_->tree->last_seconds();
}

void MpiFabric::stop() {
  Impl& m = *impl_;
  if (!m.driver) throw ArgumentError("MpiFabric::stop: only rank 0 stops the fabric");
  if (m.stopped) return;
  m.driver->stop();
  m.stopped = true;
}

void MpiFabric::serve() {
  Impl& m = *impl_;
  if (m.driver)
    throw ArgumentError("MpiFabric::serve: rank 0 drives the fabric, it does not serve");
  try {
    m.engine->serve(dataset());
    m.stopped = true;
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

std::int32_t MpiFabric::engine_count_impl() const {
  return impl_->link->engines();
}

Engine& MpiFabric::engine_impl(std::int32_t k) {
  Impl& m = *impl_;
  if (m.driver) return m.driver->twin(k);
  if (k != m.link->rank() - 1) {
    throw ArgumentError("MpiFabric: rank " + std::to_string(m.link->rank()) + " holds engine " +
                        std::to_string(m.link->rank() - 1) + " only, not engine " +
                        std::to_string(k));
  }
  return m.engine->engine();
}

void MpiFabric::forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                             std::span<const ConstMatrixView> xs,
                             std::span<const MutableMatrixView> ys) {
  impl_->drive().forward(weights, placements, xs, ys);
}

ReducedGradient MpiFabric::backward_impl(StreamSource& weights,
                                         std::span<const Placement* const> placements,
                                         std::span<const ConstMatrixView> xs,
                                         std::span<const ConstMatrixView> dys,
                                         std::span<MutableMatrixView* const> dxs, bool with_bias) {
  return impl_->drive().backward(weights, placements, xs, dys, dxs, with_bias);
}

ReducedGradient MpiFabric::probe(StreamSource& stream, bool echo) {
  return impl_->drive().probe(stream, echo);
}

void MpiFabric::load_batch_impl(const PassSpec& spec, const ShardData& batch) {
  impl_->drive().load_batch(spec, batch);
}

void MpiFabric::load_samples_impl(const PassSpec& spec, std::span<const std::int64_t> indices) {
  impl_->drive().load_samples(spec, indices);
}

void MpiFabric::forward_layer_impl(StreamSource& weights,
                                   std::span<const Placement* const> placements, std::int32_t layer,
                                   std::span<const float> bias) {
  impl_->drive().forward_layer(weights, placements, layer, bias);
}

std::vector<LossSums> MpiFabric::loss_impl(bool want_delta, std::int64_t total_tokens) {
  return impl_->drive().loss(want_delta, total_tokens);
}

ReducedGradient MpiFabric::backward_layer_impl(StreamSource& weights,
                                               std::span<const Placement* const> placements,
                                               std::int32_t layer, bool want_dx, bool with_bias) {
  return impl_->drive().backward_layer(weights, placements, layer, want_dx, with_bias);
}

DenseMatrix MpiFabric::gather_output_impl() {
  return impl_->drive().gather_output();
}

std::vector<std::int64_t> MpiFabric::growth_top_k_impl(const GrowthSource& source,
                                                       const CsrMatrix& mask, std::int64_t k) {
  return impl_->drive().growth_top_k(source, mask, k);
}

void MpiFabric::layer_activations_impl(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                                       std::vector<ConstMatrixView>& dzs) {
  impl_->drive().layer_activations(layer, xs, dzs);
}

void MpiFabric::load_tokens_impl(const BlockShape& shape, std::span<const std::int32_t> inputs,
                                 std::span<const std::int32_t> targets) {
  impl_->drive().load_tokens(shape, inputs, targets);
}

BlockResult MpiFabric::run_block_impl(const BlockCall& call, StreamSource* weights,
                                      std::span<const Placement* const> placements,
                                      std::span<const float> bias) {
  return impl_->drive().run_block(call, weights, placements, bias);
}

std::vector<float> MpiFabric::block_logits_impl(std::int64_t token) {
  return impl_->drive().block_logits(token);
}

}  // namespace sluice
