// LayerNorm over the features of each token. The activations are feature-major, so a
// token's features are a column: the loops run over features outside and a chunk of tokens
// inside (contiguous, vectorised), with the per-token sums of the chunk in double.
#include <algorithm>
#include <array>
#include <cmath>

#include "blocks/block_support.hpp"
#include "sluice/blocks.hpp"

namespace sluice {
namespace {

constexpr std::int64_t kTokenChunk = 64;

/// fn(begin, end) over chunks of the tokens, in parallel when there is enough work.
template <typename Fn>
void for_each_token_chunk(std::int64_t features, std::int64_t tokens, Fn&& fn) {
  const std::int64_t chunks = (tokens + kTokenChunk - 1) / kTokenChunk;
  detail::for_each_block_row(chunks, features * kTokenChunk, [&](std::int64_t c) {
    fn(c * kTokenChunk, std::min(tokens, (c + 1) * kTokenChunk));
  });
}

void check_parameters(const char* block, std::int64_t d_model, std::span<const float> gain,
                      const char* bias_name, std::size_t bias_size) {
  if (d_model <= 0) throw ShapeError(std::string(block) + ": no features to normalise");
  detail::require_size(block, "gain", gain.size(), d_model);
  detail::require_size(block, bias_name, bias_size, d_model);
}

}  // namespace

void layer_norm_forward(ConstMatrixView x, std::span<const float> gain, std::span<const float> bias,
                        MutableMatrixView y, LayerNormStatistics stats, float epsilon) {
  const char* block = "layer_norm_forward";
  check_parameters(block, x.rows, gain, "bias", bias.size());
  detail::require_shape(block, "x", x, x.rows, x.cols);
  detail::require_shape(block, "y", y, x.rows, x.cols);
  detail::require_size(block, "mean", stats.mean.size(), x.cols);
  detail::require_size(block, "inv_std", stats.inv_std.size(), x.cols);
  if (!(epsilon > 0.0F)) throw ArgumentError(std::string(block) + ": epsilon must be positive");
  const std::int64_t d = x.rows;
  for_each_token_chunk(d, x.cols, [&](std::int64_t begin, std::int64_t end) {
    const std::int64_t n = end - begin;
    std::array<double, kTokenChunk> sum{}, squares{};
    for (std::int64_t f = 0; f < d; ++f) {
      const float* in = x.row(f) + begin;
      for (std::int64_t i = 0; i < n; ++i) sum[i] += in[i];
    }
    for (std::int64_t i = 0; i < n; ++i) sum[i] /= static_cast<double>(d);
    for (std::int64_t f = 0; f < d; ++f) {  // two passes: no cancellation in the variance
      const float* in = x.row(f) + begin;
      for (std::int64_t i = 0; i < n; ++i) {
        const double centred = in[i] - sum[i];
        squares[i] += centred * centred;
      }
    }
    std::array<float, kTokenChunk> mean{}, inv_std{};
    for (std::int64_t i = 0; i < n; ++i) {
      mean[i] = static_cast<float>(sum[i]);
      inv_std[i] = static_cast<float>(
          1.0 / std::sqrt(squares[i] / static_cast<double>(d) + static_cast<double>(epsilon)));
      stats.mean[static_cast<std::size_t>(begin + i)] = mean[i];
      stats.inv_std[static_cast<std::size_t>(begin + i)] = inv_std[i];
    }
    for (std::int64_t f = 0; f < d; ++f) {
      const float* in = x.row(f) + begin;
      float* out = y.row(f) + begin;
      const float g = gain[static_cast<std::size_t>(f)];
      const float b = bias[static_cast<std::size_t>(f)];
      for (std::int64_t i = 0; i < n; ++i) out[i] = g * ((in[i] - mean[i]) * inv_std[i]) + b;
    }
  });
}

void layer_norm_backward(ConstMatrixView x, std::span<const float> gain,
                         std::span<const float> mean, std::span<const float> inv_std,
                         ConstMatrixView dy, MutableMatrixView dx, std::span<float> d_gain,
                         std::span<float> d_bias) {
  const char* block = "layer_norm_backward";
  check_parameters(block, x.rows, gain, "d_bias", d_bias.size());
  detail::require_size(block, "d_gain", d_gain.size(), x.rows);
  detail::require_shape(block, "x", x, x.rows, x.cols);
  detail::require_shape(block, "dy", dy, x.rows, x.cols);
  detail::require_shape(block, "dx", dx, x.rows, x.cols);
  detail::require_size(block, "mean", mean.size(), x.cols);
  detail::require_size(block, "inv_std", inv_std.size(), x.cols);
  const std::int64_t d = x.rows;
  // The parameters' gradients: one feature (a reduction over its tokens) per task.
  detail::for_each_block_row(d, x.cols, [&](std::int64_t f) {
    const float* in = x.row(f);
    const float* grad = dy.row(f);
    double g_sum = 0, b_sum = 0;
    for (std::int64_t t = 0; t < x.cols; ++t) {
      const auto i = static_cast<std::size_t>(t);
      g_sum += static_cast<double>(grad[t]) * ((in[t] - mean[i]) * inv_std[i]);
      b_sum += grad[t];
    }
    d_gain[static_cast<std::size_t>(f)] += static_cast<float>(g_sum);
    d_bias[static_cast<std::size_t>(f)] += static_cast<float>(b_sum);
  });
  // dx = inv_std * (g - mean_f(g) - x_hat * mean_f(g * x_hat)), g = gain * dy.
  for_each_token_chunk(d, x.cols, [&](std::int64_t begin, std::int64_t end) {
    const std::int64_t n = end - begin;
    const float* mu = mean.data() + begin;
    const float* is = inv_std.data() + begin;
    std::array<double, kTokenChunk> g_mean{}, gx_mean{};
    for (std::int64_t f = 0; f < d; ++f) {
      const float* in = x.row(f) + begin;
      const float* grad = dy.row(f) + begin;
      const float gn = gain[static_cast<std::size_t>(f)];
      for (std::int64_t i = 0; i < n; ++i) {
        const double g = static_cast<double>(gn) * grad[i];
        g_mean[i] += g;
        gx_mean[i] += g * ((in[i] - mu[i]) * is[i]);
      }
    }
    std::array<float, kTokenChunk> a{}, b{};
    for (std::int64_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(g_mean[i] / static_cast<double>(d));
      b[i] = static_cast<float>(gx_mean[i] / static_cast<double>(d));
    }
    for (std::int64_t f = 0; f < d; ++f) {
      const float* in = x.row(f) + begin;
      const float* grad = dy.row(f) + begin;
      float* out = dx.row(f) + begin;
      const float gn = gain[static_cast<std::size_t>(f)];
      for (std::int64_t i = 0; i < n; ++i) {
        const float x_hat = (in[i] - mu[i]) * is[i];
        out[i] = is[i] * (gn * grad[i] - a[i] - x_hat * b[i]);
      }
    }
  });
}

}  // namespace sluice
