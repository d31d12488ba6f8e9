// The Python module's native part: the layer as a TorchScript custom class
// (torch.classes.sluice.Layer) and the op torch.ops.sluice.sparse_linear, whose autograd
// is SparseLinearFunction's. python/sluice_torch/__init__.py loads it with
// torch.ops.load_library; no pybind11 and no Python headers are needed.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <stdlib.h>  // mkdtemp

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/model_memory.hpp"
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

/// A private directory under the system's temporary one (TMPDIR), removed with what it
/// holds: ModelMemory saves and loads files, a state_dict holds bytes.
class ScratchDirectory {
 public:
  ScratchDirectory() {
    std::string name = (std::filesystem::temp_directory_path() / "sluice-state-XXXXXX").string();
    if (::mkdtemp(name.data()) == nullptr) {
      throw IoError("sluice_torch: cannot make a directory " + name + ": " + std::strerror(errno));
    }
    path_ = name;
  }
  ~ScratchDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  std::filesystem::path file() const { return path_ / "state"; }

 private:
  std::filesystem::path path_;
};

/// The layer's ModelMemory as the bytes of its checkpoint (ModelMemory::save): mask,
/// values, bias, the optimizer's settings and state, and the step.
Tensor optimizer_state(const c10::intrusive_ptr<LayerBinding>& self) {
  ScratchDirectory dir;
  self->layer().memory().save(dir.file());
  const auto size = static_cast<std::int64_t>(std::filesystem::file_size(dir.file()));
  Tensor state = ::torch::empty({size}, ::torch::kUInt8);
  std::ifstream in(dir.file(), std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(state.data_ptr<std::uint8_t>()), size)) {
    throw IoError("sluice_torch: cannot read back " + dir.file().string());
  }
  return state;
}

/// A layer whose weights are sluice's from optimizer_state()'s bytes, in a ModelMemory of
/// its own (FormatError for bytes that are not one layer's checkpoint).
c10::intrusive_ptr<LayerBinding> make_layer_from_state(const Tensor& state) {
  if (state.scalar_type() != ::torch::kUInt8 || state.dim() != 1) {
    throw FormatError("sluice_torch: optimizer_state must be a 1-D uint8 tensor");
  }
  const Tensor bytes = state.contiguous();
  ScratchDirectory dir;
  {
    std::ofstream out(dir.file(), std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>()), bytes.numel());
    if (!out.flush()) throw IoError("sluice_torch: cannot write " + dir.file().string());
  }
  auto memory = std::make_shared<HostModelMemory>();
  try {
    memory->load(dir.file());
  } catch (const FormatError& e) {
    // Named by what the caller holds, not the scratch file it went through.
    std::string what = e.what();
    const std::string file = dir.file().string() + ": ";
    if (const auto at = what.find(file); at != std::string::npos) what.erase(0, at + file.size());
    throw FormatError("sluice_torch: optimizer_state is not a layer's saved state: " + what);
  }
  if (memory->layer_count() != 1) {
    throw FormatError("sluice_torch: optimizer_state holds " +
                      std::to_string(memory->layer_count()) + " layers, not one");
  }
  sluice::SparseLinear layer(memory, 0);
  SparseLinearOptions options(layer.in_features(), layer.out_features());
  options.weights(WeightOwner::sluice).memory(memory);
  return SparseLinearImpl(options, std::move(layer)).binding();
}

Tensor sparse_linear_op(const Tensor& x, const c10::optional<Tensor>& values,
                        const c10::optional<Tensor>& bias,
                        const c10::intrusive_ptr<LayerBinding>& layer) {
  // libtorch 1.13's Function takes no undefined tensors: an empty one means none.
  const Tensor none = ::torch::empty({0});
  return sparse_linear(x, values.value_or(none), bias.value_or(none), layer);
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
           [](const c10::intrusive_ptr<LayerBinding>& self) { self->layer().discard_gradient(); })
      .def("optimizer_state", &sluice::torch::optimizer_state)
      .def("optimizer_settings",
           [](const c10::intrusive_ptr<LayerBinding>& self) {
             const sluice::OptimizerConfig& config = self->layer().memory().optimizer();
             return std::make_tuple(std::string(sluice::to_string(config.kind)),
                                    config.learning_rate, config.weight_decay);
           })
      .def("set_learning_rate", [](const c10::intrusive_ptr<LayerBinding>& self, double lr) {
        if (!(lr > 0) || !std::isfinite(lr)) {
          throw sluice::ArgumentError("sluice_torch: learning rate " + std::to_string(lr) +
                                      " is not a positive number");
        }
        sluice::ModelMemory& memory = self->layer().memory();
        sluice::OptimizerConfig config = memory.optimizer();
        config.learning_rate = lr;
        try {
          memory.set_optimizer(config);
        } catch (const sluice::ShapeError&) {  // a gradient waits for its step
          throw sluice::ShapeError(
              "sluice_torch: lr is set between steps: this layer holds the gradient of a "
              "backward pass that step() has not applied (set lr before the backward pass or "
              "after step(), or drop the gradient with zero_grad())");
        }
      });
  m.def("make_layer", &sluice::torch::make_layer);
  m.def("make_layer_from_state", &sluice::torch::make_layer_from_state);
  m.def("make_layer_at", &sluice::torch::make_layer_at);
  m.def("sparse_linear", &sluice::torch::sparse_linear_op);
}
