// The libtorch face of SparseLinear: the autograd function and the module. All
// torch-facing code of the library is in this one file (torch's headers are slow to
// compile).
#include "sluice/torch/sparse_linear.hpp"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>

#include "sluice/error.hpp"
#include "sluice/stream_packets.hpp"

namespace sluice::torch {
namespace {

using ::torch::Tensor;

std::string sizes_of(const Tensor& t) {
  std::string s = "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

/// One mutex per engine: products that share an engine take turns.
std::shared_ptr<std::mutex> mutex_for(const Engine* engine) {
  static std::mutex registry_mutex;
  static std::map<const Engine*, std::shared_ptr<std::mutex>> registry;
  std::lock_guard lock(registry_mutex);
  auto& m = registry[engine];
  if (!m) m = std::make_shared<std::mutex>();
  return m;
}

/// A [tokens, features] fp32 tensor whose transpose is contiguous in tokens, as the
/// engine's feature-major view (no copy); nullopt for any other.
std::optional<ConstMatrixView> feature_major_view(const Tensor& t) {
  if (t.scalar_type() != ::torch::kFloat || t.dim() != 2) return std::nullopt;
  const std::int64_t tokens = t.size(0), features = t.size(1);
  const bool unit_tokens = t.stride(0) == 1 || tokens == 1;
  if (!unit_tokens || t.stride(1) < tokens || t.storage_offset() < 0) return std::nullopt;
  return ConstMatrixView{t.data_ptr<float>(), features, tokens,
                         std::max<std::int64_t>(t.stride(1), 1)};
}

/// `t` [tokens, features] in feature-major fp32: `t` itself when it can be viewed so,
/// else one copy that transposes (and widens). Returned as [tokens, features], so that
/// feature_major_view() of it always succeeds.
Tensor feature_major(const Tensor& t) {
  if (feature_major_view(t)) return t;
  Tensor fm = ::torch::empty({t.size(1), t.size(0)}, t.options().dtype(::torch::kFloat));
  fm.copy_(t.t());
  return fm.t();
}

/// `grads` as they are, but each defined one differentiable into an error that says so.
::torch::autograd::variable_list once_differentiable(::torch::autograd::variable_list grads) {
  for (Tensor& g : grads) {
    if (g.defined()) g = g.detach().requires_grad_(true);
  }
  auto error = std::make_shared<::torch::autograd::DelayedError>(
      "sluice SparseLinear: its backward is not differentiable (no second derivative through "
      "the layer: a gradient taken with create_graph=True cannot be differentiated again)",
      static_cast<int>(grads.size()));
  return (*error)(std::move(grads));
}

MutableMatrixView mutable_view(Tensor& fm) {  // a contiguous [features, tokens] fp32 tensor
  return {fm.data_ptr<float>(), fm.size(0), fm.size(1), fm.size(1)};
}

/// The tensor's data as a span (`t` contiguous fp32, or undefined: empty).
std::span<const float> span_of(const Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  return {t.data_ptr<float>(), static_cast<std::size_t>(t.numel())};
}

Tensor fp32_contiguous(const Tensor& t) {
  if (t.numel() == 0) return Tensor();
  return t.defined() ? t.to(::torch::kFloat).contiguous() : t;
}

/// The weights a product reads, in fp32, and the options that point at them.
struct ProductWeights {
  Tensor values, bias;
  ProductOptions options;
};
ProductWeights product_weights(const sluice::SparseLinear& layer, c10::ScalarType dtype,
                               const Tensor& values, const Tensor& bias) {
  ProductWeights w{fp32_contiguous(values), fp32_contiguous(bias), {}};
  // bf16 tensors stream the weights in bf16, where a bf16 stream's tags address the layer's
  // inputs (the forward's stream runs by output); else in fp32, as the arithmetic is.
  const bool bf16 = dtype == ::torch::kBFloat16 &&
                    layer.in_features() <= static_cast<std::int64_t>(kMaxBf16Inputs);
  w.options.precision = bf16 ? Precision::bf16 : Precision::fp32;
  w.options.values = span_of(w.values);
  w.options.bias = span_of(w.bias);
  return w;
}

Tensor tensor_of(std::vector<float> v) {
  auto* owned = new std::vector<float>(std::move(v));
  return ::torch::from_blob(
      owned->data(), {static_cast<std::int64_t>(owned->size())}, [owned](void*) { delete owned; },
      ::torch::kFloat);
}

/// float64: W x + b computed densely, in float64 (a reference for gradient checks).
Tensor reference_forward(LayerBinding& b, const Tensor& x2, const Tensor& values,
                         const Tensor& bias) {
  const bool own = b.owner() == WeightOwner::sluice;
  const Tensor w = b.dense(own ? b.values() : values).to(::torch::kDouble);
  Tensor y = ::torch::matmul(x2, w.t());
  const Tensor bb = own ? b.bias() : bias;
  if (bb.defined() && bb.numel() > 0) y = y + bb.to(::torch::kDouble);
  return y;
}

void check_input(const LayerBinding& b, const Tensor& x) {
  const auto& layer = b.layer();
  if (x.dim() < 1 || x.size(-1) != layer.in_features()) {
    throw ShapeError("sluice SparseLinear: input of size " + sizes_of(x) + ", expected [..., " +
                     std::to_string(layer.in_features()) + "]");
  }
  const auto dtype = x.scalar_type();
  if (dtype != ::torch::kFloat && dtype != ::torch::kBFloat16 && dtype != ::torch::kDouble) {
    throw UnsupportedError(std::string("sluice SparseLinear: input of dtype ") +
                           c10::toString(dtype) +
                           "; float32, bfloat16 or float64 (reference) only");
  }
  if (!x.device().is_cpu()) throw UnsupportedError("sluice SparseLinear: input not on the CPU");
}

void check_weights_device(const Tensor& values, const Tensor& bias) {
  for (const auto& [t, name] : {std::pair{&values, "values"}, std::pair{&bias, "bias"}}) {
    if (t->defined() && !t->device().is_cpu()) {
      throw UnsupportedError(std::string("sluice SparseLinear: ") + name + " on " +
                             t->device().str() + ", not the CPU");
    }
  }
}

std::vector<std::int64_t> with_last(const Tensor& x, std::int64_t last) {
  std::vector<std::int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = last;
  return sizes;
}

}  // namespace

LayerBinding::LayerBinding(sluice::SparseLinear layer, std::shared_ptr<Engine> engine,
                           WeightOwner owner)
    : layer_(std::move(layer)), engine_(std::move(engine)), owner_(owner) {}

LayerBinding::EngineTurn LayerBinding::take_engine() const {
  std::shared_ptr<Engine> engine = engine_ ? engine_ : default_engine();
  std::unique_lock lock(*mutex_for(engine.get()));
  return {std::move(engine), std::move(lock)};
}

Tensor LayerBinding::values() const {
  return tensor_of(layer_.weights().values());
}

Tensor LayerBinding::bias() const {
  return layer_.bias().empty() ? Tensor() : tensor_of(layer_.bias());
}

Tensor LayerBinding::mask() const {
  return dense(::torch::ones({layer_.nnz()}, ::torch::kFloat)).to(::torch::kBool);
}

Tensor LayerBinding::mask_indices() const {
  const CsrMatrix& w = layer_.weights();
  Tensor flat = ::torch::empty({w.nnz()}, ::torch::kLong);
  auto* at = flat.data_ptr<std::int64_t>();
  for (std::int64_t r = 0; r < w.rows(); ++r) {
    for (std::int64_t k = w.row_offsets()[r]; k < w.row_offsets()[r + 1]; ++k) {
      at[k] = r * w.cols() + w.col_indices()[k];
    }
  }
  return flat;
}

Tensor LayerBinding::dense(const Tensor& values) const {
  const CsrMatrix& w = layer_.weights();
  if (values.dim() != 1 || values.size(0) != w.nnz()) {
    throw ShapeError("sluice SparseLinear: values of size " + sizes_of(values) + " for a mask of " +
                     std::to_string(w.nnz()));
  }
  Tensor out = ::torch::zeros({w.rows() * w.cols()}, values.options());
  out.index_put_({mask_indices()}, values.detach());
  return out.view({w.rows(), w.cols()});
}

std::int32_t default_engine_threads() {
  // torch's default counts physical cores (on some virtual machines, as one) where
  // sluice's engine counts every CPU: a count equal to it was not asked for.
  static const bool environment_asks = [] {
    for (const char* name : {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}) {
      if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return true;
    }
    return false;
  }();
  static const int torch_default = at::intraop_default_num_threads();
  const int threads = at::get_num_threads();
  return environment_asks || threads != torch_default ? std::max(1, threads) : 0;
}

std::shared_ptr<Engine> default_engine() {
  static std::mutex mutex;
  static std::map<std::int32_t, std::shared_ptr<Engine>> engines;
  const std::int32_t threads = default_engine_threads();
  std::lock_guard lock(mutex);
  std::shared_ptr<Engine>& engine = engines[threads];
  if (!engine) {
    EngineOptions options;
    options.threads = threads;
    engine = std::make_shared<CpuEngine>(options);
  }
  return engine;
}

Tensor SparseLinearFunction::forward(::torch::autograd::AutogradContext* ctx, const Tensor& x,
                                     const Tensor& values, const Tensor& bias,
                                     const c10::intrusive_ptr<LayerBinding>& binding) {
  LayerBinding& b = *binding;
  check_input(b, x);
  check_weights_device(values, bias);
  const sluice::SparseLinear& layer = b.layer();
  const Tensor x2 = x.reshape({-1, layer.in_features()});
  const auto dtype = x.scalar_type();
  Tensor saved_x, y2;
  if (dtype == ::torch::kDouble) {
    saved_x = x2;
    y2 = reference_forward(b, x2, values, bias);
  } else {
    saved_x = feature_major(x2);
    const ProductWeights w = product_weights(layer, dtype, values, bias);
    Tensor y_fm =
        ::torch::empty({layer.out_features(), x2.size(0)}, x.options().dtype(::torch::kFloat));
    {
      const LayerBinding::EngineTurn turn = b.take_engine();
      layer.forward(*turn.engine, *feature_major_view(saved_x), mutable_view(y_fm), w.options);
    }
    y2 = y_fm.t();
    if (dtype != ::torch::kFloat) y2 = y2.to(dtype);
  }
  ctx->save_for_backward({saved_x, values, bias});
  ctx->saved_data["binding"] = c10::IValue::make_capsule(binding);
  ctx->saved_data["shape"] = x.sizes().vec();
  ctx->saved_data["dtype"] = static_cast<std::int64_t>(dtype);
  return y2.reshape(with_last(x, layer.out_features()));
}

::torch::autograd::variable_list SparseLinearFunction::backward(
    ::torch::autograd::AutogradContext* ctx, ::torch::autograd::variable_list grads) {
  auto binding =
      c10::static_intrusive_pointer_cast<LayerBinding>(ctx->saved_data["binding"].toCapsule());
  LayerBinding& b = *binding;
  const sluice::SparseLinear& layer = b.layer();
  const ::torch::autograd::variable_list saved = ctx->get_saved_variables();
  const Tensor& values = saved[1];
  const Tensor& bias = saved[2];
  const auto shape = ctx->saved_data["shape"].toIntVector();
  const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
  const Tensor x_fm = feature_major(saved[0]);
  const Tensor dy_fm = feature_major(grads[0].reshape({-1, layer.out_features()}));
  const std::int64_t tokens = x_fm.size(0);

  const bool want_dx = ctx->needs_input_grad(0);
  // The weights' gradient only where autograd asks for it: a frozen layer, or a gradient
  // with respect to the input alone (autograd.grad(y, x), backward(inputs=...)), takes dX
  // alone, and a sluice-owned layer (the stand-in at 1) then hands its ModelMemory nothing.
  const bool own = b.owner() == WeightOwner::sluice;
  const bool want_values = ctx->needs_input_grad(1);
  const bool want_bias = !own && ctx->needs_input_grad(2);
  Tensor dx_fm;
  MutableMatrixView dx_view;
  if (want_dx) {
    dx_fm = ::torch::empty({layer.in_features(), tokens}, x_fm.options());
    dx_view = mutable_view(dx_fm);
  }
  const ProductWeights w = product_weights(layer, dtype, values, bias);
  const ProductOptions& options = w.options;
  Tensor d_values, d_bias;
  {
    const LayerBinding::EngineTurn turn = b.take_engine();
    Engine& engine = *turn.engine;
    if (!want_values && !want_bias) {
      if (want_dx) layer.backward_data(engine, *feature_major_view(dy_fm), dx_view, options);
    } else if (own) {
      layer.accumulate_backward(engine, *feature_major_view(x_fm), *feature_major_view(dy_fm),
                                want_dx ? &dx_view : nullptr, options);
    } else {
      SparseLinearGradient g =
          layer.backward(engine, *feature_major_view(x_fm), *feature_major_view(dy_fm),
                         want_dx ? &dx_view : nullptr, options);
      // (an empty layer's too: its values' .grad is empty, as an empty parameter's is)
      if (want_values) d_values = tensor_of(std::move(g.weights)).to(values.scalar_type());
      if (want_bias && bias.numel() > 0)
        d_bias = tensor_of(std::move(g.bias)).to(bias.scalar_type());
    }
  }
  Tensor dx;
  if (want_dx) {
    dx = dx_fm.t();
    if (dtype != ::torch::kFloat) dx = dx.to(dtype);
    dx = dx.reshape(shape);
  }
  ::torch::autograd::variable_list out{dx, d_values, d_bias, Tensor()};
  // With create_graph a second derivative would take these as constants (the engine's
  // products are not differentiable) and leave the layer's terms out without a word: as
  // Python's @once_differentiable, they raise when differentiated instead.
  if (::torch::GradMode::is_enabled()) out = once_differentiable(std::move(out));
  return out;
}

SparseLinearOptions::SparseLinearOptions(std::int64_t in_features, std::int64_t out_features)
    : in_features_(in_features), out_features_(out_features) {}

std::shared_ptr<ModelMemory> memory_for(SparseLinearOptions& options) {
  if (!options.memory()) {
    auto memory = std::make_shared<HostModelMemory>();
    memory->set_optimizer(options.optimizer());
    options.memory(memory);
  }
  return options.memory();
}

namespace {

sluice::SparseLinear random_layer(SparseLinearOptions& options) {
  const std::int64_t in = options.in_features(), out = options.out_features();
  if (in <= 0 || out <= 0) {
    throw ShapeError("sluice SparseLinear: " + std::to_string(in) + " inputs and " +
                     std::to_string(out) + " outputs");
  }
  if (!(options.sparsity() >= 0.0 && options.sparsity() < 1.0)) {
    throw ArgumentError("sluice SparseLinear: sparsity " + std::to_string(options.sparsity()) +
                        " is not in [0, 1)");
  }
  CsrMatrix w = CsrMatrix::random(out, in, options.sparsity(), options.seed());
  // As torch::nn::Linear (uniform in +-1/sqrt(fan-in)), over the inputs a row keeps.
  const double kept = std::max(1.0, static_cast<double>(in) * (1.0 - options.sparsity()));
  w.fill_values(options.seed() + 1, static_cast<float>(1.0 / std::sqrt(kept)));
  std::vector<float> bias;
  if (options.bias()) {
    std::mt19937_64 rng(options.seed() + 2);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    std::uniform_real_distribution<double> u(-bound, bound);
    for (std::int64_t o = 0; o < out; ++o) bias.push_back(static_cast<float>(u(rng)));
  }
  return {memory_for(options), std::move(w), std::move(bias)};
}

/// A 2-D fp32 contiguous copy of `t` and its view.
struct Matrix2d {
  Tensor data;
  ConstMatrixView view;
};
Matrix2d matrix_of(const Tensor& t, const char* what) {
  if (t.dim() != 2)
    throw ShapeError(std::string("sluice SparseLinear: ") + what + " of size " + sizes_of(t));
  Tensor c = t.detach().to(::torch::kFloat).contiguous();
  return {c, {c.data_ptr<float>(), c.size(0), c.size(1), c.size(1)}};
}

std::vector<float> vector_of(const Tensor& t) {
  if (!t.defined()) return {};
  const Tensor c = t.detach().to(::torch::kFloat).contiguous();
  return {c.data_ptr<float>(), c.data_ptr<float>() + c.numel()};
}

}  // namespace

SparseLinearImpl::SparseLinearImpl(const SparseLinearOptions& options)
    : options_(options), own_memory_(!options.memory()) {
  init(random_layer(options_));
}

SparseLinearImpl::SparseLinearImpl(const Tensor& weight, const Tensor& mask, const Tensor& bias,
                                   SparseLinearOptions options)
    : options_(std::move(options)), own_memory_(!options_.memory()) {
  const Matrix2d w = matrix_of(weight, "weight"), m = matrix_of(mask, "mask");
  init(sluice::SparseLinear::from_dense(memory_for(options_), w.view, m.view, vector_of(bias)));
}

SparseLinearImpl::SparseLinearImpl(SparseLinearOptions options, sluice::SparseLinear layer)
    : options_(std::move(options)) {
  init(std::move(layer));
}

std::shared_ptr<SparseLinearImpl> SparseLinearImpl::pruned(const ::torch::nn::Linear& dense,
                                                           double sparsity,
                                                           SparseLinearOptions options) {
  const Matrix2d w = matrix_of(dense->weight, "weight");
  const bool own_memory = !options.memory();
  sluice::SparseLinear layer =
      sluice::SparseLinear::pruned(memory_for(options), w.view, sparsity, vector_of(dense->bias));
  auto module = std::make_shared<SparseLinearImpl>(std::move(options), std::move(layer));
  module->own_memory_ = own_memory;
  return module;
}

void SparseLinearImpl::init(sluice::SparseLinear layer) {
  options_.in_features(layer.in_features())
      .out_features(layer.out_features())
      .bias(!layer.bias().empty())
      .sparsity(layer.weights().sparsity());
  binding_ =
      c10::make_intrusive<LayerBinding>(std::move(layer), options_.engine(), options_.weights());
  if (options_.weights() == WeightOwner::torch) {
    values_ = register_parameter("values", binding_->values());
    if (options_.bias()) bias_ = register_parameter("bias", binding_->bias());
  } else {
    // No parameters: an empty tensor that wants a gradient stands in for the values, so
    // that autograd runs the backward (which submits the gradient) whatever X is.
    values_ = ::torch::empty({0}).requires_grad_(true);
  }
}

Tensor sparse_linear(const Tensor& x, const Tensor& values, const Tensor& bias,
                     const c10::intrusive_ptr<LayerBinding>& binding) {
  // As autocast's lower-precision ops cast: fp32 alone (float64 is a reference), and
  // before the function, so that the cast's own backward returns X's gradient in fp32.
  const bool to_bf16 = at::autocast::is_cpu_enabled() &&
                       at::autocast::get_autocast_cpu_dtype() == ::torch::kBFloat16 &&
                       x.scalar_type() == ::torch::kFloat;
  return SparseLinearFunction::apply(to_bf16 ? x.to(::torch::kBFloat16) : x, values, bias, binding);
}

Tensor SparseLinearImpl::forward(const Tensor& x) {
  return sparse_linear(x, values_, bias_.defined() ? bias_ : no_bias_, binding_);
}

StepReport SparseLinearImpl::step() {
  if (options_.weights() != WeightOwner::sluice) {
    throw Error("sluice SparseLinear: its weights are torch parameters; step a torch optimizer");
  }
  return binding_->layer().step();
}

void SparseLinearImpl::zero_grad(bool set_to_none) {
  ::torch::nn::Module::zero_grad(set_to_none);
  if (options_.weights() == WeightOwner::sluice) binding_->layer().discard_gradient();
}

Tensor SparseLinearImpl::values() const {
  return options_.weights() == WeightOwner::torch ? values_ : binding_->values();
}

Tensor SparseLinearImpl::bias() const {
  return options_.weights() == WeightOwner::torch ? bias_ : binding_->bias();
}

Tensor SparseLinearImpl::dense_weight() const {
  return binding_->dense(values().detach().to(::torch::kFloat));
}

Tensor SparseLinearImpl::mask() const {
  return binding_->mask();
}

void SparseLinearImpl::save(::torch::serialize::OutputArchive& archive) const {
  archive.write("mask_indices", binding_->mask_indices(), /*is_buffer=*/true);
  archive.write("values", values().detach());
  if (options_.bias()) archive.write("bias", bias().detach());
}

namespace {

/// A saved mask's flat positions, checked: int64, one per value, increasing, in the layer.
Tensor checked_mask_indices(const Tensor& indices, std::int64_t values, std::int64_t positions) {
  const std::string what = "sluice SparseLinear: the archive's mask_indices ";
  if (indices.scalar_type() != ::torch::kLong || indices.dim() != 1) {
    throw ShapeError(what + "are not a 1-D int64 tensor");
  }
  if (indices.size(0) != values) {
    throw ShapeError(what + "hold " + std::to_string(indices.size(0)) + " positions for " +
                     std::to_string(values) + " values");
  }
  const Tensor c = indices.contiguous();
  const auto* at = c.data_ptr<std::int64_t>();
  for (std::int64_t k = 0; k < values; ++k) {
    if (at[k] < 0 || at[k] >= positions || (k > 0 && at[k] <= at[k - 1])) {
      throw ShapeError(what + "are not increasing positions below " + std::to_string(positions) +
                       " (at " + std::to_string(k) + ": " + std::to_string(at[k]) + ")");
    }
  }
  return c;
}

}  // namespace

CsrMatrix matrix_at(std::int64_t out, std::int64_t in, const Tensor& indices,
                    const Tensor& values) {
  if (values.dim() != 1) {
    throw ShapeError("sluice SparseLinear: the archive's values " + sizes_of(values) +
                     " are not one per mask position");
  }
  const Tensor checked = checked_mask_indices(indices, values.size(0), out * in);
  const auto* at = checked.data_ptr<std::int64_t>();
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(out) + 1, 0);
  std::vector<std::uint32_t> cols(static_cast<std::size_t>(values.size(0)));
  for (std::size_t k = 0; k < cols.size(); ++k) {
    offsets[static_cast<std::size_t>(at[k] / in) + 1] += 1;
    cols[k] = static_cast<std::uint32_t>(at[k] % in);
  }
  for (std::size_t r = 0; r < static_cast<std::size_t>(out); ++r) offsets[r + 1] += offsets[r];
  return {out, in, std::move(offsets), std::move(cols), vector_of(values)};
}

void SparseLinearImpl::load(::torch::serialize::InputArchive& archive) {
  if (options_.weights() == WeightOwner::sluice) {
    throw UnsupportedError(
        "sluice SparseLinear: a layer whose weights are sluice's is loaded with its ModelMemory "
        "(ModelMemory::load, which keeps the optimizer's state too)");
  }
  const std::int64_t in = options_.in_features(), out = options_.out_features();
  Tensor values, bias, indices;
  archive.read("values", values);
  if (archive.try_read("bias", bias) != options_.bias()) {
    throw ShapeError(std::string("sluice SparseLinear: the archive has ") +
                     (options_.bias() ? "no bias" : "a bias") + ", the layer " +
                     (options_.bias() ? "has one" : "none"));
  }
  if (values.dim() != 1 || (bias.defined() && (bias.dim() != 1 || bias.size(0) != out))) {
    throw ShapeError("sluice SparseLinear: the archive's values " + sizes_of(values) +
                     (bias.defined() ? " and bias " + sizes_of(bias) : std::string()) +
                     " do not fit a layer of " + std::to_string(out) + " outputs");
  }
  // An archive from before the mask was saved: its values are for this layer's mask.
  const bool with_mask = archive.try_read("mask_indices", indices, /*is_buffer=*/true);
  if (with_mask) indices = checked_mask_indices(indices, values.size(0), in * out);
  if (with_mask && !indices.equal(binding_->mask_indices())) {
    if (!own_memory_) {
      throw UnsupportedError(
          "sluice SparseLinear: the archive's mask differs from the layer's, whose ModelMemory "
          "other layers share: build the layer with that mask (or load the ModelMemory)");
    }
    SparseLinearOptions options = options_;
    options.memory(nullptr).optimizer(binding_->layer().memory().optimizer());
    sluice::SparseLinear layer(memory_for(options), matrix_at(out, in, indices, values),
                               vector_of(bias));
    options_ = options;
    binding_ =
        c10::make_intrusive<LayerBinding>(std::move(layer), options_.engine(), options_.weights());
    options_.sparsity(binding_->layer().weights().sparsity());
    ::torch::NoGradGuard no_grad;
    values_.set_data(::torch::empty({values.size(0)}, ::torch::kFloat));
    values_.mutable_grad() = Tensor();  // the old mask's: it fits no position of the new
  }
  if (values.size(0) != binding_->layer().nnz()) {
    throw ShapeError("sluice SparseLinear: the archive's " + std::to_string(values.size(0)) +
                     " values do not fit the layer's mask of " +
                     std::to_string(binding_->layer().nnz()));
  }
  ::torch::NoGradGuard no_grad;
  values_.copy_(values);
  if (bias.defined()) bias_.copy_(bias);
}

void SparseLinearImpl::reset() {
  // clone() calls this on a copy of the module, which still holds this layer's binding,
  // its parameters cleared. The weights are the parameters where torch owns them (the
  // ModelMemory's copy is the one the layer was built with).
  if (!parameters_.is_empty()) {
    throw UnsupportedError(
        "sluice SparseLinear: reset() rebuilds the layer of a copy that clone() makes; this "
        "module's parameters are registered already");
  }
  const sluice::SparseLinear& original = binding_->layer();
  CsrMatrix weights = original.weights();
  std::vector<float> bias = original.bias();
  if (options_.weights() == WeightOwner::torch) {
    weights.values() = vector_of(values_);
    bias = vector_of(bias_);
  }
  SparseLinearOptions options = options_;
  options.memory(nullptr).optimizer(original.memory().optimizer());
  sluice::SparseLinear layer(memory_for(options), std::move(weights), std::move(bias));
  options_ = std::move(options);
  own_memory_ = true;
  init(std::move(layer));
}

}  // namespace sluice::torch
