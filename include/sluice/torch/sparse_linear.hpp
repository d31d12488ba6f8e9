#pragma once
// sluice's sparse layer inside libtorch: `sluice::torch::SparseLinear`, a module a libtorch
// trainer drops in for torch::nn::Linear, and the autograd function under it.
//
// Tensors are [tokens, features] as for torch::nn::Linear (any leading dimensions), fp32
// or bf16 (the weights are then streamed in bf16; activations are computed in fp32).
// float64 tensors run a float64 reference forward (dense, for checking gradients against
// finite differences); their backward runs on the engine in fp32. Under CPU autocast to
// bf16, fp32 inputs are taken in bf16, as torch::nn::Linear's are.
//
// Layout: the engine reads and writes feature rows of contiguous tokens. A result is
// returned as the transpose of a feature-major tensor (a strided view, no copy), and an
// input given so — another SparseLinear's output, through elementwise functions — is read
// in place. A contiguous [tokens, features] input is transposed once (and kept for the
// backward pass).
//
// Weights: by default the values (one per mask position, in the order of
// `sluice::SparseLinear::weights()`) and the bias are torch parameters, for any torch
// optimizer. With WeightOwner::sluice they stay in the ModelMemory, whose optimizer
// updates them: backward() hands it the gradient (backward passes before a step add up,
// as `.grad` does) and step() applies it.
//
// Threads: as many as torch's own products use where a count was asked for
// (torch::set_num_threads), else every CPU (default_engine_threads), unless an engine is
// given. Thread-safety: a module runs one product at a time on its engine (calls that
// share an engine are serialised); as for torch::nn modules, do not change it while it runs.
#include <torch/arg.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <memory>
#include <mutex>

#include "sluice/engine.hpp"
#include "sluice/model_memory.hpp"
#include "sluice/optimizer.hpp"
#include "sluice/sparse_linear.hpp"

namespace sluice::torch {

/// Who keeps and updates the values and the bias.
enum class WeightOwner {
  torch,   ///< torch parameters: a torch optimizer updates them
  sluice,  ///< the ModelMemory: its optimizer updates them at step()
};

/// The core layer, its engine and who owns its weights: what the autograd function needs,
/// kept alive by the module and by every graph that used it.
class LayerBinding : public ::torch::CustomClassHolder {
 public:
  /// `engine` null: each product runs on default_engine() as it is then.
  LayerBinding(sluice::SparseLinear layer, std::shared_ptr<Engine> engine, WeightOwner owner);

  sluice::SparseLinear& layer() { return layer_; }
  const sluice::SparseLinear& layer() const { return layer_; }
  /// The engine given (null: the default engine of each product).
  const std::shared_ptr<Engine>& engine_shared() const { return engine_; }
  WeightOwner owner() const { return owner_; }

  /// The engine a product runs on now, held for it: an engine runs one product at a time,
  /// so products that share one take turns.
  struct EngineTurn {
    std::shared_ptr<Engine> engine;
    std::unique_lock<std::mutex> lock;
  };
  EngineTurn take_engine() const;

  /// Copies of the ModelMemory's values and bias (undefined without one), fp32.
  ::torch::Tensor values() const;
  ::torch::Tensor bias() const;
  /// The mask as a dense [out, in] bool tensor; `values` (one per mask position) scattered
  /// into a dense [out, in] tensor of their dtype.
  ::torch::Tensor mask() const;
  ::torch::Tensor dense(const ::torch::Tensor& values) const;
  /// The mask as the flat positions (row * in_features + column, int64) of its values, in
  /// their order: what a saved layer records of its mask.
  ::torch::Tensor mask_indices() const;

 private:
  sluice::SparseLinear layer_;
  std::shared_ptr<Engine> engine_;
  WeightOwner owner_;
};

/// The out x in matrix with `values` at the flat positions `indices` (row * in + column,
/// int64, increasing): what a saved layer's mask and values make. ShapeError naming what
/// is wrong with them.
CsrMatrix matrix_at(std::int64_t out, std::int64_t in, const ::torch::Tensor& indices,
                    const ::torch::Tensor& values);

/// The threads of default_engine() now: as many as torch's intra-op pool has where a count
/// was asked for (torch::set_num_threads, torch.set_num_threads, OMP_NUM_THREADS or
/// MKL_NUM_THREADS), else 0, every CPU of the process (torch's own default counts physical
/// cores; a count equal to it is taken as not asked for).
std::int32_t default_engine_threads();
/// The CpuEngine of default_engine_threads(), one per count, made on first use and kept.
std::shared_ptr<Engine> default_engine();

/// Y = X W^T + b through the layer. `values` and `bias` are the torch parameters
/// (WeightOwner::torch; `bias` empty for none: libtorch 1.13's Function takes no
/// undefined tensors). WeightOwner::sluice: `values` is an empty tensor that requires
/// grad (so that autograd calls backward, which adds the gradient to what the
/// ModelMemory holds for the step), `bias` empty.
struct SparseLinearFunction : public ::torch::autograd::Function<SparseLinearFunction> {
  static ::torch::Tensor forward(::torch::autograd::AutogradContext* ctx, const ::torch::Tensor& x,
                                 const ::torch::Tensor& values, const ::torch::Tensor& bias,
                                 const c10::intrusive_ptr<LayerBinding>& binding);
  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads);
};

/// Y = X W^T + b through `binding`, as SparseLinear's forward is (what
/// torch::nn::functional::linear is to Linear; the arguments as SparseLinearFunction's).
/// Under CPU autocast to bf16 (torch.autocast("cpu"), at::autocast::set_cpu_enabled) an
/// fp32 input is taken in bf16, as torch::nn::Linear's is: the weights stream in bf16 and Y
/// is bf16; X's gradient comes back in fp32.
::torch::Tensor sparse_linear(const ::torch::Tensor& x, const ::torch::Tensor& values,
                              const ::torch::Tensor& bias,
                              const c10::intrusive_ptr<LayerBinding>& binding);

struct SparseLinearOptions {
  SparseLinearOptions(std::int64_t in_features, std::int64_t out_features);
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// Fraction of weights that are zero; the mask is drawn at random from `seed`.
  TORCH_ARG(double, sparsity) = 0.9;
  TORCH_ARG(std::uint64_t, seed) = 1;
  TORCH_ARG(WeightOwner, weights) = WeightOwner::torch;
  /// The ModelMemory's optimizer (WeightOwner::sluice), set on a ModelMemory of its own.
  TORCH_ARG(OptimizerConfig, optimizer) = {};
  /// Where the layer lives; null: a HostModelMemory of its own. A shared one lets many
  /// layers commit their steps at once (ModelMemory::commit_step).
  TORCH_ARG(std::shared_ptr<ModelMemory>, memory) = nullptr;
  /// The engine the products run on; null: default_engine() as each product finds it.
  TORCH_ARG(std::shared_ptr<Engine>, engine) = nullptr;
};

/// The ModelMemory a layer of these options lives in: options.memory(), or a new
/// HostModelMemory with options.optimizer() (then kept in the options).
std::shared_ptr<ModelMemory> memory_for(SparseLinearOptions& options);

class SparseLinearImpl : public ::torch::nn::Cloneable<SparseLinearImpl> {
 public:
  /// A random mask at options.sparsity(); values uniform in +-1/sqrt(fan-in kept) and the
  /// bias uniform in +-1/sqrt(in_features), drawn from options.seed().
  explicit SparseLinearImpl(const SparseLinearOptions& options);
  SparseLinearImpl(std::int64_t in_features, std::int64_t out_features)
      : SparseLinearImpl(SparseLinearOptions(in_features, out_features)) {}
  /// `weight` [out, in] where `mask` is non-zero; `bias` [out] or undefined. The sizes,
  /// sparsity and seed of `options` are taken from these.
  SparseLinearImpl(const ::torch::Tensor& weight, const ::torch::Tensor& mask,
                   const ::torch::Tensor& bias, SparseLinearOptions options);
  /// Magnitude pruning of a dense Linear: its largest (1 - sparsity) weights, and its bias.
  static std::shared_ptr<SparseLinearImpl> pruned(const ::torch::nn::Linear& dense, double sparsity,
                                                  SparseLinearOptions options);
  /// A layer already built (its ModelMemory is options.memory(), or a new one is made).
  SparseLinearImpl(SparseLinearOptions options, sluice::SparseLinear layer);

  ::torch::Tensor forward(const ::torch::Tensor& x);
  /// WeightOwner::sluice: commits the ModelMemory's step (every layer that submitted).
  StepReport step();
  /// Module::zero_grad (a module holding this one calls it too), and with WeightOwner::sluice
  /// drops the gradient the backward passes handed the ModelMemory since the last step.
  void zero_grad(bool set_to_none = false) override;

  /// The values, one per mask position (the parameter, or a copy of the ModelMemory's).
  ::torch::Tensor values() const;
  /// The bias (the parameter, or a copy of the ModelMemory's); undefined without one.
  ::torch::Tensor bias() const;
  /// W as a dense [out, in] fp32 tensor (zeros off the mask), and the mask as bool.
  ::torch::Tensor dense_weight() const;
  ::torch::Tensor mask() const;
  sluice::SparseLinear& layer() const { return binding_->layer(); }
  const c10::intrusive_ptr<LayerBinding>& binding() const { return binding_; }
  const SparseLinearOptions& options() const { return options_; }

  /// torch::save: the mask (its flat positions, "mask_indices"), the values and the bias,
  /// so that a layer loaded from it computes what this one does whatever mask it was built
  /// with (the mask is not a parameter, and a random one depends on the seed).
  void save(::torch::serialize::OutputArchive& archive) const override;
  /// torch::load: takes the archive's mask (the layer is rebuilt if it differs; nothing
  /// changes if the archive is refused), values and bias. ShapeError for an archive that
  /// does not fit the layer or whose mask is not valid. UnsupportedError for a layer whose
  /// weights are sluice's (load its ModelMemory, which keeps the optimizer's state too), and
  /// for a new mask in a ModelMemory the layer shares with others.
  void load(::torch::serialize::InputArchive& archive) override;

  /// torch::nn::Cloneable, for clone() (of this module or of one holding it): the layer
  /// rebuilt with its mask, current values and bias, engine and optimizer settings, in a
  /// ModelMemory of its own even where it shares one (a clone that joined it would step
  /// with the others). A sluice optimizer's state starts afresh, as a torch optimizer made
  /// for a cloned module would; torch-owned values and bias become new parameters.
  /// UnsupportedError on a module whose parameters are registered (not clone()'s copy).
  void reset() override;

 private:
  void init(sluice::SparseLinear layer);

  SparseLinearOptions options_;
  /// Whether the ModelMemory was made for this layer alone (options.memory() was null):
  /// a loaded mask then replaces it, else it would leave the old layer in a shared one.
  bool own_memory_ = false;
  c10::intrusive_ptr<LayerBinding> binding_;
  ::torch::Tensor values_;  // the parameter, or (WeightOwner::sluice) the empty stand-in
  ::torch::Tensor bias_;    // WeightOwner::torch only
  ::torch::Tensor no_bias_ = ::torch::empty({0});
};

/// The module holder, as TORCH_MODULE(SparseLinear) would declare it (spelled out: inside
/// sluice::torch the macro's unqualified `torch::` would name this namespace).
class SparseLinear : public ::torch::nn::ModuleHolder<SparseLinearImpl> {
 public:
  using ::torch::nn::ModuleHolder<SparseLinearImpl>::ModuleHolder;
  using Impl = SparseLinearImpl;
};

}  // namespace sluice::torch
