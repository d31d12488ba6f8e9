// The Python module's native part: the layer as a TorchScript custom class
// (torch.classes.sluice.Layer) and the op torch.ops.sluice.sparse_linear, whose autograd
// is SparseLinearFunction's. python/sluice_torch/__init__.py loads it with
// torch.ops.load_library; no pybind11 and no Python headers are needed.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/optimizer.hpp"
#include "sluice/torch/sparse_linear.hpp"

namespace sluice::torch {
namespace {

using ::torch::Tensor;

/// A layer's options: who owns its weights and the ModelMemory's optimizer ("sgd",
/// "adam", "adamw"), which runs when the weights are sluice's.
SparseLinearOptions options_for(std::int64_t in, std::int64_t out, bool sluice_owned,
                                const std::string& optimizer, double learning_rate,
                                double weight_decay) {
  SparseLinearOptions options(in, out);
  OptimizerConfig config;
  config.kind = parse_optimizer(optimizer);
  config.learning_rate = learning_rate;
  config.weight_decay = weight_decay;
  options.optimizer(config).weights(sluice_owned ? WeightOwner::sluice : WeightOwner::torch);
  return options;
}

/// A layer from a dense weight [out, in]: under `mask` if given, else pruned by magnitude
/// to `sparsity`. `optimizer` ("sgd", "adam", "adamw") runs in the ModelMemory when the
/// weights are sluice's; with `sluice_owned` false they are the caller's torch parameters.
c10::intrusive_ptr<LayerBinding> make_layer(const Tensor& weight, const c10::optional<Tensor>& mask,
                                            double sparsity, const c10::optional<Tensor>& bias,
                                            bool sluice_owned, const std::string& optimizer,
                                            double learning_rate, double weight_decay) {
  if (weight.dim() != 2) throw ShapeError("sluice_torch: weight must be [out, in]");
  SparseLinearOptions options = options_for(weight.size(1), weight.size(0), sluice_owned, optimizer,
                                            learning_rate, weight_decay);
  const Tensor b = bias.has_value() ? *bias : Tensor();
  ::torch::nn::Linear dense(
      ::torch::nn::LinearOptions(weight.size(1), weight.size(0)).bias(b.defined()));
  {
    ::torch::NoGradGuard no_grad;
    dense->weight.copy_(weight);
    if (b.defined()) dense->bias.copy_(b);
  }
  const auto module = mask.has_value()
                          ? std::make_shared<SparseLinearImpl>(weight, *mask, b, options)
                          : SparseLinearImpl::pruned(dense, sparsity, options);
  return module->binding();
}

/// A layer of out x in with `values` at the flat positions `indices` (matrix_at): a saved
/// or pickled layer's mask and values, as they were.
c10::intrusive_ptr<LayerBinding> make_layer_at(const Tensor& indices, const Tensor& values,
                                               std::int64_t in, std::int64_t out,
                                               const c10::optional<Tensor>& bias, bool sluice_owned,
                                               const std::string& optimizer, double learning_rate,
                                               double weight_decay) {
  SparseLinearOptions options =
      options_for(in, out, sluice_owned, optimizer, learning_rate, weight_decay);
  std::vector<float> b;
  if (bias.has_value()) {
    const Tensor c = bias->detach().to(::torch::kFloat).contiguous();
    b.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  sluice::SparseLinear layer(memory_for(options), matrix_at(out, in, indices, values),
                             std::move(b));
  return SparseLinearImpl(options, std::move(layer)).binding();
}

/// What pickling (copy.deepcopy, torch.save of a module, torch.jit.save) keeps of a layer:
/// its mask as flat positions, values, bias (empty for none), in and out features, whether
/// the weights are sluice's, and its ModelMemory's optimizer as make_layer takes it (kind,
/// learning rate, weight decay; its state is not kept, as in a state_dict). A layer whose
/// weights are torch parameters keeps no values: every product takes the parameters, which
/// the module pickles itself (the layer's own copy is only their first value).
using PickledLayer = std::tuple<Tensor, Tensor, Tensor, std::int64_t, std::int64_t, bool,
                                std::string, double, double>;

PickledLayer pickle_layer(const c10::intrusive_ptr<LayerBinding>& self) {
  const OptimizerConfig& config = self->layer().memory().optimizer();
  const Tensor bias = self->bias();
  const bool owned = self->owner() == WeightOwner::sluice;
  return {self->mask_indices(),
          owned ? self->values() : ::torch::empty({0}),
          bias.defined() ? bias : ::torch::empty({0}),
          self->layer().in_features(),
          self->layer().out_features(),
          owned,
          to_string(config.kind),
          config.learning_rate,
          config.weight_decay};
}

c10::intrusive_ptr<LayerBinding> unpickle_layer(PickledLayer state) {
  auto [indices, values, bias, in, out, owned, optimizer, learning_rate, weight_decay] =
      std::move(state);
  if (!owned && values.numel() == 0) values = ::torch::zeros({indices.numel()});
  return make_layer_at(indices, values, in, out,
                       bias.numel() > 0 ? c10::optional<Tensor>(bias) : c10::nullopt, owned,
                       optimizer, learning_rate, weight_decay);
}

Tensor sparse_linear(const Tensor& x, const c10::optional<Tensor>& values,
                     const c10::optional<Tensor>& bias,
                     const c10::intrusive_ptr<LayerBinding>& layer) {
  // libtorch 1.13's Function takes no undefined tensors: an empty one means none.
  const Tensor none = ::torch::empty({0});
  return SparseLinearFunction::apply(x, values.value_or(none), bias.value_or(none), layer);
}

}  // namespace
}  // namespace sluice::torch

TORCH_LIBRARY(sluice, m) {
  using sluice::torch::LayerBinding;
  m.class_<LayerBinding>("Layer")
      .def("values", &LayerBinding::values)
      .def("bias", &LayerBinding::bias)
      .def("mask", &LayerBinding::mask)
      .def("mask_indices", &LayerBinding::mask_indices)
      .def("dense", &LayerBinding::dense)
      .def("in_features",
           [](const c10::intrusive_ptr<LayerBinding>& self) { return self->layer().in_features(); })
      .def(
          "out_features",
          [](const c10::intrusive_ptr<LayerBinding>& self) { return self->layer().out_features(); })
      .def("nnz", [](const c10::intrusive_ptr<LayerBinding>& self) { return self->layer().nnz(); })
      .def("sluice_owned",
           [](const c10::intrusive_ptr<LayerBinding>& self) {
             return self->owner() == sluice::torch::WeightOwner::sluice;
           })
      .def_pickle(  // (lambdas: def_pickle takes no function pointers)
          [](const c10::intrusive_ptr<LayerBinding>& self) {
            return sluice::torch::pickle_layer(self);
          },
          [](sluice::torch::PickledLayer state) {
            return sluice::torch::unpickle_layer(std::move(state));
          })
      .def("step",
           [](const c10::intrusive_ptr<LayerBinding>& self) {
             if (self->owner() != sluice::torch::WeightOwner::sluice) {
               throw sluice::Error(
                   "sluice_torch: this layer's weights are torch parameters; step a torch "
                   "optimizer");
             }
             return self->layer().step().applied;
           })
      .def("discard_gradient",
           [](const c10::intrusive_ptr<LayerBinding>& self) { self->layer().discard_gradient(); });
  m.def("make_layer", &sluice::torch::make_layer);
  m.def("make_layer_at", &sluice::torch::make_layer_at);
  m.def("sparse_linear", &sluice::torch::sparse_linear);
}
