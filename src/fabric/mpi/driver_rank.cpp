#include "fabric/mpi/driver_rank.hpp"

#include <cstring>
#include <string>
#include <type_traits>

#include "fabric/gradient_tree.hpp"
#include "sluice/error.hpp"
#include "sluice/mpi_fabric.hpp"

namespace sluice::mpi {
namespace {

void check_slice(const char* what, std::size_t k, std::int64_t rows, std::int64_t cols,
                 std::int64_t want_rows, std::int64_t want_cols) {
  if (rows != want_rows || cols != want_cols) {
    throw ShapeError(std::string("MpiFabric: ") + what + " of engine " + std::to_string(k) +
                     " is " + std::to_string(rows) + "x" + std::to_string(cols) + ", expected " +
                     std::to_string(want_rows) + "x" + std::to_string(want_cols));
  }
}

/// Each engine's placement covers the layer's `inputs` features.
void check_placements(std::span<const Placement* const> placements, std::int64_t inputs) {
  for (std::size_t k = 0; k < placements.size(); ++k) {
    check_slice("placement", k, placements[k]->features(), 1, inputs, 1);
  }
}

// Copies a strided view into a contiguous buffer, row after row, and back.
void pack(ConstMatrixView m, float* out) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    std::memcpy(out + r * m.cols, m.row(r), static_cast<std::size_t>(m.cols) * sizeof(float));
  }
}
void unpack(const float* in, MutableMatrixView m) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    std::memcpy(m.row(r), in + r * m.cols, static_cast<std::size_t>(m.cols) * sizeof(float));
  }
}

// Runs one operation; from its command on a failure ends every rank (see the header).
template <typename Fn>
auto inside_operation(Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    abort_all_ranks(e);
  }
}

}  // namespace

DriverRank::DriverRank(Link& link, FrameOptions frames, GradientTree& tree,
                       std::vector<std::unique_ptr<CpuEngine>> twins, FabricCounters& counters)
    : link_(&link),
      frames_(link, frames),
      tree_(&tree),
      twins_(std::move(twins)),
      counters_(&counters) {}

// --- the protocol's pieces -------------------------------------------------------------

void DriverRank::send_command(Command& c) {
  // A forward layer's command goes out while the layer before's replies are still coming
  // (start_replies); any other waits for them, so that it finds the counters complete.
  if (static_cast<Op>(c.op) != Op::forward_layer) finish_replies();
  link_->bcast(&c, sizeof c, MPI_BYTE, "command broadcast");
}

void DriverRank::send_stream_command(Op op, const StreamHeader& h, bool want_dx, const Frame& first,
                                     Command c) {
  c.op = static_cast<std::int32_t>(op);
  c.want_dx = want_dx ? 1 : 0;
  c.kind = static_cast<std::uint32_t>(h.kind);
  c.outputs = h.outputs;
  c.inputs = h.inputs;
  c.nnz = h.nnz;
  c.precision = static_cast<std::uint32_t>(h.precision);
  c.order = static_cast<std::uint32_t>(h.order);
  c.first = first.meta(h.precision);
  send_command(c);
  bytes_sent_ += sizeof c;
}

// Each engine's job (jobs[k + 1]; their lanes are set here) and placement: lane_of (one
// int per input feature), then lane_nnz (one per lane).
void DriverRank::scatter_jobs(std::span<const Placement* const> placements, std::vector<Job> jobs) {
  const std::size_t n = engines();
  for (std::size_t k = 0; k < n; ++k) jobs[k + 1].lanes = placements[k]->lanes;
  Job mine;
  link_->scatter(jobs.data(), &mine, sizeof(Job), MPI_BYTE, "job scatter");
  bytes_sent_ += n * sizeof(Job);
  // One array of every engine's placement, the engines' parts one after another, by one
  // Scatterv.
  auto scatter_part = [&](auto part, MPI_Datatype type) {
    std::vector<int> counts(n + 1, 0), displs(n + 1, 0);
    std::remove_cvref_t<decltype(placements[0]->*part)> all;
    for (std::size_t k = 0; k < n; ++k) {
      const auto& engine_part = placements[k]->*part;
      counts[k + 1] = to_count(engine_part.size(), "a placement");
      displs[k + 1] = to_count(all.size(), "the placements");
      all.insert(all.end(), engine_part.begin(), engine_part.end());
    }
    link_->scatterv(all.data(), counts.data(), displs.data(), nullptr, 0, type,
                    "placement scatter");
    bytes_sent_ += all.size() * sizeof(all[0]);
  };
  scatter_part(&Placement::lane_of, MPI_INT32_T);
  scatter_part(&Placement::lane_nnz, MPI_INT64_T);
}

// Each engine's token slice, packed, by one Scatterv.
void DriverRank::scatter_matrices(std::span<const ConstMatrixView> ms) {
  std::vector<int> counts(engines() + 1, 0), displs(counts.size(), 0);
  std::uint64_t total = 0;
  for (std::size_t k = 0; k < engines(); ++k) {
    const auto n = static_cast<std::uint64_t>(ms[k].rows * ms[k].cols);
    counts[k + 1] = to_count(n, "a token slice");
    displs[k + 1] = to_count(total, "a batch");
    total += n;
  }
  to_count(total, "a batch");
  std::vector<float> buffer(total);
  for (std::size_t k = 0; k < engines(); ++k) pack(ms[k], buffer.data() + displs[k + 1]);
  link_->scatterv(buffer.data(), counts.data(), displs.data(), nullptr, 0, MPI_FLOAT,
                  "batch scatter");
}

// The engines' results (Y or dX), gathered into the caller's views; a null view: none.
void DriverRank::gather_matrices(const std::vector<MutableMatrixView*>& ms) {
  std::vector<int> counts(engines() + 1, 0), displs(counts.size(), 0);
  std::uint64_t total = 0;
  for (std::size_t k = 0; k < engines(); ++k) {
    const auto n = ms[k] == nullptr ? 0 : static_cast<std::uint64_t>(ms[k]->rows * ms[k]->cols);
    counts[k + 1] = to_count(n, "a token slice");
    displs[k + 1] = to_count(total, "a batch");
    total += n;
  }
  to_count(total, "a batch");
  std::vector<float> buffer(total);
  link_->gatherv(nullptr, 0, buffer.data(), counts.data(), displs.data(), MPI_FLOAT,
                 "result gather");
  for (std::size_t k = 0; k < engines(); ++k) {
    if (ms[k] != nullptr) unpack(buffer.data() + displs[k + 1], *ms[k]);
  }
}

std::vector<Reply> DriverRank::gather_replies() {
  std::vector<Reply> replies(engines() + 1);
  Reply mine;
  link_->gather(&mine, sizeof(Reply), MPI_BYTE, replies.data(), "reply gather");
  bytes_received_ += engines() * sizeof(Reply);
  add_replies(replies);
  return replies;
}

void DriverRank::start_replies() {
  finish_replies();
  started_replies_.assign(engines() + 1, Reply{});
  started_ = link_->start_gather(&started_mine_, sizeof(Reply), MPI_BYTE, started_replies_.data(),
                                 "reply gather");
  bytes_received_ += engines() * sizeof(Reply);
}

void DriverRank::finish_replies() {
  if (started_ == MPI_REQUEST_NULL) return;
  link_->wait(started_, "reply gather");
  started_ = MPI_REQUEST_NULL;
  add_replies(started_replies_);
}

// Each engine's counters (replies[k + 1]) into its twin's.
void DriverRank::add_replies(const std::vector<Reply>& replies) {
  for (std::size_t k = 0; k < engines(); ++k) {
    const Reply& r = replies[k + 1];
    EngineCounters& c = twins_[k]->counters();
    c.busy_seconds += r.busy_seconds;
    c.intake_seconds += r.intake_seconds;
    c.stream_arrival_seconds += r.arrival_seconds;
    c.overlapped_seconds += r.overlapped_seconds;
    c.packets += r.packets;
    c.bytes += r.bytes;
  }
}

// The pass's spec after the command (the engine rank's receive_spec).
void DriverRank::send_spec(const PassSpec& spec) {
  std::vector<std::int64_t> sizes = spec.sizes;
  std::vector<std::int32_t> activations;
  for (const Activation a : spec.activations) activations.push_back(static_cast<std::int32_t>(a));
  link_->bcast(sizes.data(), static_cast<int>(sizes.size()), MPI_INT64_T, "spec broadcast");
  link_->bcast(activations.data(), static_cast<int>(activations.size()), MPI_INT32_T,
               "spec broadcast");
  bytes_sent_ += sizes.size() * sizeof(std::int64_t) + activations.size() * sizeof(std::int32_t);
}

// Each engine's share of a batch of `tokens`, as counts and displacements (in tokens) of a
// Scatterv.
void DriverRank::set_shards(std::int64_t tokens, const PassSpec& spec, std::vector<int>& counts,
                            std::vector<int>& displs) {
  counts.assign(engines() + 1, 0);
  displs.assign(engines() + 1, 0);
  shard_tokens_.assign(engines(), 0);
  for (std::size_t k = 0; k < engines(); ++k) {
    const Fabric::TokenRange r =
        Fabric::shard_of(static_cast<std::int32_t>(k), link_->engines(), tokens);
    counts[k + 1] = to_count(static_cast<std::uint64_t>(r.count), "a token slice");
    displs[k + 1] = to_count(static_cast<std::uint64_t>(r.first), "a batch");
    shard_tokens_[k] = r.count;
  }
  outputs_ = spec.sizes.back();
  sizes_ = spec.sizes;
}

std::vector<float> DriverRank::gather_bias_gradients(std::size_t outputs) {
  std::vector<int> counts(engines() + 1, 0), displs(counts.size(), 0);
  for (std::size_t k = 0; k < engines(); ++k) {
    counts[k + 1] = to_count(outputs, "a bias");
    displs[k + 1] = to_count(k * outputs, "the biases");
  }
  std::vector<float> all(engines() * outputs);
  link_->gatherv(nullptr, 0, all.data(), counts.data(), displs.data(), MPI_FLOAT,
                 "bias gradient gather");
  std::vector<std::vector<float>> biases(engines());
  for (std::size_t k = 0; k < engines(); ++k) {
    biases[k].assign(all.begin() + static_cast<std::ptrdiff_t>(k * outputs),
                     all.begin() + static_cast<std::ptrdiff_t>((k + 1) * outputs));
  }
  return detail::sum_bias_tree(std::move(biases));
}

void DriverRank::count_protocol() {
  counters_->driver_bytes_sent += bytes_sent_;
  counters_->driver_bytes_received += bytes_received_;
}

void DriverRank::stop() {
  Command c;
  c.op = static_cast<std::int32_t>(Op::stop);
  send_command(c);
  tree_->free_window();  // collective: the engine ranks free it as they leave serve()
}

// --- operations on caller-held views ---------------------------------------------------

void DriverRank::forward(StreamSource& weights, std::span<const Placement* const> placements,
                         std::span<const ConstMatrixView> xs,
                         std::span<const MutableMatrixView> ys) {
  const StreamHeader& h = weights.header();
  for (std::size_t k = 0; k < xs.size(); ++k) {
    check_slice("X", k, xs[k].rows, xs[k].cols, h.inputs, xs[k].cols);
    check_slice("Y", k, ys[k].rows, ys[k].cols, h.outputs, xs[k].cols);
    check_slice("placement", k, placements[k]->features(), 1, h.inputs, 1);
  }
  inside_operation([&] {
    Frame first = frames_.pull(weights);
    send_stream_command(Op::forward, h, false, first);
    std::vector<Job> jobs(engines() + 1);
    for (std::size_t k = 0; k < engines(); ++k) jobs[k + 1].tokens = xs[k].cols;
    scatter_jobs(placements, std::move(jobs));
    scatter_matrices(xs);
    frames_.send(weights, std::move(first), nullptr);
    std::vector<MutableMatrixView> outs(ys.begin(), ys.end());
    std::vector<MutableMatrixView*> targets;
    for (auto& y : outs) targets.push_back(&y);
    gather_matrices(targets);
    gather_replies();
  });
}

ReducedGradient DriverRank::backward(StreamSource& weights,
                                     std::span<const Placement* const> placements,
                                     std::span<const ConstMatrixView> xs,
                                     std::span<const ConstMatrixView> dys,
                                     std::span<MutableMatrixView* const> dxs, bool with_bias) {
  const StreamHeader& h = weights.header();
  bool want_dx = false;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    check_slice("X", k, xs[k].rows, xs[k].cols, h.layer_inputs(), xs[k].cols);
    check_slice("dY", k, dys[k].rows, dys[k].cols, h.layer_outputs(), xs[k].cols);
    check_slice("placement", k, placements[k]->features(), 1, h.layer_inputs(), 1);
    if (!dxs.empty() && dxs[k] != nullptr) {
      check_slice("dX", k, dxs[k]->rows, dxs[k]->cols, h.layer_inputs(), xs[k].cols);
      want_dx = true;
    }
  }
  ReducedGradient sum;
  inside_operation([&] {
    Frame first = frames_.pull(weights);
    send_stream_command(Op::backward, h, want_dx, first);
    std::vector<Job> jobs(engines() + 1);
    for (std::size_t k = 0; k < engines(); ++k) {
      jobs[k + 1].tokens = xs[k].cols;
      jobs[k + 1].want_dx = !dxs.empty() && dxs[k] != nullptr ? 1 : 0;
    }
    scatter_jobs(placements, std::move(jobs));
    scatter_matrices(xs);
    scatter_matrices(dys);
    SentStream sent;
    frames_.send(weights, std::move(first), &sent);
    if (want_dx) {
      std::vector<MutableMatrixView*> targets(engines(), nullptr);
      for (std::size_t k = 0; k < engines(); ++k) targets[k] = dxs[k];
      gather_matrices(targets);
    }
    sum.weights = tree_->collect(sent, gather_replies());
  });
  // Row sums of dY exactly as LocalFabric computes them (rank 0 holds dY already), summed
  // in the same tree.
  if (with_bias) {
    std::vector<std::vector<float>> biases(engines());
    for (std::size_t k = 0; k < engines(); ++k) biases[k] = bias_gradient(dys[k]);
    sum.bias = detail::sum_bias_tree(std::move(biases));
  }
  return sum;
}

ReducedGradient DriverRank::probe(StreamSource& stream, bool echo) {
  ReducedGradient sum;
  inside_operation([&] {
    Frame first = frames_.pull(stream);
    send_stream_command(echo ? Op::probe_echo : Op::probe, stream.header(), false, first);
    SentStream sent;
    frames_.send(stream, std::move(first), echo ? &sent : nullptr);
    if (echo) {
      sum.weights = tree_->collect(sent, gather_replies());
    } else {
      gather_replies();
    }
  });
  return sum;
}

// --- layer operations over the engine ranks' activation stores -------------------------

// The command that starts a pass over a batch (load_batch, load_samples): the spec's
// layers and loss, the batch's tokens and `flags` (kFlagTraining added for a training
// pass); then the spec.
void DriverRank::send_pass(Op op, const PassSpec& spec, std::int64_t tokens, std::int32_t flags) {
  Command c;
  c.op = static_cast<std::int32_t>(op);
  c.layer = static_cast<std::int32_t>(spec.activations.size());
  c.kind = static_cast<std::uint32_t>(spec.loss);
  c.total_tokens = tokens;
  c.flags = flags | (spec.training ? kFlagTraining : 0);
  send_command(c);
  send_spec(spec);
}

void DriverRank::load_batch(const PassSpec& spec, const ShardData& batch) {
  std::vector<int> counts, displs;
  set_shards(batch.features.cols, spec, counts, displs);
  std::vector<ConstMatrixView> features(engines()), targets(engines());
  for (std::size_t k = 0; k < engines(); ++k) {
    const ConstMatrixView& f = batch.features;
    const std::int64_t first = displs[k + 1], count = counts[k + 1];
    features[k] = {f.data + first, f.rows, count, f.stride};
    if (batch.targets) {
      const ConstMatrixView& t = *batch.targets;
      targets[k] = {t.data + first, t.rows, count, t.stride};
    }
  }
  inside_operation([&] {
    bytes_sent_ = 0;
    send_pass(Op::load_batch, spec, batch.features.cols,
              (batch.labels.empty() ? 0 : kFlagLabels) | (batch.targets ? kFlagTargets : 0));
    scatter_matrices(features);
    if (!batch.labels.empty()) {
      link_->scatterv(batch.labels.data(), counts.data(), displs.data(), nullptr, 0, MPI_INT,
                      "label scatter");
    }
    if (batch.targets) scatter_matrices(targets);
    counters_->driver_bytes_sent += sizeof(Command) + bytes_sent_;
  });
}

void DriverRank::load_samples(const PassSpec& spec, std::span<const std::int64_t> indices) {
  std::vector<int> counts, displs;
  set_shards(static_cast<std::int64_t>(indices.size()), spec, counts, displs);
  inside_operation([&] {
    bytes_sent_ = 0;
    send_pass(Op::load_samples, spec, static_cast<std::int64_t>(indices.size()), kFlagLabels);
    link_->scatterv(indices.data(), counts.data(), displs.data(), nullptr, 0, MPI_INT64_T,
                    "sample scatter");
    counters_->driver_bytes_sent += sizeof(Command) + bytes_sent_;
  });
}

void DriverRank::forward_layer(StreamSource& weights, std::span<const Placement* const> placements,
                               std::int32_t layer, std::span<const float> bias) {
  const StreamHeader& h = weights.header();
  if (shard_tokens_.empty()) throw ArgumentError("MpiFabric forward_layer: no batch loaded");
  if (!bias.empty() && bias.size() != h.outputs) {
    throw ShapeError("MpiFabric forward_layer: " + std::to_string(bias.size()) + " biases for " +
                     std::to_string(h.outputs) + " outputs");
  }
  check_placements(placements, h.inputs);
  inside_operation([&] {
    start_layer_counts();
    Command c;
    c.layer = layer;
    c.flags = bias.empty() ? 0 : kFlagBias;
    Frame first = frames_.pull(weights);
    send_stream_command(Op::forward_layer, h, false, first, c);
    scatter_jobs(placements, std::vector<Job>(engines() + 1));
    if (!bias.empty()) {
      std::vector<float> b(bias.begin(), bias.end());
      link_->bcast(b.data(), to_count(b.size(), "a bias"), MPI_FLOAT, "bias broadcast");
    }
    frames_.send(weights, std::move(first), nullptr);
    start_replies();
    count_protocol();
  });
}

std::vector<LossSums> DriverRank::loss(bool want_delta, std::int64_t total_tokens) {
  if (shard_tokens_.empty()) throw ArgumentError("MpiFabric loss: no batch loaded");
  std::vector<LossSums> parts(engines());
  inside_operation([&] {
    Command c;
    c.op = static_cast<std::int32_t>(Op::loss);
    c.flags = want_delta ? kFlagDelta : 0;
    c.total_tokens = total_tokens;
    send_command(c);
    std::vector<WireLoss> all(engines() + 1);
    WireLoss none;
    link_->gather(&none, sizeof none, MPI_BYTE, all.data(), "loss gather");
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const WireLoss& w = all[k + 1];
      parts[k] = {w.loss, w.correct, w.tokens, w.non_finite != 0};
    }
    counters_->driver_bytes_sent += sizeof c;
  });
  return parts;
}

ReducedGradient DriverRank::backward_layer(StreamSource& weights,
                                           std::span<const Placement* const> placements,
                                           std::int32_t layer, bool want_dx, bool with_bias) {
  const StreamHeader& h = weights.header();
  if (shard_tokens_.empty()) throw ArgumentError("MpiFabric backward_layer: no batch loaded");
  check_placements(placements, h.layer_inputs());
  ReducedGradient sum;
  inside_operation([&] {
    start_layer_counts();
    Command c;
    c.layer = layer;
    c.flags = with_bias ? kFlagBias : 0;
    Frame first = frames_.pull(weights);
    send_stream_command(Op::backward_layer, h, want_dx, first, c);
    scatter_jobs(placements, std::vector<Job>(engines() + 1));
    SentStream sent;
    frames_.send(weights, std::move(first), &sent);
    sum.weights = tree_->collect(sent, gather_replies());
    if (with_bias) sum.bias = gather_bias_gradients(h.layer_outputs());
    count_protocol();
  });
  return sum;
}

DenseMatrix DriverRank::gather_output() {
  if (shard_tokens_.empty()) throw ArgumentError("MpiFabric gather_output: no batch loaded");
  std::int64_t tokens = 0;
  for (const std::int64_t t : shard_tokens_) tokens += t;
  DenseMatrix y(outputs_, tokens);
  inside_operation([&] {
    Command c;
    c.op = static_cast<std::int32_t>(Op::gather_output);
    send_command(c);
    std::vector<MutableMatrixView> parts;
    std::int64_t first = 0;
    for (const std::int64_t t : shard_tokens_) {
      parts.push_back({y.data() + first, outputs_, t, y.stride()});
      first += t;
    }
    std::vector<MutableMatrixView*> targets;
    for (auto& p : parts) targets.push_back(&p);
    gather_matrices(targets);
    counters_->driver_bytes_sent += sizeof c;
  });
  return y;
}

std::vector<std::int64_t> DriverRank::growth_top_k(const GrowthSource& source,
                                                   const CsrMatrix& mask, std::int64_t k) {
  const std::int32_t layer = source.layer;
  if (!source.block && (shard_tokens_.empty() || layer < 0 ||
                        layer + 1 >= static_cast<std::int32_t>(sizes_.size()) ||
                        mask.cols() != sizes_[static_cast<std::size_t>(layer)] ||
                        mask.rows() != sizes_[static_cast<std::size_t>(layer) + 1])) {
    throw ArgumentError("MpiFabric growth_top_k: no layer " + std::to_string(layer) + " of " +
                        std::to_string(mask.rows()) + "x" + std::to_string(mask.cols()) +
                        " in the engines' stores");
  }
  std::vector<std::int64_t> positions;
  inside_operation([&] {
    Command c;
    c.op = static_cast<std::int32_t>(Op::growth_top_k);
    c.layer = layer;
    if (source.block) {  // a block model's projection backward: its operation and block
      c.block_op = static_cast<std::int32_t>(source.block->op);
      c.layer = source.block->block;
    }
    c.outputs = static_cast<std::uint32_t>(mask.rows());
    c.inputs = static_cast<std::uint32_t>(mask.cols());
    c.nnz = static_cast<std::uint64_t>(mask.nnz());
    c.total_tokens = k;  // the candidates wanted
    send_command(c);
    // Only the last engine, which keeps the top-k, needs the mask.
    const int last = link_->size() - 1;
    MPI_Request r[2];
    mpi_check(MPI_Isend(mask.row_offsets().data(),
                        to_count(mask.row_offsets().size(), "a mask's offsets"), MPI_INT64_T, last,
                        kGrowthTag, link_->comm(), &r[0]),
              "growth mask send");
    mpi_check(MPI_Isend(mask.col_indices().data(),
                        to_count(mask.col_indices().size(), "a mask's indices"), MPI_UINT32_T, last,
                        kGrowthTag, link_->comm(), &r[1]),
              "growth mask send");
    link_->wait_all(2, r, "growth mask send");
    std::int64_t count = 0;
    MPI_Request q;
    mpi_check(MPI_Irecv(&count, 1, MPI_INT64_T, last, kGrowthTag, link_->comm(), &q),
              "growth candidates receive");
    link_->wait(q, "growth candidates receive");
    if (count < 0 || count > k) {
      throw FormatError("MpiFabric: engine rank " + std::to_string(last) + " returned " +
                        std::to_string(count) + " growth candidates for " + std::to_string(k));
    }
    positions.resize(static_cast<std::size_t>(count));
    mpi_check(MPI_Irecv(positions.data(), to_count(positions.size(), "growth candidates"),
                        MPI_INT64_T, last, kGrowthTag, link_->comm(), &q),
              "growth candidates receive");
    link_->wait(q, "growth candidates receive");
    counters_->driver_bytes_sent += sizeof c + mask.row_offsets().size() * sizeof(std::int64_t) +
                                    mask.col_indices().size() * sizeof(std::uint32_t);
    counters_->driver_bytes_received += sizeof count + positions.size() * sizeof(std::int64_t);
  });
  return positions;
}

void DriverRank::layer_activations(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                                   std::vector<ConstMatrixView>& dzs) {
  if (shard_tokens_.empty() || layer < 0 || layer + 1 >= static_cast<std::int32_t>(sizes_.size())) {
    throw ArgumentError("MpiFabric layer activations: no layer " + std::to_string(layer) +
                        " in the engines' stores");
  }
  const std::size_t n = engines();
  lent_.clear();
  for (std::size_t k = 0; k < n; ++k) {
    lent_.emplace_back(sizes_[static_cast<std::size_t>(layer)], shard_tokens_[k]);
  }
  for (std::size_t k = 0; k < n; ++k) {
    lent_.emplace_back(sizes_[static_cast<std::size_t>(layer) + 1], shard_tokens_[k]);
  }
  inside_operation([&] {
    Command c;
    c.op = static_cast<std::int32_t>(Op::layer_activations);
    c.layer = layer;
    send_command(c);
    for (std::size_t half = 0; half < 2; ++half) {
      std::vector<MutableMatrixView> views;
      for (std::size_t k = 0; k < n; ++k) views.push_back(lent_[half * n + k].view());
      std::vector<MutableMatrixView*> targets;
      for (auto& v : views) targets.push_back(&v);
      gather_matrices(targets);
    }
    counters_->driver_bytes_sent += sizeof c;
  });
  for (std::size_t k = 0; k < n; ++k) {
    xs.push_back(lent_[k].view());
    dzs.push_back(lent_[n + k].view());
    counters_->driver_bytes_received +=
        static_cast<std::uint64_t>(lent_[k].rows() * lent_[k].cols() +
                                   lent_[n + k].rows() * lent_[n + k].cols()) *
        sizeof(float);
  }
}

// --- block operations over the engine ranks' block stores (a GPT's step) ---------------

void DriverRank::load_tokens(const BlockShape& shape, std::span<const std::int32_t> inputs,
                             std::span<const std::int32_t> targets) {
  const std::size_t n = engines();
  const auto sequences = static_cast<std::int64_t>(inputs.size()) / shape.context;
  std::vector<int> counts(n + 1, 0), displs(n + 1, 0);
  std::vector<std::int64_t> tokens(n);
  for (std::size_t k = 0; k < n; ++k) {
    const Fabric::TokenRange r =
        Fabric::shard_of(static_cast<std::int32_t>(k), link_->engines(), sequences);
    tokens[k] = r.count * shape.context;
    counts[k + 1] = to_count(static_cast<std::uint64_t>(tokens[k]), "a token slice");
    displs[k + 1] = to_count(static_cast<std::uint64_t>(r.first * shape.context), "a batch");
  }
  inside_operation([&] {
    Command c;
    c.op = static_cast<std::int32_t>(Op::load_tokens);
    c.total_tokens = static_cast<std::int64_t>(inputs.size());
    c.flags = (targets.empty() ? 0 : kFlagTargets) | (shape.training ? kFlagTraining : 0);
    send_command(c);
    WireShape w{shape.vocab, shape.context, shape.d_model, shape.heads, shape.blocks};
    link_->bcast(&w, sizeof w, MPI_BYTE, "shape broadcast");
    link_->scatterv(inputs.data(), counts.data(), displs.data(), nullptr, 0, MPI_INT32_T,
                    "token scatter");
    if (!targets.empty()) {
      link_->scatterv(targets.data(), counts.data(), displs.data(), nullptr, 0, MPI_INT32_T,
                      "token scatter");
    }
    counters_->driver_bytes_sent += sizeof c + sizeof w;
  });
  block_tokens_ = std::move(tokens);
  block_shape_ = shape;
}

// The command, then as forward_layer and backward_layer: placements (a projection), the
// bias, the stream; the replies, the gradient up the tree, the bias gradients; the loss.
BlockResult DriverRank::run_block(const BlockCall& call, StreamSource* weights,
                                  std::span<const Placement* const> placements,
                                  std::span<const float> bias) {
  if (block_tokens_.empty()) throw ArgumentError("MpiFabric run_block: no tokens loaded");
  const bool gradient = returns_gradient(call.op);
  if (weights != nullptr) {
    const StreamHeader& h = weights->header();
    if (!bias.empty() && bias.size() != h.layer_outputs()) {
      throw ShapeError("MpiFabric run_block: " + std::to_string(bias.size()) + " biases for " +
                       std::to_string(h.layer_outputs()) + " outputs");
    }
    check_placements(placements, h.layer_inputs());
  }
  BlockResult r;
  inside_operation([&] {
    start_layer_counts();
    Command c;
    c.op = static_cast<std::int32_t>(Op::block_op);
    c.block_op = static_cast<std::int32_t>(call.op);
    c.layer = call.block;
    c.flags = (bias.empty() ? 0 : kFlagBias) | (call.want_delta ? kFlagDelta : 0);
    c.total_tokens = call.total_tokens;
    SentStream sent;
    if (weights != nullptr) {
      Frame first = frames_.pull(*weights);
      send_stream_command(Op::block_op, weights->header(), false, first, c);
      if (!placements.empty()) scatter_jobs(placements, std::vector<Job>(engines() + 1));
      if (!bias.empty()) {
        std::vector<float> b(bias.begin(), bias.end());
        link_->bcast(b.data(), to_count(b.size(), "a bias"), MPI_FLOAT, "bias broadcast");
      }
      frames_.send(*weights, std::move(first), gradient ? &sent : nullptr);
    } else {
      send_command(c);
      bytes_sent_ += sizeof c;
    }
    if (gradient) {
      r.gradient.weights = tree_->collect(sent, gather_replies());
      if (has_bias_gradient(call.op)) {
        r.gradient.bias = gather_bias_gradients(weights->header().layer_outputs());
      }
    } else {
      gather_replies();
    }
    if (call.op == BlockOp::loss) {
      std::vector<WireLoss> all(engines() + 1);
      WireLoss none;
      link_->gather(&none, sizeof none, MPI_BYTE, all.data(), "loss gather");
      for (std::size_t k = 0; k < engines(); ++k) {  // in engine order, as LocalFabric
        const WireLoss& w = all[k + 1];
        r.loss += LossSums{w.loss, w.correct, w.tokens, w.non_finite != 0};
      }
    }
    count_protocol();
  });
  return r;
}

std::vector<float> DriverRank::block_logits(std::int64_t token) {
  if (block_tokens_.empty() || token < 0 || token >= block_tokens_.front()) {
    throw ArgumentError("MpiFabric block_logits: no token " + std::to_string(token) +
                        " in engine 0's block store");
  }
  const auto vocab = static_cast<std::size_t>(block_shape_.vocab);
  std::vector<float> logits(vocab);
  inside_operation([&] {
    Command c;
    c.op = static_cast<std::int32_t>(Op::block_logits);
    c.total_tokens = token;
    send_command(c);
    std::vector<int> counts(engines() + 1, 0), displs(engines() + 1, 0);
    counts[1] = to_count(vocab, "the logits");
    link_->gatherv(nullptr, 0, logits.data(), counts.data(), displs.data(), MPI_FLOAT,
                   "logits gather");
    counters_->driver_bytes_sent += sizeof c;
  });
  return logits;
}

}  // namespace sluice::mpi
