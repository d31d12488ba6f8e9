// The Fabric's public calls (argument checks, the layer operations' byte counts), and
// what every fabric shares: the gradient reduction tree and the bias gradient.
#include "sluice/fabric.hpp"

#include <algorithm>
#include <exception>
#include <future>
#include <memory>
#include <string>

#include "engine/engine_worker.hpp"
#include "engine/gradient_top_k.hpp"
#include "fabric/gradient_tree.hpp"
#include "sluice/error.hpp"

namespace sluice {

namespace {

using detail::EngineWorker;

std::string engines_text(std::size_t n) {
  return std::to_string(n) + " engines";
}

template <typename T>
void check_count(std::span<T> items, std::int32_t engines, const char* what) {
  if (static_cast<std::int64_t>(items.size()) != engines) {
    throw ShapeError(std::string("fabric: ") + what + " has " + std::to_string(items.size()) +
                     " entries for " + engines_text(static_cast<std::size_t>(engines)));
  }
}

void check_placements(std::span<const Placement* const> placements, std::int32_t engines) {
  check_count(placements, engines, "placements");
  for (std::size_t k = 0; k < placements.size(); ++k) {
    if (placements[k] == nullptr) {
      throw ArgumentError("fabric: placement of engine " + std::to_string(k) + " is null");
    }
  }
}

// Adds b's values into a copy of a, packet by packet; chunk boundaries may differ.
WeightStream add_streams(const WeightStream& a, const WeightStream& b) {
  const StreamHeader& ha = a.header;
  const StreamHeader& hb = b.header;
  if (ha.kind != hb.kind || ha.outputs != hb.outputs || ha.inputs != hb.inputs ||
      ha.nnz != hb.nnz || ha.order != hb.order) {
    throw FormatError("gradient reduction: streams have different headers (" +
                      std::to_string(ha.outputs) + "x" + std::to_string(ha.inputs) + ", " +
                      std::to_string(ha.nnz) + " nnz, " + to_string(ha.order) + " vs " +
                      std::to_string(hb.outputs) + "x" + std::to_string(hb.inputs) + ", " +
                      std::to_string(hb.nnz) + " nnz, " + to_string(hb.order) + ")");
  }
  WeightStream sum;
  sum.header = ha;
  sum.chunks.reserve(a.chunks.size());
  std::size_t bc = 0, bp = 0;  // cursor in b: chunk, packet
  std::uint64_t position = 0;
  for (const ChunkPtr& chunk : a.chunks) {
    auto out = std::make_shared<StreamChunk>(*chunk);
    for (Packet& p : out->packets) {
      while (bc < b.chunks.size() && bp >= b.chunks[bc]->packets.size()) {
        ++bc;
        bp = 0;
      }
      if (bc >= b.chunks.size()) {
        throw FormatError("gradient reduction: a stream ends early at packet " +
                          std::to_string(position));
      }
      const Packet& q = b.chunks[bc]->packets[bp++];
      if (p.tag != q.tag) {
        throw FormatError("gradient reduction: tags differ at packet " + std::to_string(position) +
                          " (" + std::to_string(p.tag) + " vs " + std::to_string(q.tag) + ")");
      }
      if (!is_control(p)) p.value += q.value;
      ++position;
    }
    sum.chunks.push_back(std::move(out));
  }
  while (bc < b.chunks.size() && bp >= b.chunks[bc]->packets.size()) {
    ++bc;
    bp = 0;
  }
  if (bc < b.chunks.size()) {
    throw FormatError("gradient reduction: a stream has packets beyond " +
                      std::to_string(position));
  }
  return sum;
}

/// Counts the bytes of a stream the driver hands to the fabric.
class CountingSource final : public StreamSource {
 public:
  CountingSource(StreamSource& inner, std::uint64_t& bytes) : inner_(&inner), bytes_(&bytes) {}
  const StreamHeader& header() const override { return inner_->header(); }
  ChunkPtr next() override {
    ChunkPtr chunk = inner_->next();
    if (chunk) *bytes_ += chunk->byte_size();
    return chunk;
  }

 private:
  StreamSource* inner_;
  std::uint64_t* bytes_;
};

std::uint64_t bytes_of(ConstMatrixView m) {
  return static_cast<std::uint64_t>(m.rows * m.cols) * sizeof(float);
}

}  // namespace

std::vector<float> bias_gradient(ConstMatrixView dy) {
  // Eight partial sums a row, each over every eighth token, added in a fixed order at the
  // end: one sum's adds each waited for the one before, and the compiler may not reorder
  // them; these it can put in vector registers, with the same result on every ISA.
  constexpr std::int64_t kLanes = 8;
  std::vector<float> b(static_cast<std::size_t>(dy.rows));
  for (std::int64_t o = 0; o < dy.rows; ++o) {
    double s[kLanes] = {};
    const float* row = dy.row(o);
    std::int64_t t = 0;
    for (; t + kLanes <= dy.cols; t += kLanes) {
      for (std::int64_t l = 0; l < kLanes; ++l) s[l] += row[t + l];
    }
    for (std::int64_t l = 0; t < dy.cols; ++t, ++l) s[l] += row[t];
    const double sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    b[static_cast<std::size_t>(o)] = static_cast<float>(sum);
  }
  return b;
}

ReducedGradient reduce_gradients(std::vector<WeightStream> streams,
                                 std::vector<std::vector<float>> biases) {
  if (streams.empty()) throw ArgumentError("reduce_gradients: no streams");
  if (!biases.empty() && biases.size() != streams.size()) {
    throw ShapeError("reduce_gradients: " + std::to_string(biases.size()) + " bias vectors for " +
                     std::to_string(streams.size()) + " streams");
  }
  for (const auto& b : biases) {
    if (b.size() != biases.front().size()) {
      throw FormatError("reduce_gradients: bias gradients differ in size");
    }
  }
  detail::for_each_tree_pair(streams.size(), [&](std::size_t i, std::size_t j) {
    streams[i] = add_streams(streams[i], streams[j]);
  });
  ReducedGradient r;
  r.weights = std::move(streams.front());
  r.bias = detail::sum_bias_tree(std::move(biases));
  return r;
}

Engine& Fabric::engine(std::int32_t k) {
  if (k < 0 || k >= engine_count()) {
    throw ShapeError("fabric: engine " + std::to_string(k) + " of " +
                     engines_text(static_cast<std::size_t>(engine_count())));
  }
  return engine_impl(k);
}

void Fabric::forward(StreamSource& weights, std::span<const Placement* const> placements,
                     std::span<const ConstMatrixView> xs, std::span<const MutableMatrixView> ys) {
  const std::int32_t n = engine_count();
  if (weights.header().kind != StreamKind::weights) {
    throw ArgumentError(std::string("fabric forward needs a weights stream, got a ") +
                        to_string(weights.header().kind) + " stream");
  }
  if (weights.header().order != StreamOrder::by_output) {
    throw ArgumentError(std::string("fabric forward needs a stream by output, got one ") +
                        to_string(weights.header().order));
  }
  check_placements(placements, n);
  check_count(xs, n, "X views");
  check_count(ys, n, "Y views");
  forward_impl(weights, placements, xs, ys);
}

Fabric::Fabric() = default;
Fabric::~Fabric() = default;

EngineWorker& Fabric::async_worker() {
  if (!async_worker_) async_worker_ = std::make_unique<EngineWorker>();
  return *async_worker_;
}

FabricRequest<void> Fabric::forward_async(StreamSource& weights,
                                          std::vector<const Placement*> placements,
                                          std::vector<ConstMatrixView> xs,
                                          std::vector<MutableMatrixView> ys) {
  return FabricRequest<void>(
      async_worker().post([this, &weights, placements = std::move(placements), xs = std::move(xs),
                           ys = std::move(ys)] { forward(weights, placements, xs, ys); }));
}

ReducedGradient Fabric::backward(StreamSource& weights,
                                 std::span<const Placement* const> placements,
                                 std::span<const ConstMatrixView> xs,
                                 std::span<const ConstMatrixView> dys,
                                 std::span<MutableMatrixView* const> dxs, bool with_bias) {
  const std::int32_t n = engine_count();
  check_placements(placements, n);
  check_count(xs, n, "X views");
  check_count(dys, n, "dY views");
  if (!dxs.empty()) check_count(dxs, n, "dX views");
  const bool want_dx = std::any_of(dxs.begin(), dxs.end(), [](auto* p) { return p != nullptr; });
  if (want_dx && weights.header().kind != StreamKind::weights) {
    throw ArgumentError("fabric backward with dX needs a weights stream");
  }
  return backward_impl(weights, placements, xs, dys, dxs, with_bias);
}

FabricRequest<ReducedGradient> Fabric::backward_async(StreamSource& weights,
                                                      std::vector<const Placement*> placements,
                                                      std::vector<ConstMatrixView> xs,
                                                      std::vector<ConstMatrixView> dys,
                                                      std::vector<MutableMatrixView*> dxs,
                                                      bool with_bias) {
  return FabricRequest<ReducedGradient>(
      async_worker().post([this, &weights, placements = std::move(placements), xs = std::move(xs),
                           dys = std::move(dys), dxs = std::move(dxs), with_bias] {
        return backward(weights, placements, xs, dys, dxs, with_bias);
      }));
}

Fabric::TokenRange Fabric::shard_of(std::int32_t k, std::int32_t engines, std::int64_t tokens) {
  const std::int64_t first = k * tokens / engines;
  return {first, (k + 1) * tokens / engines - first};
}

void Fabric::load_batch(const PassSpec& spec, const ShardData& batch) {
  const std::int32_t n = engine_count();
  const std::int64_t tokens = batch.features.cols;
  if (tokens < n) {
    throw ShapeError("fabric: a batch of " + std::to_string(tokens) +
                     " tokens cannot be split over " + engines_text(static_cast<std::size_t>(n)));
  }
  if (!batch.labels.empty() && static_cast<std::int64_t>(batch.labels.size()) != tokens) {
    throw ShapeError("fabric: " + std::to_string(batch.labels.size()) + " labels for " +
                     std::to_string(tokens) + " tokens");
  }
  if (batch.targets && batch.targets->cols != tokens) {
    throw ShapeError("fabric: targets for " + std::to_string(batch.targets->cols) + " of " +
                     std::to_string(tokens) + " tokens");
  }
  load_batch_impl(spec, batch);
  counters_.driver_bytes_sent += bytes_of(batch.features) + batch.labels.size() * sizeof(int) +
                                 (batch.targets ? bytes_of(*batch.targets) : 0);
}

void Fabric::load_samples(const PassSpec& spec, std::span<const std::int64_t> indices) {
  if (dataset_ == nullptr) throw ArgumentError("fabric load_samples: no data set attached");
  const auto n = static_cast<std::int64_t>(indices.size());
  if (n < engine_count()) {
    throw ShapeError("fabric: a batch of " + std::to_string(n) + " samples cannot be split over " +
                     engines_text(static_cast<std::size_t>(engine_count())));
  }
  for (const std::int64_t s : indices) {
    if (s < 0 || s >= dataset_->samples()) {
      throw ArgumentError("fabric load_samples: sample " + std::to_string(s) + " of a set of " +
                          std::to_string(dataset_->samples()));
    }
  }
  load_samples_impl(spec, indices);
  counters_.driver_bytes_sent += indices.size() * sizeof(std::int64_t);
}

void Fabric::forward_layer(StreamSource& weights, std::span<const Placement* const> placements,
                           std::int32_t layer, std::span<const float> bias) {
  if (weights.header().kind != StreamKind::weights ||
      weights.header().order != StreamOrder::by_output) {
    throw ArgumentError("fabric forward_layer needs a weights stream by output");
  }
  check_placements(placements, engine_count());
  CountingSource counted(weights, counters_.driver_bytes_sent);
  forward_layer_impl(counted, placements, layer, bias);
  counters_.driver_bytes_sent += bias.size() * sizeof(float);
}

LossSums Fabric::loss(bool want_delta, std::int64_t total_tokens) {
  const std::vector<LossSums> parts = loss_impl(want_delta, total_tokens);
  counters_.driver_bytes_received += parts.size() * sizeof(LossSums);
  LossSums sum;
  for (const LossSums& p : parts) sum += p;
  return sum;
}

ReducedGradient Fabric::backward_layer(StreamSource& weights,
                                       std::span<const Placement* const> placements,
                                       std::int32_t layer, bool want_dx, bool with_bias) {
  check_placements(placements, engine_count());
  if (want_dx && weights.header().kind != StreamKind::weights) {
    throw ArgumentError("fabric backward_layer with dX needs a weights stream");
  }
  CountingSource counted(weights, counters_.driver_bytes_sent);
  ReducedGradient g = backward_layer_impl(counted, placements, layer, want_dx, with_bias);
  counters_.driver_bytes_received += g.weights.byte_size() + g.bias.size() * sizeof(float);
  return g;
}

DenseMatrix Fabric::gather_output() {
  DenseMatrix y = gather_output_impl();
  counters_.driver_bytes_received += bytes_of(y.view());
  return y;
}

void Fabric::load_tokens(const BlockShape& shape, std::span<const std::int32_t> inputs,
                         std::span<const std::int32_t> targets) {
  const std::int32_t n = engine_count();
  const auto tokens = static_cast<std::int64_t>(inputs.size());
  if (shape.context < 1 || tokens % shape.context != 0 || tokens / shape.context < n) {
    throw ShapeError("fabric load_tokens: " + std::to_string(tokens) + " tokens are not " +
                     "whole sequences of " + std::to_string(shape.context) + " for " +
                     engines_text(static_cast<std::size_t>(n)) + " (each takes whole sequences)");
  }
  if (!targets.empty() && targets.size() != inputs.size()) {
    throw ShapeError("fabric load_tokens: " + std::to_string(targets.size()) + " targets for " +
                     std::to_string(tokens) + " inputs");
  }
  load_tokens_impl(shape, inputs, targets);
  counters_.driver_bytes_sent += (inputs.size() + targets.size()) * sizeof(std::int32_t);
}

BlockResult Fabric::run_block(const BlockCall& call, StreamSource* weights,
                              std::span<const Placement* const> placements,
                              std::span<const float> bias) {
  const auto op = static_cast<std::int32_t>(call.op);
  if (op < kFirstBlockOp || op > kLastBlockOp) {
    throw ArgumentError("fabric run_block: unknown operation " + std::to_string(op));
  }
  if (takes_stream(call.op) != (weights != nullptr)) {
    throw ArgumentError(std::string("fabric run_block: ") + to_string(call.op) +
                        (weights != nullptr ? " takes no stream" : " needs a stream"));
  }
  if (is_projection(call.op)) {
    check_placements(placements, engine_count());
  } else if (!placements.empty()) {
    throw ArgumentError(std::string("fabric run_block: ") + to_string(call.op) +
                        " is no projection and takes no placements");
  }
  BlockResult r;
  if (weights != nullptr) {
    CountingSource counted(*weights, counters_.driver_bytes_sent);
    r = run_block_impl(call, &counted, placements, bias);
  } else {
    r = run_block_impl(call, nullptr, placements, bias);
  }
  counters_.driver_bytes_sent += bias.size() * sizeof(float);
  counters_.driver_bytes_received +=
      r.gradient.weights.byte_size() + r.gradient.bias.size() * sizeof(float);
  if (call.op == BlockOp::loss) counters_.driver_bytes_received += sizeof(LossSums);
  return r;
}

std::vector<float> Fabric::block_logits(std::int64_t token) {
  std::vector<float> logits = block_logits_impl(token);
  counters_.driver_bytes_received += logits.size() * sizeof(float);
  return logits;
}

void Fabric::with_layer_activations(std::int32_t layer, const ActivationsFn& fn) {
  std::vector<ConstMatrixView> xs, dzs;
  layer_activations_impl(layer, xs, dzs);  // counts what it moves, if anything
  fn(xs, dzs);
}

std::vector<std::int64_t> Fabric::growth_top_k(const GrowthSource& source, const CsrMatrix& mask,
                                               std::int64_t k) {
  const std::int64_t inactive = mask.rows() * mask.cols() - mask.nnz();
  if (k < 0 || k > inactive) {
    throw ArgumentError("fabric growth_top_k: k = " + std::to_string(k) + " but the layer has " +
                        std::to_string(inactive) + " inactive positions");
  }
  return growth_top_k_impl(source, mask, k);  // counts what it moves, if anything
}

std::vector<std::int64_t> Fabric::growth_top_k_impl(const GrowthSource& source,
                                                    const CsrMatrix& mask, std::int64_t k) {
  std::vector<ConstMatrixView> xs, dys;
  for (std::int32_t e = 0; e < engine_count(); ++e) {
    const auto [x, dy] = engine(e).growth_activations(source);
    xs.push_back(x);
    dys.push_back(dy);
  }
  return detail::dense_gradient_top_k(mask, xs, dys, k);
}

}  // namespace sluice
