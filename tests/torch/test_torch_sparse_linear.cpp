// sluice::torch::SparseLinear inside libtorch: forward and both gradients against a
// masked dense torch::nn::Linear, fp32 and bf16 (and under autocast), every layout; threads
// as torch's; weights kept by sluice; magnitude pruning; saved and loaded with torch::save /
// torch::load, the mask with the values; cloned; and an MLP trained on digits against the
// same masked dense model.
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <sstream>

#include "sluice/dataset.hpp"
#include "sluice/error.hpp"
#include "sluice/topology.hpp"
#include "sluice/torch/sparse_linear.hpp"

namespace {

using sluice::torch::SparseLinear;
using sluice::torch::SparseLinearImpl;
using sluice::torch::SparseLinearOptions;
using sluice::torch::WeightOwner;
using torch::Tensor;

/// max |got - want| / max |want|: 1e-5 is fp32's rounding over sums of this length.
double relative(const Tensor& got, const Tensor& want) {
  const double scale = want.abs().max().item<double>();
  return (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>() /
         std::max(scale, 1e-30);
}

struct Reference {
  Tensor y, dx, dw, db;
};

/// The masked dense Linear's output and gradients for a loss sum(y * g).
Reference masked_dense(const Tensor& w, const Tensor& mask, const Tensor& b, const Tensor& x,
                       const Tensor& g) {
  Tensor wd = w.detach().clone().requires_grad_(true);
  Tensor bd = b.detach().clone().requires_grad_(true);
  Tensor xd = x.detach().clone().requires_grad_(true);
  Tensor y = torch::nn::functional::linear(xd, wd * mask, bd);
  (y * g).sum().backward();
  return {y.detach(), xd.grad(), wd.grad(), bd.grad()};
}

class TorchSparseLinear : public ::testing::TestWithParam<int> {};

// 0: token-major [tokens, in]; 1: feature-major (a transposed view); 2: [2, tokens/2, in].
TEST_P(TorchSparseLinear, MatchesMaskedDenseLinear) {
  torch::manual_seed(1);
  const std::int64_t in = 67, out = 45, tokens = 30;
  const Tensor w = torch::randn({out, in}), b = torch::randn({out});
  const Tensor mask = (torch::rand({out, in}) < 0.3).to(torch::kFloat);
  Tensor x = torch::randn({tokens, in});
  if (GetParam() == 1) x = torch::randn({in, tokens}).t();
  const Tensor g = torch::randn({tokens, out});
  const Reference ref = masked_dense(w, mask, b, x, g);

  SparseLinear layer(w, mask, b, SparseLinearOptions(in, out));
  Tensor xs = x.detach().clone().requires_grad_(true);
  if (GetParam() == 1) xs = x.detach().t().contiguous().t().requires_grad_(true);
  Tensor input = GetParam() == 2 ? xs.view({2, tokens / 2, in}) : xs;
  Tensor y = layer(input);
  ASSERT_EQ(y.sizes(), (GetParam() == 2 ? std::vector<std::int64_t>{2, tokens / 2, out}
                                        : std::vector<std::int64_t>{tokens, out}));
  (y * g.view(y.sizes())).sum().backward();
  EXPECT_LT(relative(y.reshape({tokens, out}), ref.y), 1e-5);
  EXPECT_LT(relative(xs.grad(), ref.dx), 1e-5);
  const Tensor dw = layer->layer().weights().nnz() > 0
                        ? layer->binding()->dense(layer->values().grad())
                        : Tensor();
  EXPECT_LT(relative(dw, ref.dw * mask), 1e-5);
  EXPECT_LT(relative(layer->bias().grad(), ref.db), 1e-5);
  EXPECT_TRUE(torch::equal(layer->mask(), mask.to(torch::kBool)));
}

INSTANTIATE_TEST_SUITE_P(Layouts, TorchSparseLinear, ::testing::Values(0, 1, 2));

TEST(TorchSparseLinearBf16, CloseToFp32) {
  torch::manual_seed(2);
  SparseLinear layer(SparseLinearOptions(96, 80).sparsity(0.8).seed(3));
  const Tensor x = torch::randn({40, 96});
  const Tensor want = layer(x).detach();
  Tensor xb = x.to(torch::kBFloat16).requires_grad_(true);
  Tensor y = layer(xb);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_LT(relative(y.to(torch::kFloat), want), 2e-2);
  y.sum().backward();
  EXPECT_EQ(xb.grad().scalar_type(), torch::kBFloat16);
  EXPECT_EQ(layer->values().grad().scalar_type(), torch::kFloat);
}

/// CPU autocast on (to its default, bf16) for a scope, as torch.autocast("cpu") sets it.
class CpuAutocast {
 public:
  CpuAutocast() : was_(at::autocast::is_cpu_enabled()) { at::autocast::set_cpu_enabled(true); }
  ~CpuAutocast() { at::autocast::set_cpu_enabled(was_); }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool was_;
};

// Under autocast an fp32 input is taken in bf16, as torch::nn::Linear's is: the same
// product as a bf16 input's, X's gradient back in fp32; float64 stays the reference.
TEST(TorchSparseLinearBf16, AutocastTakesFp32InputsInBf16) {
  torch::manual_seed(4);
  SparseLinear layer(SparseLinearOptions(37, 19).sparsity(0.7).seed(5));
  const Tensor x = torch::randn({5, 37});
  const Tensor xb = x.to(torch::kBFloat16).requires_grad_(true);
  const Tensor bf16_y = layer(xb);
  bf16_y.sum().backward();
  const Tensor xa = x.clone().requires_grad_(true);
  Tensor y, y64;
  {
    CpuAutocast autocast;
    ASSERT_EQ(at::autocast::get_autocast_cpu_dtype(), torch::kBFloat16);
    y = layer(xa);
    y64 = layer(x.to(torch::kDouble));
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(y, bf16_y));
  y.sum().backward();
  EXPECT_EQ(xa.grad().scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(xa.grad(), xb.grad().to(torch::kFloat)));
  EXPECT_EQ(y64.scalar_type(), torch::kDouble);
  EXPECT_EQ(layer(x).scalar_type(), torch::kFloat);  // and without it, fp32 again
}

// The products run on as many threads as torch's own where a count was asked for
// (torch::set_num_threads), else on every CPU; a layer made before the setting changed
// follows it: its next product runs on the engine of the new count.
TEST(TorchSparseLinearThreads, FollowTorchsIntraOpThreadsWhereAsked) {
  for (const char* name : {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}) {
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') GTEST_SKIP() << name;
  }
  const int before = torch::get_num_threads();
  const int torch_default = at::intraop_default_num_threads();
  torch::set_num_threads(torch_default);  // as if not asked: every CPU
  EXPECT_EQ(sluice::torch::default_engine_threads(), 0);
  EXPECT_EQ(sluice::torch::default_engine()->threads(), sluice::process_cpus());
  const int asked = torch_default == 1 ? 2 : 1;
  torch::set_num_threads(asked);
  EXPECT_EQ(sluice::torch::default_engine_threads(), asked);
  const std::shared_ptr<sluice::Engine> one = sluice::torch::default_engine();
  EXPECT_EQ(one->threads(), asked);
  SparseLinear layer(SparseLinearOptions(37, 19).sparsity(0.7));
  const Tensor x = torch::randn({5, 37});
  const std::uint64_t one_packets = one->counters().packets;
  const Tensor y1 = layer(x);
  EXPECT_GT(one->counters().packets, one_packets);
  torch::set_num_threads(torch_default);
  const std::shared_ptr<sluice::Engine> two = sluice::torch::default_engine();
  EXPECT_NE(two, one);
  const std::uint64_t packets[2] = {one->counters().packets, two->counters().packets};
  const Tensor y2 = layer(x);
  EXPECT_EQ(one->counters().packets, packets[0]);
  EXPECT_GT(two->counters().packets, packets[1]);
  EXPECT_LT(relative(y2, y1), 1e-6);
  torch::set_num_threads(before);
}

// A bf16 stream's tags address 65535 inputs: a wider layer takes bf16 tensors all the same,
// its weights streamed in fp32 (so exactly the fp32 product of the bf16-rounded X).
TEST(TorchSparseLinearBf16, AWiderLayerStreamsInFp32) {
  SparseLinear layer(SparseLinearOptions(70000, 3).sparsity(0.99).seed(6));
  const Tensor xb = torch::randn({4, 70000}).to(torch::kBFloat16).requires_grad_(true);
  const Tensor x = xb.detach().to(torch::kFloat).requires_grad_(true);
  const Tensor y = layer(xb);
  EXPECT_TRUE(torch::equal(y, layer(x).to(torch::kBFloat16)));
  y.to(torch::kFloat).sum().backward();
  layer(x).sum().backward();
  EXPECT_TRUE(torch::equal(xb.grad(), x.grad().to(torch::kBFloat16)));
}

// The engine's backward is not differentiable: a gradient taken with create_graph is the
// same, and differentiating it again raises (as Python's @once_differentiable) instead of
// leaving the layer's terms out of the second derivative.
TEST(TorchSparseLinearSecondDerivative, IsRefused) {
  SparseLinear layer(SparseLinearOptions(12, 7).sparsity(0.5).seed(5));
  const Tensor x = torch::randn({4, 12}).requires_grad_(true);
  const Tensor g = torch::autograd::grad({torch::tanh(layer(x)).sum()}, {x}, {},
                                         /*retain_graph=*/true, /*create_graph=*/true)[0];
  const Tensor g0 = torch::autograd::grad({torch::tanh(layer(x)).sum()}, {x})[0];
  EXPECT_TRUE(torch::equal(g.detach(), g0));
  try {
    g.square().sum().backward();
    ADD_FAILURE() << "a second derivative through the layer was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("its backward is not differentiable"), std::string::npos)
        << e.what();
  }
}

TEST(TorchSparseLinearSluiceOwned, StepAppliesTheGradient) {
  torch::manual_seed(4);
  const Tensor w = torch::randn({20, 30}), b = torch::randn({20});
  const Tensor mask = (torch::rand({20, 30}) < 0.5).to(torch::kFloat);
  sluice::OptimizerConfig sgd;
  sgd.kind = sluice::OptimizerKind::sgd;
  sgd.learning_rate = 0.1;
  SparseLinear owned(w, mask, b,
                     SparseLinearOptions(30, 20).weights(WeightOwner::sluice).optimizer(sgd));
  SparseLinear twin(w, mask, b, SparseLinearOptions(30, 20));
  EXPECT_TRUE(owned->parameters().empty());
  const Tensor x = torch::randn({9, 30});
  owned(x).square().sum().backward();
  twin(x).square().sum().backward();
  EXPECT_TRUE(owned->step().applied);
  EXPECT_LT(relative(owned->values(), twin->values().detach() - 0.1 * twin->values().grad()), 1e-5);
  EXPECT_LT(relative(owned->bias(), twin->bias().detach() - 0.1 * twin->bias().grad()), 1e-5);
  EXPECT_THROW(twin->step(), sluice::Error);
}

// Gradient accumulation: the backward passes before a step add up, as a torch-held twin's
// .grad does, and the step applies the sum; the next step starts from nothing.
TEST(TorchSparseLinearSluiceOwned, BackwardPassesBeforeAStepAddUp) {
  torch::manual_seed(9);
  const Tensor w = torch::randn({13, 22}), b = torch::randn({13});
  const Tensor mask = (torch::rand({13, 22}) < 0.4).to(torch::kFloat);
  sluice::OptimizerConfig sgd;
  sgd.kind = sluice::OptimizerKind::sgd;
  sgd.learning_rate = 0.05;
  SparseLinear owned(w, mask, b,
                     SparseLinearOptions(22, 13).weights(WeightOwner::sluice).optimizer(sgd));
  SparseLinear twin(w, mask, b, SparseLinearOptions(22, 13));
  for (int step = 0; step < 2; ++step) {
    for (int micro = 0; micro < 3 - step; ++micro) {
      const Tensor x = torch::randn({5 + micro, 22});
      owned(x).square().sum().backward();
      twin(x).square().sum().backward();
    }
    EXPECT_TRUE(owned->step().applied);
    const Tensor want_values = twin->values().detach() - 0.05 * twin->values().grad();
    const Tensor want_bias = twin->bias().detach() - 0.05 * twin->bias().grad();
    EXPECT_LT(relative(owned->values(), want_values), 1e-5) << "step " << step;
    EXPECT_LT(relative(owned->bias(), want_bias), 1e-5) << "step " << step;
    // The twin follows: its values become the owned layer's, its .grad starts again.
    torch::NoGradGuard no_grad;
    twin->values().copy_(owned->values());
    twin->bias().copy_(owned->bias());
    twin->values().mutable_grad().zero_();
    twin->bias().mutable_grad().zero_();
  }
  // zero_grad of a module holding the layer drops what its backward passes handed in.
  torch::nn::Sequential model(owned);
  model->forward(torch::randn({3, 22})).sum().backward();
  model->zero_grad();
  EXPECT_FALSE(owned->step().applied);
}

// A gradient with respect to the input alone (autograd::grad, a frozen layer) computes dX
// alone: a sluice-owned layer's ModelMemory is handed nothing (its step applies nothing), a
// torch-held layer's parameters get no .grad; dX is the masked dense Linear's.
TEST(TorchSparseLinearInputGradientAlone, HandsNothingToTheWeights) {
  torch::manual_seed(10);
  const Tensor w = torch::randn({11, 17}), b = torch::randn({11});
  const Tensor mask = (torch::rand({11, 17}) < 0.4).to(torch::kFloat);
  const Tensor x = torch::randn({6, 17}), g = torch::randn({6, 11});
  const Reference ref = masked_dense(w, mask, b, x, g);

  SparseLinear owned(w, mask, b, SparseLinearOptions(17, 11).weights(WeightOwner::sluice));
  const Tensor values = owned->values().clone();
  const Tensor xs = x.clone().requires_grad_(true);
  const Tensor dx = torch::autograd::grad({(owned(xs) * g).sum()}, {xs})[0];
  EXPECT_LT(relative(dx, ref.dx), 1e-5);
  EXPECT_FALSE(owned->step().applied);
  EXPECT_TRUE(torch::equal(owned->values(), values));

  SparseLinear frozen(w, mask, b, SparseLinearOptions(17, 11));
  for (Tensor& p : frozen->parameters()) p.requires_grad_(false);
  const Tensor xf = x.clone().requires_grad_(true);
  (frozen(xf) * g).sum().backward();
  EXPECT_LT(relative(xf.grad(), ref.dx), 1e-5);
  EXPECT_FALSE(frozen->values().grad().defined());
  EXPECT_FALSE(frozen->bias().grad().defined());

  // Only the bias trained: the values get no gradient, the bias its own.
  SparseLinear bias_only(w, mask, b, SparseLinearOptions(17, 11));
  bias_only->values().requires_grad_(false);
  (bias_only(x) * g).sum().backward();
  EXPECT_FALSE(bias_only->values().grad().defined());
  EXPECT_LT(relative(bias_only->bias().grad(), ref.db), 1e-5);
}

TEST(TorchSparseLinearNoBias, MatchesMaskedDenseLinear) {
  torch::manual_seed(6);
  SparseLinear layer(SparseLinearOptions(33, 21).bias(false).sparsity(0.7));
  EXPECT_FALSE(layer->bias().defined());
  EXPECT_EQ(layer->parameters().size(), 1U);
  const Tensor x = torch::randn({12, 33});
  const Tensor want = torch::nn::functional::linear(x, layer->dense_weight());
  Tensor y = layer(x);
  EXPECT_LT(relative(y, want), 1e-5);
  y.sum().backward();
  EXPECT_TRUE(layer->values().grad().defined());
}

TEST(TorchSparseLinearPruned, KeepsTheLargest) {
  torch::manual_seed(5);
  torch::nn::Linear dense(50, 40);
  const auto layer = SparseLinearImpl::pruned(dense, 0.9, SparseLinearOptions(50, 40));
  EXPECT_EQ(layer->values().numel(), 200);
  const Tensor kept = layer->dense_weight().abs();
  const Tensor dropped = dense->weight.detach().abs() * (1 - layer->mask().to(torch::kFloat));
  EXPECT_GE(kept.masked_select(layer->mask()).min().item<float>(), dropped.max().item<float>());
  EXPECT_TRUE(torch::equal(layer->bias().detach(), dense->bias.detach()));
  EXPECT_THROW(layer->forward(torch::randn({3, 49})), sluice::ShapeError);
  EXPECT_THROW(layer->forward(torch::randn({3, 50}).to(torch::kInt)), sluice::UnsupportedError);
}

// An MLP of sluice layers and the same masked dense torch model, trained side by side
// from the same weights on the same batches, reach the same accuracy.
struct Mlp {
  std::vector<Tensor> weights, masks, biases;  // the dense model's
  std::vector<SparseLinear> sparse;
};

/// `from` saved by torch::save and loaded by torch::load into `into`.
void save_and_load(const SparseLinear& from, SparseLinear& into) {
  std::stringstream archive;
  torch::save(from, archive);
  torch::load(into, archive);
}

// The mask is saved with the values: a layer built with another (another seed, another
// sparsity) loads to compute what the saved one does, and goes on training.
TEST(TorchSparseLinearSaved, LoadsIntoALayerOfAnotherMask) {
  const Tensor x = torch::randn({9, 40});
  SparseLinear saved(SparseLinearOptions(40, 30).sparsity(0.8).seed(3));
  for (const double sparsity : {0.8, 0.5}) {
    SparseLinear other(SparseLinearOptions(40, 30).sparsity(sparsity).seed(4));
    torch::optim::SGD sgd(other->parameters(), 0.1);  // made before: still its parameters
    ASSERT_FALSE(torch::equal(other->mask(), saved->mask()));
    other(x).sum().backward();  // a gradient of its own mask, dropped by the load
    save_and_load(saved, other);
    EXPECT_TRUE(torch::equal(other->mask(), saved->mask())) << sparsity;
    EXPECT_FALSE(other->values().grad().defined()) << sparsity;
    EXPECT_TRUE(torch::equal(other(x), saved(x))) << sparsity;
    other(x).sum().backward();
    sgd.step();
    EXPECT_FALSE(torch::equal(other(x), saved(x))) << sparsity;
  }
}

// An archive that does not fit is refused and the layer is left as it was; a layer whose
// weights are sluice's is loaded through its ModelMemory.
TEST(TorchSparseLinearSaved, AnArchiveThatDoesNotFitChangesNothing) {
  const Tensor x = torch::randn({5, 12});
  SparseLinear saved(SparseLinearOptions(12, 7).sparsity(0.5).seed(1));
  SparseLinear layer(SparseLinearOptions(12, 7).sparsity(0.5).seed(2));
  const Tensor before = layer(x).detach();
  auto refused = [&](const Tensor& indices, const char* words) {
    torch::serialize::OutputArchive out;
    out.write("mask_indices", indices, true);
    out.write("values", saved->values().detach());
    out.write("bias", saved->bias().detach());
    std::stringstream archive;
    out.save_to(archive);
    try {
      torch::load(layer, archive);
      ADD_FAILURE() << words;
    } catch (const sluice::ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_TRUE(torch::equal(layer(x), before)) << words;
  };
  const Tensor good = saved->binding()->mask_indices();
  refused(good.flip(0), "not increasing");
  refused(good + 12 * 7, "not increasing positions below 84");
  refused(good.slice(0, 1), "positions for");
  refused(good.to(torch::kInt), "int64");
  SparseLinear without_bias(SparseLinearOptions(12, 7).bias(false));
  EXPECT_THROW(save_and_load(saved, without_bias), sluice::ShapeError);

  SparseLinear owned(SparseLinearOptions(12, 7).weights(WeightOwner::sluice));
  EXPECT_THROW(save_and_load(saved, owned), sluice::UnsupportedError);
  save_and_load(owned, layer);  // what an owned layer saves, a torch one loads
  EXPECT_TRUE(torch::equal(layer(x), owned(x)));
  // A new mask cannot replace the layer in a ModelMemory other layers share.
  auto shared = std::make_shared<sluice::HostModelMemory>();
  SparseLinear first(SparseLinearOptions(12, 7).memory(shared).seed(5));
  SparseLinear second(SparseLinearOptions(12, 7).memory(shared).seed(6));
  EXPECT_THROW(save_and_load(saved, second), sluice::UnsupportedError);
  save_and_load(second, second);  // the same mask: the values only
}

// clone() of a model holding sluice layers gives a model that computes the same and trains
// apart: its parameters, its ModelMemory and its optimizer's state are its own.
TEST(TorchSparseLinearCloned, ComputesTheSameAndTrainsApart) {
  torch::manual_seed(8);
  const Tensor x = torch::randn({6, 24});
  torch::nn::Sequential model(SparseLinear(SparseLinearOptions(24, 17).sparsity(0.6).seed(2)),
                              torch::nn::ReLU(),
                              SparseLinear(SparseLinearOptions(17, 5).sparsity(0.3).seed(3)));
  torch::optim::SGD sgd(model->parameters(), 0.1);
  model->forward(x).square().sum().backward();
  sgd.step();  // the values now differ from those the ModelMemory was given
  const Tensor before = model->forward(x).detach();

  const auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(torch::equal(copy->forward(x), before));
  const auto layer = std::dynamic_pointer_cast<SparseLinearImpl>(copy->ptr(0));
  const auto original = std::dynamic_pointer_cast<SparseLinearImpl>(model->ptr(0));
  ASSERT_TRUE(layer && original);
  EXPECT_TRUE(torch::equal(layer->mask(), original->mask()));
  EXPECT_NE(&layer->layer().memory(), &original->layer().memory());
  const std::vector<float>& in_memory = layer->layer().weights().values();  // the trained ones
  EXPECT_TRUE(torch::equal(torch::tensor(in_memory), original->values().detach()));
  torch::optim::SGD copy_sgd(copy->parameters(), 0.1);
  copy->forward(x).square().sum().backward();
  copy_sgd.step();
  EXPECT_FALSE(torch::equal(copy->forward(x), before));
  EXPECT_TRUE(torch::equal(model->forward(x), before));
  // reset() is clone()'s: called on a module whose parameters are registered, as for
  // torch's own modules, it is refused, and the module is left as it was.
  EXPECT_THROW(original->reset(), sluice::UnsupportedError);
  EXPECT_TRUE(torch::equal(model->forward(x), before));
  EXPECT_TRUE(original->values().is_same(original->named_parameters()["values"]));
}

TEST(TorchSparseLinearCloned, SluiceOwnedAndSharedLayersGetAModelMemoryOfTheirOwn) {
  torch::manual_seed(9);
  const Tensor x = torch::randn({4, 15});
  sluice::OptimizerConfig sgd;
  sgd.kind = sluice::OptimizerKind::sgd;
  sgd.learning_rate = 0.05;
  auto shared = std::make_shared<sluice::HostModelMemory>();
  shared->set_optimizer(sgd);
  SparseLinear owned(
      SparseLinearOptions(15, 11).weights(WeightOwner::sluice).memory(shared).sparsity(0.4));
  SparseLinear neighbour(SparseLinearOptions(11, 3).weights(WeightOwner::sluice).memory(shared));
  neighbour(owned(x)).sum().backward();
  EXPECT_TRUE(owned->step().applied);  // commits both layers' step
  const Tensor before = owned(x).detach();

  const auto copy = std::dynamic_pointer_cast<SparseLinearImpl>(owned->clone());
  ASSERT_TRUE(copy);
  EXPECT_EQ(shared->layer_count(), 2);
  EXPECT_NE(&copy->layer().memory(), shared.get());
  EXPECT_EQ(copy->layer().memory().optimizer().learning_rate, 0.05);
  EXPECT_TRUE(torch::equal(copy->forward(x), before));
  copy->forward(x).sum().backward();
  const sluice::StepReport report = copy->step();
  EXPECT_TRUE(report.applied);
  EXPECT_EQ(report.step, 1);  // the clone's own first step
  EXPECT_FALSE(torch::equal(copy->forward(x), before));
  EXPECT_TRUE(torch::equal(owned(x), before));
}

TEST(TorchSparseLinearDigits, TrainsLikeTheMaskedDenseModel) {
  const std::filesystem::path file = SLUICE_TEST_DATA_DIR "/digits.csv.gz";
  ASSERT_TRUE(std::filesystem::exists(file)) << file << " is part of the sources";
  sluice::Dataset data = sluice::load_digits(file);
  auto [train, test] = sluice::split_dataset(data, 0.2, 7);
  sluice::standardize(train, test);
  auto tensor_of = [](const sluice::Dataset& d) {  // [samples, 64], token-major
    return torch::from_blob(const_cast<float*>(d.features.data()), {64, d.samples()},
                            {d.features.stride(), 1})
        .t()
        .contiguous();
  };
  const Tensor x_train = tensor_of(train), x_test = tensor_of(test);
  const Tensor y_train = torch::tensor(train.labels, torch::kLong);
  const Tensor y_test = torch::tensor(test.labels, torch::kLong);

  torch::manual_seed(11);
  const std::vector<std::int64_t> sizes{64, 128, 128, 10};
  Mlp m;
  std::vector<Tensor> dense_params, sparse_params;
  for (std::size_t l = 0; l + 1 < sizes.size(); ++l) {
    torch::nn::Linear init(sizes[l], sizes[l + 1]);
    const Tensor mask = (torch::rand({sizes[l + 1], sizes[l]}) < 0.3).to(torch::kFloat);
    m.weights.push_back(init->weight.detach().clone().requires_grad_(true));
    m.biases.push_back(init->bias.detach().clone().requires_grad_(true));
    m.masks.push_back(mask);
    m.sparse.emplace_back(init->weight, mask, init->bias,
                          SparseLinearOptions(sizes[l], sizes[l + 1]));
    dense_params.insert(dense_params.end(), {m.weights.back(), m.biases.back()});
    for (const auto& p : m.sparse.back()->parameters()) sparse_params.push_back(p);
  }
  auto run = [&](const Tensor& x, bool sparse) {
    Tensor h = x;
    for (std::size_t l = 0; l < m.masks.size(); ++l) {
      h = sparse ? m.sparse[l](h)
                 : torch::nn::functional::linear(h, m.weights[l] * m.masks[l], m.biases[l]);
      if (l + 1 < m.masks.size()) h = torch::relu(h);
    }
    return h;
  };
  torch::optim::Adam dense_opt(dense_params, torch::optim::AdamOptions(3e-3));
  torch::optim::Adam sparse_opt(sparse_params, torch::optim::AdamOptions(3e-3));
  const std::int64_t n = x_train.size(0), batch = 64;
  for (int epoch = 0; epoch < 12; ++epoch) {
    const Tensor order = torch::randperm(n, torch::kLong);
    for (std::int64_t s = 0; s < n; s += batch) {
      const Tensor idx = order.slice(0, s, std::min(n, s + batch));
      const Tensor xb = x_train.index_select(0, idx), yb = y_train.index_select(0, idx);
      for (bool sparse : {false, true}) {
        auto& opt = sparse ? sparse_opt : dense_opt;
        opt.zero_grad();
        torch::nn::functional::cross_entropy(run(xb, sparse), yb).backward();
        opt.step();
      }
    }
  }
  torch::NoGradGuard no_grad;
  const double dense_acc =
      run(x_test, false).argmax(1).eq(y_test).to(torch::kDouble).mean().item<double>();
  const double sparse_acc =
      run(x_test, true).argmax(1).eq(y_test).to(torch::kDouble).mean().item<double>();
  std::printf("digits test accuracy: masked dense %.4f, sluice %.4f\n", dense_acc, sparse_acc);
  EXPECT_GT(dense_acc, 0.9);
  EXPECT_NEAR(sparse_acc * 100, dense_acc * 100, 0.5);
}

}  // namespace
