// The in-process LocalFabric: N CpuEngines, each driven by a thread of its own.
#include <algorithm>
#include <exception>
#include <future>
#include <memory>
#include <string>

#include "engine/engine_worker.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"

namespace sluice {

namespace {

using detail::EngineWorker;

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

LocalFabric::LocalFabric(LocalFabricOptions options) : options_(std::move(options)) {
  if (options_.engines < 1) {
    throw ArgumentError("LocalFabric: needs at least one engine, got " +
                        std::to_string(options_.engines));
  }
  if (options_.channel_capacity < 1) throw ArgumentError("LocalFabric: channel capacity 0");
  EngineOptions eo = options_.engine;
  if (eo.threads < 0) {
    throw ArgumentError("LocalFabric: engine threads must be >= 0 (0: share the cores), got " +
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
  return broadcast_and_reduce(
      weights, with_bias, [&](std::size_t i, StreamSource& source, std::vector<float>* bias) {
        MutableMatrixView* dx = dxs.empty() ? nullptr : dxs[i];
        WeightStream g = engines_[i]->backward(source, *placements[i], xs[i], dys[i], dx);
        if (bias != nullptr) *bias = bias_gradient(dys[i]);
        return g;
      });
}

ReducedGradient LocalFabric::broadcast_and_reduce(StreamSource& weights, bool with_bias,
                                                  const EngineBackward& backward) {
  const std::int32_t n = engine_count();
  std::vector<WeightStream> grads(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> biases(with_bias ? static_cast<std::size_t>(n) : 0);
  broadcast(weights, workers_, options_.channel_capacity,
            [&](std::int32_t k, StreamSource& source) {
              const auto i = static_cast<std::size_t>(k);
              grads[i] = backward(i, source, with_bias ? &biases[i] : nullptr);
            });
  return reduce_gradients(std::move(grads), std::move(biases));
}

void LocalFabric::for_each_engine(const std::function<void(std::int32_t)>& fn) {
  if (engines_.size() == 1) {
    fn(0);
    return;
  }
  std::vector<std::future<void>> running;
  for (std::size_t k = 0; k < engines_.size(); ++k) {
    running.push_back(workers_[k]->post([&fn, k] { fn(static_cast<std::int32_t>(k)); }));
  }
  for (auto& r : running) r.wait();
  for (auto& r : running) r.get();
}

void LocalFabric::load_batch_impl(const PassSpec& spec, const ShardData& batch) {
  const std::int32_t n = engine_count();
  for_each_engine([&](std::int32_t k) {
    const TokenRange r = shard_of(k, n, batch.features.cols);
    ShardData shard;
    shard.features = {batch.features.data + r.first, batch.features.rows, r.count,
                      batch.features.stride};
    if (!batch.labels.empty()) {
      shard.labels = batch.labels.subspan(static_cast<std::size_t>(r.first),
                                          static_cast<std::size_t>(r.count));
    }
    if (batch.targets) {
      const ConstMatrixView& t = *batch.targets;
      shard.targets = ConstMatrixView{t.data + r.first, t.rows, r.count, t.stride};
    }
    engines_[static_cast<std::size_t>(k)]->load_shard(spec, shard);
  });
}

void LocalFabric::load_samples_impl(const PassSpec& spec, std::span<const std::int64_t> indices) {
  const std::int32_t n = engine_count();
  for_each_engine([&](std::int32_t k) {
    const TokenRange r = shard_of(k, n, static_cast<std::int64_t>(indices.size()));
    engines_[static_cast<std::size_t>(k)]->load_samples(
        spec, *dataset_,
        indices.subspan(static_cast<std::size_t>(r.first), static_cast<std::size_t>(r.count)));
  });
}

void LocalFabric::forward_layer_impl(StreamSource& weights,
                                     std::span<const Placement* const> placements,
                                     std::int32_t layer, std::span<const float> bias) {
  broadcast(weights, workers_, options_.channel_capacity,
            [&](std::int32_t k, StreamSource& source) {
              const auto i = static_cast<std::size_t>(k);
              engines_[i]->forward_layer(source, *placements[i], layer, bias);
            });
}

std::vector<LossSums> LocalFabric::loss_impl(bool want_delta, std::int64_t total_tokens) {
  std::vector<LossSums> parts(engines_.size());
  for_each_engine([&](std::int32_t k) {
    parts[static_cast<std::size_t>(k)] =
        engines_[static_cast<std::size_t>(k)]->loss(want_delta, total_tokens);
  });
  return parts;
}

ReducedGradient LocalFabric::backward_layer_impl(StreamSource& weights,
                                                 std::span<const Placement* const> placements,
                                                 std::int32_t layer, bool want_dx, bool with_bias) {
  return broadcast_and_reduce(
      weights, with_bias, [&](std::size_t i, StreamSource& source, std::vector<float>* bias) {
        return engines_[i]->backward_layer(source, *placements[i], layer, want_dx, bias);
      });
}

DenseMatrix LocalFabric::gather_output_impl() {
  std::int64_t tokens = 0;
  for (const auto& e : engines_) {
    if (!e->store().loaded()) throw ArgumentError("fabric gather_output: no batch loaded");
    tokens += e->store().tokens();
  }
  const std::int32_t last = engines_.front()->store().layers() - 1;
  DenseMatrix y(engines_.front()->store().out(last).rows, tokens);
  std::int64_t first = 0;
  for (const auto& e : engines_) {
    const ConstMatrixView out = e->store().out(last);
    for (std::int64_t o = 0; o < out.rows; ++o) {
      std::copy(out.row(o), out.row(o) + out.cols, y.row(o) + first);
    }
    first += out.cols;
  }
  return y;
}

void LocalFabric::layer_activations_impl(std::int32_t layer, std::vector<ConstMatrixView>& xs,
                                         std::vector<ConstMatrixView>& dzs) {
  for (const auto& e : engines_) {
    const ActivationStore& store = e->store();
    if (!store.loaded() || layer < 0 || layer >= store.layers()) {
      throw ArgumentError("fabric layer activations: no layer " + std::to_string(layer) +
                          " in the engines' stores");
    }
    xs.push_back(store.in(layer));
    dzs.push_back(store.last_delta(store.spec().sizes[static_cast<std::size_t>(layer) + 1]));
  }
}

void LocalFabric::load_tokens_impl(const BlockShape& shape, std::span<const std::int32_t> inputs,
                                   std::span<const std::int32_t> targets) {
  const std::int32_t n = engine_count();
  const auto sequences = static_cast<std::int64_t>(inputs.size()) / shape.context;
  for_each_engine([&](std::int32_t k) {
    const TokenRange r = shard_of(k, n, sequences);
    const auto first = static_cast<std::size_t>(r.first * shape.context);
    const auto count = static_cast<std::size_t>(r.count * shape.context);
    engines_[static_cast<std::size_t>(k)]->load_tokens(
        shape, inputs.subspan(first, count),
        targets.empty() ? targets : targets.subspan(first, count));
  });
}

BlockResult LocalFabric::run_block_impl(const BlockCall& call, StreamSource* weights,
                                        std::span<const Placement* const> placements,
                                        std::span<const float> bias) {
  const auto n = static_cast<std::size_t>(engine_count());
  std::vector<BlockReply> replies(n);
  auto run = [&](std::int32_t k, StreamSource* source) {
    const auto i = static_cast<std::size_t>(k);
    replies[i] =
        engines_[i]->run_block(call, source, placements.empty() ? nullptr : placements[i], bias);
  };
  if (weights != nullptr) {
    broadcast(*weights, workers_, options_.channel_capacity,
              [&](std::int32_t k, StreamSource& source) { run(k, &source); });
  } else {
    for_each_engine([&](std::int32_t k) { run(k, nullptr); });
  }
  BlockResult r;
  for (const BlockReply& reply : replies) r.loss += reply.loss;
  if (returns_gradient(call.op)) {
    std::vector<WeightStream> grads;
    std::vector<std::vector<float>> biases;
    for (BlockReply& reply : replies) {
      grads.push_back(std::move(reply.gradient));
      if (has_bias_gradient(call.op)) biases.push_back(std::move(reply.bias_gradient));
    }
    r.gradient = reduce_gradients(std::move(grads), std::move(biases));
  }
  return r;
}

std::vector<float> LocalFabric::block_logits_impl(std::int64_t token) {
  const BlockStore& s = engines_.front()->block_store();
  if (!s.loaded() || token < 0 || token >= s.tokens()) {
    throw ArgumentError("fabric block_logits: no token " + std::to_string(token) +
                        " in engine 0's block store");
  }
  std::vector<float> out(static_cast<std::size_t>(s.logits.rows()));
  for (std::int64_t o = 0; o < s.logits.rows(); ++o) {
    out[static_cast<std::size_t>(o)] = s.logits(o, token);
  }
  return out;
}

}  // namespace sluice
