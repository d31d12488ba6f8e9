#include "fabric/mpi/engine_rank.hpp"

#include <algorithm>
#include <exception>
#include <future>
#include <string>

#include "engine/gradient_top_k.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"

namespace sluice::mpi {
namespace {

DenseMatrix copy_of(ConstMatrixView m) {
  DenseMatrix c(m.rows, m.cols);
  for (std::int64_t r = 0; r < m.rows; ++r) std::copy(m.row(r), m.row(r) + m.cols, c.row(r));
  return c;
}

}  // namespace

EngineRank::EngineRank(Link& link, FrameOptions frames, std::int64_t driver_pid, GradientTree& tree,
                       std::unique_ptr<CpuEngine> engine)
    : link_(&link),
      frames_(link, frames, driver_pid),
      channel_chunks_(frames.window * kMaxFrameChunks),
      tree_(&tree),
      engine_(std::move(engine)) {}

void EngineRank::serve(const Dataset* dataset) {
  dataset_ = dataset;
  while (true) {
    Command c;
    link_->bcast(&c, sizeof c, MPI_BYTE, "command broadcast");
    if (c.op == static_cast<std::int32_t>(Op::stop)) {
      tree_->free_window();
      return;
    }
    if (c.op < static_cast<std::int32_t>(Op::forward) || c.op > kLastOp) {
      throw FormatError("MpiFabric: unknown command " + std::to_string(c.op) + " from rank 0");
    }
    if (c.op >= static_cast<std::int32_t>(Op::load_batch)) {
      serve_layer_op(c);
    } else {
      serve_one(c);
    }
  }
}

Job EngineRank::receive_job(std::uint32_t inputs, Placement& placement) {
  Job job;
  link_->scatter(nullptr, &job, sizeof(Job), MPI_BYTE, "job scatter");
  placement.lanes = job.lanes;
  placement.lane_of.resize(inputs);
  placement.lane_nnz.resize(static_cast<std::size_t>(job.lanes));
  link_->scatterv(nullptr, nullptr, nullptr, placement.lane_of.data(),
                  to_count(inputs, "a placement"), MPI_INT32_T, "placement scatter");
  link_->scatterv(nullptr, nullptr, nullptr, placement.lane_nnz.data(), job.lanes, MPI_INT64_T,
                  "placement scatter");
  return job;
}

DenseMatrix EngineRank::receive_matrix(std::int64_t rows, std::int64_t cols) {
  DenseMatrix m(rows, cols);
  std::vector<float> buffer(static_cast<std::size_t>(rows * cols));
  link_->scatterv(nullptr, nullptr, nullptr, buffer.data(),
                  to_count(buffer.size(), "a token slice"), MPI_FLOAT, "batch scatter");
  for (std::int64_t r = 0; r < rows; ++r) {
    std::copy(buffer.data() + r * cols, buffer.data() + (r + 1) * cols, m.row(r));
  }
  return m;
}

void EngineRank::send_matrix(const DenseMatrix* m) {
  std::vector<float> buffer;
  if (m != nullptr) {
    buffer.resize(static_cast<std::size_t>(m->rows() * m->cols()));
    for (std::int64_t r = 0; r < m->rows(); ++r) {
      std::copy(m->row(r), m->row(r) + m->cols(), buffer.data() + r * m->cols());
    }
  }
  link_->gatherv(buffer.data(), to_count(buffer.size(), "a token slice"), nullptr, nullptr, nullptr,
                 MPI_FLOAT, "result gather");
}

// Runs fn(stream) on the engine's thread while this thread receives the stream's frames.
// A failed engine drains its channel, so the receiving thread never blocks; a failed
// receipt fails the channel, so the engine stops.
template <typename Fn>
void EngineRank::run_on_stream(const Command& cmd, const StreamHeader& header, Fn&& fn) {
  StreamChannel channel(channel_chunks_);
  std::exception_ptr error;
  std::future<void> done = worker_.post([&] {
    ChannelStreamSource source(header, channel);
    try {
      fn(static_cast<StreamSource&>(source));
    } catch (...) {
      error = std::current_exception();
    }
    try {
      while (channel.pop()) {
      }
    } catch (...) {
    }
  });
  // Blocks on the engine's future between polls (woken the moment it is done) rather than
  // yielding: a thread that yields in a loop stays runnable, and where ranks share cores it
  // takes turns on the engine's core with the engine's own thread for the whole pass. The
  // polls only answer roll calls (which wait seconds), so they are far apart: each wakes
  // this thread on the engine's core.
  auto finished = [&] {
    return done.wait_for(std::chrono::milliseconds(20)) == std::future_status::ready;
  };
  try {
    frames_.receive(cmd.first, header.precision, channel);
  } catch (...) {
    channel.fail(std::current_exception());
    done.wait();
    throw;
  }
  link_->wait_until(finished, "the engine's work on a stream");
  done.get();
  if (error) std::rethrow_exception(error);
  frames_.reclaim();  // the engine has let go of the chunks
}

// The engine's counters since `before` and, if any, its gradient stream's shape; then
// the gradient itself up the tree, and its checksum.
void EngineRank::reply(const EngineCounters& before, const WeightStream* gradient) {
  Reply r;
  const EngineCounters& after = engine_->counters();
  r.busy_seconds = after.busy_seconds - before.busy_seconds;
  r.intake_seconds = after.intake_seconds - before.intake_seconds;
  r.arrival_seconds = after.stream_arrival_seconds - before.stream_arrival_seconds;
  r.overlapped_seconds = after.overlapped_seconds - before.overlapped_seconds;
  r.packets = after.packets - before.packets;
  r.bytes = after.bytes - before.bytes;
  if (gradient != nullptr) {
    r.grad_kind = static_cast<std::uint32_t>(gradient->header.kind);
    r.grad_outputs = gradient->header.outputs;
    r.grad_inputs = gradient->header.inputs;
    r.grad_order = static_cast<std::uint32_t>(gradient->header.order);
    r.grad_nnz = gradient->header.nnz;
    r.grad_packets = gradient->packet_count();
    r.grad_values = gradient->header.nnz;
  }
  link_->gather(&r, sizeof(Reply), MPI_BYTE, nullptr, "reply gather");
  if (gradient != nullptr) {
    const std::uint32_t checksum = tree_->send(*gradient);
    link_->gather(&checksum, 1, MPI_UINT32_T, nullptr, "checksum gather");
  }
}

// Operations on caller-held views (forward, backward) and the link probes.
void EngineRank::serve_one(const Command& cmd) {
  const bool backward = cmd.op == static_cast<std::int32_t>(Op::backward);
  const bool echo = cmd.op == static_cast<std::int32_t>(Op::probe_echo);
  const bool probe = echo || cmd.op == static_cast<std::int32_t>(Op::probe);
  const StreamHeader header = header_of(cmd);
  // The layer's shape, whichever way its stream walks it.
  const std::uint32_t inputs = header.layer_inputs(), outputs = header.layer_outputs();
  Placement placement;
  Job job;
  DenseMatrix x, y, dy, dx;
  if (!probe) {
    job = receive_job(inputs, placement);
    x = receive_matrix(inputs, job.tokens);
    if (backward) {
      dy = receive_matrix(outputs, job.tokens);
      if (job.want_dx) dx = DenseMatrix(inputs, job.tokens);
    } else {
      y = DenseMatrix(outputs, job.tokens);
    }
  }
  const EngineCounters before = engine_->counters();
  WeightStream gradient;
  run_on_stream(cmd, header, [&](StreamSource& source) {
    if (probe) {  // no engine: the stream is taken in, and for echo handed back
      while (ChunkPtr c = source.next()) {
        if (echo) gradient.chunks.push_back(std::move(c));
      }
      gradient.header = header;
      gradient.header.kind = StreamKind::gradient;
    } else if (backward) {
      MutableMatrixView dx_view = dx.view();
      gradient = engine_->backward(source, placement, x.view(), dy.view(),
                                   job.want_dx ? &dx_view : nullptr);
    } else {
      engine_->forward(source, placement, x.view(), y.view());
    }
  });
  if (!probe && !backward) {
    send_matrix(&y);
  } else if (backward && cmd.want_dx) {
    send_matrix(job.want_dx ? &dx : nullptr);
  }
  reply(before, backward || echo ? &gradient : nullptr);
}

// --- layer operations on the engine's own activation store -----------------------------

void EngineRank::serve_layer_op(const Command& cmd) {
  switch (static_cast<Op>(cmd.op)) {
    case Op::load_batch:
      return serve_load(cmd);
    case Op::load_samples:
      return serve_samples(cmd);
    case Op::forward_layer:
    case Op::backward_layer:
      return serve_layer(cmd);
    case Op::load_tokens:
      return serve_load_tokens(cmd);
    case Op::block_op:
      return serve_block(cmd);
    case Op::block_logits:
      return serve_block_logits(cmd);
    case Op::loss: {
      const LossSums s = engine_->loss((cmd.flags & kFlagDelta) != 0, cmd.total_tokens);
      WireLoss w{s.loss, s.correct, s.tokens, s.non_finite ? 1 : 0};
      link_->gather(&w, sizeof w, MPI_BYTE, nullptr, "loss gather");
      return;
    }
    case Op::layer_activations: {
      const ActivationStore& store = engine_->store();
      const DenseMatrix x = copy_of(store.in(cmd.layer));
      const DenseMatrix dz =
          copy_of(store.last_delta(store.spec().sizes.at(static_cast<std::size_t>(cmd.layer) + 1)));
      send_matrix(&x);
      send_matrix(&dz);
      return;
    }
    case Op::growth_top_k:
      return serve_growth(cmd);
    case Op::gather_output: {
      const ActivationStore& store = engine_->store();
      DenseMatrix out(0, 0);
      if (store.loaded()) out = copy_of(store.out(store.layers() - 1));
      send_matrix(&out);
      return;
    }
    default:
      throw FormatError("MpiFabric: unknown command " + std::to_string(cmd.op) + " from rank 0");
  }
}

PassSpec EngineRank::receive_spec(const Command& cmd) {
  if (cmd.layer < 1 || cmd.layer > (1 << 20)) {
    throw FormatError("MpiFabric: a pass of " + std::to_string(cmd.layer) + " layers");
  }
  PassSpec spec;
  spec.sizes.resize(static_cast<std::size_t>(cmd.layer) + 1);
  std::vector<std::int32_t> activations(static_cast<std::size_t>(cmd.layer));
  link_->bcast(spec.sizes.data(), cmd.layer + 1, MPI_INT64_T, "spec broadcast");
  link_->bcast(activations.data(), cmd.layer, MPI_INT32_T, "spec broadcast");
  for (const std::int32_t a : activations) spec.activations.push_back(static_cast<Activation>(a));
  spec.loss = static_cast<Loss>(cmd.kind);
  spec.training = (cmd.flags & kFlagTraining) != 0;
  return spec;
}

void EngineRank::serve_samples(const Command& cmd) {
  const PassSpec spec = receive_spec(cmd);
  const std::int64_t tokens =
      Fabric::shard_of(link_->rank() - 1, link_->engines(), cmd.total_tokens).count;
  std::vector<std::int64_t> indices(static_cast<std::size_t>(tokens));
  link_->scatterv(nullptr, nullptr, nullptr, indices.data(),
                  to_count(indices.size(), "a token slice"), MPI_INT64_T, "sample scatter");
  if (dataset_ == nullptr) {
    throw FormatError("MpiFabric: rank " + std::to_string(link_->rank()) +
                      " was asked for samples but has no data set attached (attach it on "
                      "every rank before serve(); did loading it fail here?)");
  }
  engine_->load_samples(spec, *dataset_, indices);
}

void EngineRank::serve_load(const Command& cmd) {
  const PassSpec spec = receive_spec(cmd);
  const std::int64_t tokens =
      Fabric::shard_of(link_->rank() - 1, link_->engines(), cmd.total_tokens).count;
  const DenseMatrix x = receive_matrix(spec.sizes.front(), tokens);
  std::vector<int> labels;
  if ((cmd.flags & kFlagLabels) != 0) {
    labels.resize(static_cast<std::size_t>(tokens));
    link_->scatterv(nullptr, nullptr, nullptr, labels.data(),
                    to_count(labels.size(), "a token slice"), MPI_INT, "label scatter");
  }
  DenseMatrix targets;
  if ((cmd.flags & kFlagTargets) != 0) targets = receive_matrix(spec.sizes.back(), tokens);
  ShardData shard;
  shard.features = x.view();
  shard.labels = labels;
  if ((cmd.flags & kFlagTargets) != 0) shard.targets = targets.view();
  engine_->load_shard(spec, shard);
}

void EngineRank::serve_layer(const Command& cmd) {
  const bool backward = cmd.op == static_cast<std::int32_t>(Op::backward_layer);
  const bool with_bias = (cmd.flags & kFlagBias) != 0;
  const StreamHeader header = header_of(cmd);
  Placement placement;
  receive_job(header.layer_inputs(), placement);
  std::vector<float> bias;
  if (!backward && with_bias) {
    bias.resize(header.layer_outputs());
    link_->bcast(bias.data(), to_count(bias.size(), "a bias"), MPI_FLOAT, "bias broadcast");
  }
  const EngineCounters before = engine_->counters();
  WeightStream gradient;
  std::vector<float> bias_gradient;
  run_on_stream(cmd, header, [&](StreamSource& source) {
    if (backward) {
      gradient = engine_->backward_layer(source, placement, cmd.layer, cmd.want_dx != 0,
                                         with_bias ? &bias_gradient : nullptr);
    } else {
      engine_->forward_layer(source, placement, cmd.layer, bias);
    }
  });
  reply(before, backward ? &gradient : nullptr);
  if (backward && with_bias) {
    link_->gatherv(bias_gradient.data(), to_count(bias_gradient.size(), "a bias"), nullptr, nullptr,
                   nullptr, MPI_FLOAT, "bias gradient gather");
  }
}

// --- block operations on the engine's own block store (a GPT's step) ------------------

template <typename Fn>
void EngineRank::run_on_engine(Fn&& fn) {
  std::future<void> done = worker_.post(std::forward<Fn>(fn));
  link_->wait_until(
      [&] { return done.wait_for(std::chrono::seconds(0)) == std::future_status::ready; },
      "the engine's work on a block");
  done.get();
}

void EngineRank::serve_load_tokens(const Command& cmd) {
  WireShape w;
  link_->bcast(&w, sizeof w, MPI_BYTE, "shape broadcast");
  if (w.context < 1 || cmd.total_tokens < 0 || cmd.total_tokens % w.context != 0) {
    throw FormatError("MpiFabric: " + std::to_string(cmd.total_tokens) +
                      " tokens in sequences of " + std::to_string(w.context) + " from rank 0");
  }
  const Fabric::TokenRange r =
      Fabric::shard_of(link_->rank() - 1, link_->engines(), cmd.total_tokens / w.context);
  const auto tokens = static_cast<std::size_t>(r.count * w.context);
  std::vector<std::int32_t> inputs(tokens), targets;
  link_->scatterv(nullptr, nullptr, nullptr, inputs.data(), to_count(tokens, "a token slice"),
                  MPI_INT32_T, "token scatter");
  if ((cmd.flags & kFlagTargets) != 0) {
    targets.resize(tokens);
    link_->scatterv(nullptr, nullptr, nullptr, targets.data(), to_count(tokens, "a token slice"),
                    MPI_INT32_T, "token scatter");
  }
  const BlockShape shape{w.vocab, w.context, w.d_model,
                         w.heads, w.blocks,  (cmd.flags & kFlagTraining) != 0};
  engine_->load_tokens(shape, inputs, targets);
}

void EngineRank::serve_block(const Command& cmd) {
  if (cmd.block_op < kFirstBlockOp || cmd.block_op > kLastBlockOp) {
    throw FormatError("MpiFabric: unknown block operation " + std::to_string(cmd.block_op) +
                      " from rank 0");
  }
  BlockCall call;
  call.op = static_cast<BlockOp>(cmd.block_op);
  call.block = cmd.layer;
  call.want_delta = (cmd.flags & kFlagDelta) != 0;
  call.total_tokens = cmd.total_tokens;
  const EngineCounters before = engine_->counters();
  BlockReply result;
  if (takes_stream(call.op)) {
    const StreamHeader header = header_of(cmd);
    Placement placement;
    if (is_projection(call.op)) receive_job(header.layer_inputs(), placement);
    std::vector<float> bias;
    if ((cmd.flags & kFlagBias) != 0) {
      bias.resize(header.layer_outputs());
      link_->bcast(bias.data(), to_count(bias.size(), "a bias"), MPI_FLOAT, "bias broadcast");
    }
    const Placement* where = is_projection(call.op) ? &placement : nullptr;
    run_on_stream(cmd, header, [&](StreamSource& source) {
      result = engine_->run_block(call, &source, where, bias);
    });
  } else {
    run_on_engine([&] { result = engine_->run_block(call, nullptr, nullptr, {}); });
  }
  const bool gradient = returns_gradient(call.op);
  reply(before, gradient ? &result.gradient : nullptr);
  if (gradient && has_bias_gradient(call.op)) {
    link_->gatherv(result.bias_gradient.data(), to_count(result.bias_gradient.size(), "a bias"),
                   nullptr, nullptr, nullptr, MPI_FLOAT, "bias gradient gather");
  }
  if (call.op == BlockOp::loss) {
    const LossSums& s = result.loss;
    WireLoss w{s.loss, s.correct, s.tokens, s.non_finite ? 1 : 0};
    link_->gather(&w, sizeof w, MPI_BYTE, nullptr, "loss gather");
  }
}

// Engine 0 sends its logits of one token; the others take part with nothing.
void EngineRank::serve_block_logits(const Command& cmd) {
  std::vector<float> column;
  if (link_->rank() == 1) {
    const BlockStore& s = engine_->block_store();
    if (!s.loaded() || cmd.total_tokens < 0 || cmd.total_tokens >= s.tokens()) {
      throw FormatError("MpiFabric: no token " + std::to_string(cmd.total_tokens) +
                        " in engine 0's block store");
    }
    for (std::int64_t o = 0; o < s.logits.rows(); ++o) {
      column.push_back(s.logits(o, cmd.total_tokens));
    }
  }
  link_->gatherv(column.data(), to_count(column.size(), "the logits"), nullptr, nullptr, nullptr,
                 MPI_FLOAT, "logits gather");
}

// RigL's growth (Fabric::growth_top_k): tile by tile, engine e takes the tile's sums from
// engine e - 1, adds its own tokens and passes them on; the last engine offers the finished
// tile to the top-k, whose positions go to rank 0. While engine e + 1 works on a tile,
// engine e computes the next one.
void EngineRank::serve_growth(const Command& cmd) {
  GrowthSource source;
  source.layer = cmd.layer;
  if (cmd.block_op != 0) {  // a block model's projection backward (checked by the engine)
    BlockCall call;
    call.op = static_cast<BlockOp>(cmd.block_op);
    call.block = cmd.layer;
    source.block = call;
  }
  const auto [x, dz] = engine_->growth_activations(source);
  if (x.rows != cmd.inputs || dz.rows != cmd.outputs) {
    throw FormatError("MpiFabric: growth scores of a " + std::to_string(cmd.outputs) + "x" +
                      std::to_string(cmd.inputs) + " layer from activations of " +
                      std::to_string(dz.rows) + " and " + std::to_string(x.rows) + " rows");
  }
  const int rank = link_->rank(), last = link_->size() - 1;
  MPI_Comm comm = link_->comm();
  CsrMatrix mask;
  if (rank == last) {
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(dz.rows) + 1);
    std::vector<std::uint32_t> indices(cmd.nnz);
    MPI_Request r[2];
    mpi_check(MPI_Irecv(offsets.data(), to_count(offsets.size(), "a mask's offsets"), MPI_INT64_T,
                        0, kGrowthTag, comm, &r[0]),
              "growth mask receive");
    mpi_check(MPI_Irecv(indices.data(), to_count(indices.size(), "a mask's indices"), MPI_UINT32_T,
                        0, kGrowthTag, comm, &r[1]),
              "growth mask receive");
    link_->wait_all(2, r, "growth mask receive");
    mask = CsrMatrix(dz.rows, x.rows, std::move(offsets), std::move(indices),
                     std::vector<float>(cmd.nnz, 1.0F));
  }
  const std::int64_t width = detail::gradient_tile_columns();
  const auto tile_floats = static_cast<std::size_t>(dz.rows * width);
  // Two tiles: one computed while the other is on its way to the next engine.
  std::vector<float> tiles[2] = {std::vector<float>(tile_floats), std::vector<float>(tile_floats)};
  MPI_Request sent[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  std::vector<float> xt;
  detail::StreamingTopK top(rank == last ? cmd.total_tokens : 0);
  for (std::int64_t c0 = 0, i = 0; c0 < x.rows; c0 += width, ++i) {
    const std::int64_t c1 = std::min(x.rows, c0 + width);
    std::vector<float>& tile = tiles[i % 2];
    const int count = to_count(static_cast<std::uint64_t>(dz.rows * (c1 - c0)), "a gradient tile");
    link_->wait(sent[i % 2], "growth tile send");
    if (rank > 1) {
      MPI_Request r;
      mpi_check(MPI_Irecv(tile.data(), count, MPI_FLOAT, rank - 1, kGrowthTag, comm, &r),
                "growth tile receive");
      link_->wait(r, "growth tile receive");
    }
    detail::gradient_tile(x, dz, c0, c1, rank > 1, xt, tile.data());
    if (rank < last) {
      mpi_check(MPI_Isend(tile.data(), count, MPI_FLOAT, rank + 1, kGrowthTag, comm, &sent[i % 2]),
                "growth tile send");
    } else {
      detail::offer_gradient_tile(mask, c0, c1, tile.data(), top);
    }
  }
  link_->wait_all(2, sent, "growth tile send");
  if (rank != last) return;
  const std::vector<std::int64_t> positions = top.positions();
  const auto count = static_cast<std::int64_t>(positions.size());
  MPI_Request r[2];
  mpi_check(MPI_Isend(&count, 1, MPI_INT64_T, 0, kGrowthTag, comm, &r[0]), "growth candidates");
  mpi_check(MPI_Isend(positions.data(), to_count(positions.size(), "growth candidates"),
                      MPI_INT64_T, 0, kGrowthTag, comm, &r[1]),
            "growth candidates");
  link_->wait_all(2, r, "growth candidates");
}

}  // namespace sluice::mpi
