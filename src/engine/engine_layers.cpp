// The Engine's layer operations: a step's forward, loss and backward on the activations
// the engine keeps in its own store, on top of the engine's product calls.
#include <cmath>
#include <functional>
#include <string>

#include "core/parallel.hpp"
#include "executor/gelu.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"
#include "sluice/fabric.hpp"

namespace sluice {
namespace {

using detail::gelu;
using detail::gelu_slope;

// Row by row, with the activation chosen outside the loops so each one vectorises (a
// switch per element made these passes a visible part of a wide layer's training step).

/// out = act(z + bias) over a row of n tokens; z gets the bias added in place.
void add_bias_and_activate(Activation a, float bias, float* z, float* out, std::int64_t n) {
  if (bias != 0.0F) {
    for (std::int64_t t = 0; t < n; ++t) z[t] += bias;
  }
  switch (a) {
    case Activation::relu:  // NaN passes on: a NaN input must not become a finite output
      for (std::int64_t t = 0; t < n; ++t) out[t] = z[t] <= 0 ? 0.0F : z[t];
      return;
    case Activation::gelu:
      for (std::int64_t t = 0; t < n; ++t) out[t] = gelu(z[t]);
      return;
    case Activation::none:
      return;
  }
}

/// d *= act'(z) over a row of n tokens.
void scale_by_slope(Activation a, const float* z, float* d, std::int64_t n) {
  switch (a) {
    case Activation::relu:
      for (std::int64_t t = 0; t < n; ++t) {
        const float slope = z[t] > 0 ? 1.0F : 0.0F;  // (GCC 12 vectorises this form only)
        d[t] = d[t] * slope;
      }
      return;
    case Activation::gelu:
      for (std::int64_t t = 0; t < n; ++t) d[t] *= gelu_slope(z[t]);
      return;
    case Activation::none:
      return;
  }
}

/// fn(row) for every row of a rows x cols pass, on every thread `on_threads` gives it
/// when it is large enough to pay for waking them (a small layer's whole pass is over in
/// microseconds).
template <typename OnThreads, typename Fn>
void for_each_row(std::int64_t rows, std::int64_t cols, OnThreads&& on_threads, Fn&& fn) {
  constexpr std::int64_t kParallelElements = std::int64_t{1} << 16;
  if (rows * cols < kParallelElements) {
    for (std::int64_t r = 0; r < rows; ++r) fn(r);
  } else {
    on_threads([&] { detail::parallel_for(std::int64_t{0}, rows, fn); });
  }
}

/// Softmax cross-entropy of token t of y against `label`; dA into d (scaled) if given.
double cross_entropy(ConstMatrixView y, std::int64_t t, int label, MutableMatrixView* d,
                     double scale, std::int64_t* correct) {
  const std::int64_t outputs = y.rows;
  double peak = y(0, t);
  std::int64_t best = 0;
  for (std::int64_t o = 1; o < outputs; ++o) {
    if (y(o, t) > peak) {
      peak = y(o, t);
      best = o;
    }
  }
  if (best == label) ++*correct;
  double sum = 0;
  for (std::int64_t o = 0; o < outputs; ++o) sum += std::exp(y(o, t) - peak);
  const double log_sum = std::log(sum) + peak;
  if (d != nullptr) {
    for (std::int64_t o = 0; o < outputs; ++o) {
      const double p = std::exp(y(o, t) - log_sum);
      (*d)(o, t) = static_cast<float>((p - (o == label ? 1.0 : 0.0)) * scale);
    }
  }
  return log_sum - y(label, t);
}

void check_layer(const ActivationStore& store, std::int32_t layer, const char* what) {
  if (!store.loaded()) {
    throw ArgumentError(std::string("engine ") + what + ": no batch shard loaded");
  }
  if (layer < 0 || layer >= store.layers()) {
    throw ArgumentError(std::string("engine ") + what + ": layer " + std::to_string(layer) +
                        " of " + std::to_string(store.layers()));
  }
}

}  // namespace

void Engine::load_shard(const PassSpec& spec, const ShardData& shard) {
  store_.load(spec, shard);
}

void Engine::load_samples(const PassSpec& spec, const Dataset& data,
                          std::span<const std::int64_t> indices) {
  DenseMatrix x(data.features.rows(), static_cast<std::int64_t>(indices.size()));
  std::vector<int> labels;
  labels.reserve(indices.size());
  for (std::size_t t = 0; t < indices.size(); ++t) {
    const std::int64_t s = indices[t];
    if (s < 0 || s >= data.samples()) {
      throw ArgumentError("engine load_samples: sample " + std::to_string(s) + " of a set of " +
                          std::to_string(data.samples()));
    }
    for (std::int64_t f = 0; f < x.rows(); ++f)
      x(f, static_cast<std::int64_t>(t)) = data.features(f, s);
    labels.push_back(data.labels[static_cast<std::size_t>(s)]);
  }
  store_.load(spec, {x.view(), labels, std::nullopt});
}

void Engine::forward_layer(StreamSource& weights, const Placement& placement, std::int32_t layer,
                           std::span<const float> bias) {
  check_layer(store_, layer, "forward_layer");
  MutableMatrixView z = store_.z(layer);
  if (!bias.empty() && static_cast<std::int64_t>(bias.size()) != z.rows) {
    throw ShapeError("engine forward_layer: " + std::to_string(bias.size()) + " biases for " +
                     std::to_string(z.rows) + " outputs of layer " + std::to_string(layer));
  }
  forward(weights, placement, store_.in(layer), z);
  const Activation act = store_.spec().activations[static_cast<std::size_t>(layer)];
  MutableMatrixView a = store_.a(layer);
  for_each_row(
      z.rows, z.cols, [this](const std::function<void()>& f) { on_engine_threads(f); },
      [&](std::int64_t o) {
        const float b = bias.empty() ? 0.0F : bias[static_cast<std::size_t>(o)];
        add_bias_and_activate(act, b, z.row(o), act != Activation::none ? a.row(o) : nullptr,
                              z.cols);
      });
}

LossSums Engine::loss(bool want_delta, std::int64_t total_tokens) {
  check_layer(store_, 0, "loss");
  const std::int32_t last = store_.layers() - 1;
  const ConstMatrixView y = store_.out(last);
  const std::int64_t outputs = y.rows;
  const Loss kind = store_.spec().loss;
  const std::span<const int> labels = store_.labels();
  const std::optional<ConstMatrixView> target = store_.targets();
  if (kind == Loss::softmax_cross_entropy ? labels.size() != static_cast<std::size_t>(y.cols)
                                          : !target.has_value()) {
    throw ArgumentError("engine loss: the shard was loaded without its labels or targets");
  }
  if (want_delta && total_tokens < 1) {
    throw ArgumentError("engine loss: a delta needs the batch's token count, got " +
                        std::to_string(total_tokens));
  }
  MutableMatrixView d{};
  if (want_delta) d = store_.delta(outputs);
  const double scale = want_delta ? 1.0 / static_cast<double>(total_tokens) : 0.0;
  LossSums sums;
  sums.tokens = y.cols;
  for (std::int64_t t = 0; t < y.cols; ++t) {
    double token_loss = 0;
    if (kind == Loss::softmax_cross_entropy) {
      token_loss = cross_entropy(y, t, labels[static_cast<std::size_t>(t)],
                                 want_delta ? &d : nullptr, scale, &sums.correct);
    } else {
      for (std::int64_t o = 0; o < outputs; ++o) {
        const double diff = static_cast<double>(y(o, t)) - (*target)(o, t);
        token_loss += 0.5 * diff * diff;
        if (want_delta) d(o, t) = static_cast<float>(diff * scale);
      }
    }
    if (!std::isfinite(token_loss)) sums.non_finite = true;
    sums.loss += token_loss;
  }
  return sums;
}

WeightStream Engine::backward_layer(StreamSource& weights, const Placement& placement,
                                    std::int32_t layer, bool want_dx,
                                    std::vector<float>* bias_gradient_out) {
  check_layer(store_, layer, "backward_layer");
  const auto li = static_cast<std::size_t>(layer);
  const std::vector<std::int64_t>& sizes = store_.spec().sizes;
  MutableMatrixView d = store_.delta(sizes[li + 1]);
  const Activation act = store_.spec().activations[li];
  if (act != Activation::none) {  // dZ = dA * act'(Z), in place
    const ConstMatrixView z = store_.z(layer);
    for_each_row(
        d.rows, d.cols, [this](const std::function<void()>& f) { on_engine_threads(f); },
        [&](std::int64_t o) { scale_by_slope(act, z.row(o), d.row(o), d.cols); });
  }
  MutableMatrixView dx{};
  if (want_dx) {
    if (layer == 0) throw ArgumentError("engine backward_layer: layer 0 has no layer below");
    dx = store_.delta_below(sizes[li]);
  }
  WeightStream gradient =
      backward(weights, placement, store_.in(layer), d, want_dx ? &dx : nullptr);
  if (bias_gradient_out != nullptr) *bias_gradient_out = bias_gradient(d);
  store_.swap_deltas();
  return gradient;
}

}  // namespace sluice
