// The activation store: one engine's shard of a batch, kept for the whole step.
#include "sluice/activation_store.hpp"

#include <algorithm>
#include <string>

#include "core/enum_names.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

/// `from` copied into the first columns of `to`, which grows only where it is too small.
void copy_into(ConstMatrixView from, DenseMatrix& to) {
  if (to.rows() != from.rows || to.cols() < from.cols) to = DenseMatrix(from.rows, from.cols);
  for (std::int64_t r = 0; r < from.rows; ++r) {
    std::copy(from.row(r), from.row(r) + from.cols, to.row(r));
  }
}

/// The first `cols` columns of a buffer (none of an empty one): a shard's part of it.
MutableMatrixView first_columns(DenseMatrix& m, std::int64_t cols) {
  return {m.data(), m.rows(), m.rows() > 0 ? cols : 0, m.stride()};
}
ConstMatrixView first_columns(const DenseMatrix& m, std::int64_t cols) {
  return {m.data(), m.rows(), m.rows() > 0 ? cols : 0, m.stride()};
}

std::int64_t widest(const PassSpec& spec) {
  return *std::max_element(spec.sizes.begin() + 1, spec.sizes.end());
}

}  // namespace

constexpr detail::EnumName<Activation> kActivationNames[] = {
    {Activation::none, "none"}, {Activation::relu, "relu"}, {Activation::gelu, "gelu"}};

SLUICE_ENUM_TO_STRING(Activation, kActivationNames)

LossSums& LossSums::operator+=(const LossSums& o) {
  loss += o.loss;
  correct += o.correct;
  tokens += o.tokens;
  non_finite = non_finite || o.non_finite;
  return *this;
}

std::int64_t ActivationStore::bytes_for(const PassSpec& spec, std::int64_t tokens) {
  if (spec.sizes.size() < 2) return 0;
  const std::int64_t stride = (tokens + 15) / 16 * 16;
  std::int64_t total = 0;
  for (std::size_t l = 0; l + 1 < spec.sizes.size(); ++l) {
    const bool has_a = spec.activations[l] != Activation::none;
    total += spec.sizes[l + 1] * stride * (has_a ? 2 : 1);
  }
  if (spec.training) total += 2 * widest(spec) * stride;
  return total * static_cast<std::int64_t>(sizeof(float));
}

void ActivationStore::load(const PassSpec& spec, const ShardData& shard) {
  if (spec.sizes.size() < 2 || spec.activations.size() + 1 != spec.sizes.size()) {
    throw ShapeError("activation store: " + std::to_string(spec.sizes.size()) + " sizes and " +
                     std::to_string(spec.activations.size()) + " activations do not make layers");
  }
  if (shard.features.rows != spec.sizes.front()) {
    throw ShapeError("activation store: the model takes " + std::to_string(spec.sizes.front()) +
                     " features, the shard has " + std::to_string(shard.features.rows));
  }
  const std::int64_t tokens = shard.features.cols;
  if (!shard.labels.empty() && static_cast<std::int64_t>(shard.labels.size()) != tokens) {
    throw ShapeError("activation store: " + std::to_string(shard.labels.size()) + " labels for " +
                     std::to_string(tokens) + " tokens");
  }
  if (shard.targets &&
      (shard.targets->rows != spec.sizes.back() || shard.targets->cols != tokens)) {
    throw ShapeError("activation store: targets of " + std::to_string(shard.targets->rows) + "x" +
                     std::to_string(shard.targets->cols) + " for " +
                     std::to_string(spec.sizes.back()) + " outputs and " + std::to_string(tokens) +
                     " tokens");
  }
  // A narrower shard (an epoch's short last batch) takes the first columns of the buffers
  // it finds: allocating them again would fault every page in anew, twice an epoch.
  const bool same_layers = spec.sizes == spec_.sizes && spec.activations == spec_.activations;
  if (!same_layers || tokens > capacity_) {
    z_.clear();
    a_.clear();
    for (std::size_t l = 0; l + 1 < spec.sizes.size(); ++l) {
      z_.emplace_back(spec.sizes[l + 1], tokens);
      const bool has_a = spec.activations[l] != Activation::none;
      a_.emplace_back(has_a ? DenseMatrix(spec.sizes[l + 1], tokens) : DenseMatrix());
    }
    delta_ = DenseMatrix();
    delta_below_ = DenseMatrix();
    capacity_ = tokens;
  }
  if (spec.training && delta_.rows() == 0) {
    delta_ = DenseMatrix(widest(spec), capacity_);
    delta_below_ = DenseMatrix(widest(spec), capacity_);
  }
  spec_ = spec;
  tokens_ = tokens;
  copy_into(shard.features, input_);
  labels_.assign(shard.labels.begin(), shard.labels.end());
  has_targets_ = shard.targets.has_value();
  if (has_targets_) copy_into(*shard.targets, targets_);
}

std::size_t ActivationStore::index(std::int32_t layer) const {
  if (layer < 0 || layer >= layers()) {
    throw ArgumentError("activation store: layer " + std::to_string(layer) + " of " +
                        std::to_string(layers()));
  }
  return static_cast<std::size_t>(layer);
}

ConstMatrixView ActivationStore::in(std::int32_t layer) const {
  if (layer == 0) return first_columns(input_, tokens_);
  return out(layer - 1);
}

ConstMatrixView ActivationStore::out(std::int32_t layer) const {
  const std::size_t l = index(layer);
  return first_columns(a_[l].rows() > 0 ? a_[l] : z_[l], tokens_);
}

MutableMatrixView ActivationStore::z(std::int32_t layer) {
  return first_columns(z_[index(layer)], tokens_);
}

MutableMatrixView ActivationStore::a(std::int32_t layer) {
  return first_columns(a_[index(layer)], tokens_);
}

MutableMatrixView ActivationStore::delta(std::int64_t rows) {
  if (rows > delta_.rows()) throw ArgumentError("activation store: no delta (not a training pass)");
  return {delta_.data(), rows, tokens_, delta_.stride()};
}

MutableMatrixView ActivationStore::delta_below(std::int64_t rows) {
  if (rows > delta_below_.rows()) {
    throw ArgumentError("activation store: no delta (not a training pass)");
  }
  return {delta_below_.data(), rows, tokens_, delta_below_.stride()};
}

ConstMatrixView ActivationStore::last_delta(std::int64_t rows) const {
  if (rows > delta_below_.rows()) {
    throw ArgumentError("activation store: no delta (not a training pass)");
  }
  return {delta_below_.data(), rows, tokens_, delta_below_.stride()};
}

std::optional<ConstMatrixView> ActivationStore::targets() const {
  if (!has_targets_) return std::nullopt;
  return first_columns(targets_, tokens_);
}

}  // namespace sluice
