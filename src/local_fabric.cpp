// The Fabric's public calls (argument checks) and the in-process LocalFabric.
#include <algorithm>
#include <exception>
#include <future>
#include <memory>
#include <string>

#include "engine_worker.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"

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
      throw ShapeError("fabric: placement of engine " + std::to_string(k) + " is null");
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

// Broadcasts `source` to n engines: each reads its own channel; this thread feeds them all
// the same chunk pointers. An engine that fails drains its channel, so the feeder never
// blocks on it.
template <typename Fn>
void broadcast(StreamSource& source, std::vector<std::unique_ptr<EngineWorker>>& workers,
               std::size_t capacity, Fn&& per_engine) {
  const auto n = static_cast<std::int32_t>(workers.size());
  if (n == 1) {
    per_engine(0, source);
    return;
  }
  std::vector<std::unique_ptr<StreamChannel>> channels;
  for (std::int32_t k = 0; k < n; ++k)
    channels.push_back(std::make_unique<StreamChannel>(capacity));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::future<void>> running;
  for (std::int32_t k = 0; k < n; ++k) {
    running.push_back(workers[static_cast<std::size_t>(k)]->post([&, k] {
      StreamChannel& channel = *channels[static_cast<std::size_t>(k)];
      ChannelStreamSource engine_source(source.header(), channel);
      try {
        per_engine(k, engine_source);
      } catch (...) {
        errors[static_cast<std::size_t>(k)] = std::current_exception();
      }
      try {
        while (channel.pop() != nullptr) {
        }
      } catch (...) {  // the feeder's own error is reported below, once
      }
    }));
  }
  std::exception_ptr feed_error;
  try {
    while (ChunkPtr chunk = source.next()) {
      for (auto& channel : channels) channel->push(chunk);
    }
    for (auto& channel : channels) channel->close();
  } catch (...) {
    feed_error = std::current_exception();
    for (auto& channel : channels) channel->fail(feed_error);
  }
  for (auto& r : running) r.wait();
  if (feed_error) std::rethrow_exception(feed_error);
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace

std::vector<float> bias_gradient(ConstMatrixView dy) {
  std::vector<float> b(static_cast<std::size_t>(dy.rows));
  for (std::int64_t o = 0; o < dy.rows; ++o) {
    double s = 0;
    const float* row = dy.row(o);
    for (std::int64_t t = 0; t < dy.cols; ++t) s += row[t];
    b[static_cast<std::size_t>(o)] = static_cast<float>(s);
  }
  return b;
}

ReducedGradient reduce_gradients(std::vector<WeightStream> streams,
                                 std::vector<std::vector<float>> biases) {
  if (streams.empty()) throw ShapeError("reduce_gradients: no streams");
  if (!biases.empty() && biases.size() != streams.size()) {
    throw ShapeError("reduce_gradients: " + std::to_string(biases.size()) + " bias vectors for " +
                     std::to_string(streams.size()) + " streams");
  }
  for (const auto& b : biases) {
    if (b.size() != biases.front().size()) {
      throw FormatError("reduce_gradients: bias gradients differ in size");
    }
  }
  // Pairwise tree: at distance d, element i (a multiple of 2d) absorbs element i + d.
  for (std::size_t d = 1; d < streams.size(); d *= 2) {
    for (std::size_t i = 0; i + d < streams.size(); i += 2 * d) {
      streams[i] = add_streams(streams[i], streams[i + d]);
      if (!biases.empty()) {
        for (std::size_t o = 0; o < biases[i].size(); ++o) biases[i][o] += biases[i + d][o];
      }
    }
  }
  ReducedGradient r;
  r.weights = std::move(streams.front());
  if (!biases.empty()) r.bias = std::move(biases.front());
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
    throw ShapeError(std::string("fabric forward needs a weights stream, got a ") +
                     to_string(weights.header().kind) + " stream");
  }
  if (weights.header().order != StreamOrder::by_output) {
    throw ShapeError(std::string("fabric forward needs a stream by output, got one ") +
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
    throw ShapeError("fabric backward with dX needs a weights stream");
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

LocalFabric::LocalFabric(LocalFabricOptions options) : options_(std::move(options)) {
  if (options_.engines < 1) {
    throw ShapeError("LocalFabric: needs at least one engine, got " +
                     std::to_string(options_.engines));
  }
  if (options_.channel_capacity < 1) throw ShapeError("LocalFabric: channel capacity 0");
  EngineOptions eo = options_.engine;
  if (eo.threads < 0) {
    throw ShapeError("LocalFabric: engine threads must be >= 0 (0: share the cores), got " +
                     std::to_string(eo.threads));
  }
  if (eo.threads == 0) {
    const auto cores = static_cast<std::int32_t>(std::max(1U, std::thread::hardware_concurrency()));
    eo.threads = std::max(1, cores / options_.engines);
  }
  for (std::int32_t k = 0; k < options_.engines; ++k) {
    engines_.push_back(std::make_unique<CpuEngine>(eo));
  }
  if (options_.engines > 1) {
    for (std::int32_t k = 0; k < options_.engines; ++k) {
      workers_.push_back(std::make_unique<EngineWorker>());
    }
  } else {
    workers_.push_back(nullptr);  // one engine runs on the caller's thread
  }
}

LocalFabric::~LocalFabric() = default;

std::int32_t LocalFabric::engine_count_impl() const {
  return static_cast<std::int32_t>(engines_.size());
}

Engine& LocalFabric::engine_impl(std::int32_t k) {
  return *engines_[static_cast<std::size_t>(k)];
}

void LocalFabric::forward_impl(StreamSource& weights, std::span<const Placement* const> placements,
                               std::span<const ConstMatrixView> xs,
                               std::span<const MutableMatrixView> ys) {
  broadcast(weights, workers_, options_.channel_capacity,
            [&](std::int32_t k, StreamSource& source) {
              const auto i = static_cast<std::size_t>(k);
              engines_[i]->forward(source, *placements[i], xs[i], ys[i]);
            });
}

ReducedGradient LocalFabric::backward_impl(StreamSource& weights,
                                           std::span<const Placement* const> placements,
                                           std::span<const ConstMatrixView> xs,
                                           std::span<const ConstMatrixView> dys,
                                           std::span<MutableMatrixView* const> dxs,
                                           bool with_bias) {
  const std::int32_t n = engine_count();
  std::vector<WeightStream> grads(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> biases(with_bias ? static_cast<std::size_t>(n) : 0);
  broadcast(weights, workers_, options_.channel_capacity,
            [&](std::int32_t k, StreamSource& source) {
              const auto i = static_cast<std::size_t>(k);
              MutableMatrixView* dx = dxs.empty() ? nullptr : dxs[i];
              grads[i] = engines_[i]->backward(source, *placements[i], xs[i], dys[i], dx);
              if (with_bias) biases[i] = bias_gradient(dys[i]);
            });
  return reduce_gradients(std::move(grads), std::move(biases));
}

}  // namespace sluice
