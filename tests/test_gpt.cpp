// The GPT trained by weight streaming (sluice/gpt.hpp): a tiny model's loss and every
// layer's gradient against central differences of a float64 dense-masked reference (its
// sparse weights as dense matrices with zeros off the mask), on 1 and 2 local engines;
// training that learns; checkpoints that resume exactly; seeded generation; an engine's
// block store keeping its buffers from step to step.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "gpt_reference.hpp"
#include "sluice/block_store.hpp"
#include "sluice/engine.hpp"
#include "sluice/gpt.hpp"
#include "sluice/stream_codec.hpp"
#include "sluice/tiered_model_memory.hpp"
#include "test_support.hpp"

namespace sluice {
namespace {

using namespace testing::gpt_reference;

// A held-out batch between two training steps (a trainer's periodic evaluation) reuses
// the training batch's buffers, and the next step finds them again: a store rebuilt every
// step would zero fresh memory for every activation of every block.
TEST(BlockStore, KeepsATrainingBatchsBuffersThroughAnEvaluation) {
  const BlockShape training{256, 4, 8, 2, 2, true};
  BlockShape evaluation = training;
  evaluation.training = false;
  const std::vector<std::int32_t> tokens(12, 7);
  BlockStore s;
  s.load(training, tokens, tokens);
  s.blocks[1].h(5, 3) = 42.0F;  // a rebuilt store would be zero here
  s.dx(2, 1) = 43.0F;
  s.load(evaluation, tokens, {});
  EXPECT_FALSE(s.shape().training);  // no backward on an evaluation's batch
  s.load(training, tokens, tokens);
  EXPECT_TRUE(s.shape().training);
  EXPECT_EQ(s.blocks[1].h(5, 3), 42.0F);
  EXPECT_EQ(s.dx(2, 1), 43.0F);
  // An evaluation first holds no deltas: the training batch after it gets them.
  BlockStore fresh;
  fresh.load(evaluation, tokens, {});
  EXPECT_EQ(fresh.dx.cols(), 0);
  fresh.load(training, tokens, tokens);
  EXPECT_EQ(fresh.dx.rows(), 8);
  EXPECT_EQ(fresh.dx.cols(), 12);
}

// An evaluation's shorter last batch, and the training batch after it, are zeros of their
// shape in the memory the store already has.
TEST(BlockStore, ReshapesInTheMemoryItHas) {
  const BlockShape training{256, 4, 8, 2, 2, true};
  BlockShape evaluation = training;
  evaluation.training = false;
  const std::vector<std::int32_t> twelve(12, 7), eight(8, 3);
  BlockStore s;
  s.load(training, twelve, twelve);
  const float* h = s.blocks[1].h.data();
  const float* dx = s.dx.data();
  s.blocks[1].h(5, 3) = 42.0F;
  s.dx(2, 1) = 43.0F;
  s.load(evaluation, eight, {});
  EXPECT_EQ(s.blocks[1].h.data(), h);
  EXPECT_EQ(s.blocks[1].h.cols(), 8);
  EXPECT_EQ(s.dx.cols(), 0);
  for (std::int64_t r = 0; r < s.blocks[1].h.rows(); ++r) {
    for (std::int64_t c = 0; c < 8; ++c) ASSERT_EQ(s.blocks[1].h(r, c), 0.0F) << r << " " << c;
  }
  s.load(training, twelve, twelve);
  EXPECT_EQ(s.blocks[1].h.data(), h);
  EXPECT_EQ(s.dx.data(), dx);
  EXPECT_EQ(s.blocks[1].h(5, 3), 0.0F);
  EXPECT_EQ(s.dx(2, 1), 0.0F);
  EXPECT_EQ(s.dx.cols(), 12);
  s.load(training, std::vector<std::int32_t>(16, 1), std::vector<std::int32_t>(16, 2));
  EXPECT_EQ(s.blocks[1].h.cols(), 16);  // more than it had: new memory
  EXPECT_EQ(s.blocks[1].h(31, 15), 0.0F);
}

struct GptCase {
  std::int64_t blocks;
  std::int32_t engines;
};

class GptGradients : public ::testing::TestWithParam<GptCase> {};

TEST_P(GptGradients, LossAndEveryGradientMatchTheFloat64Reference) {
  const GptConfig c = tiny_config(GetParam().blocks);
  HostModelMemory memory;
  build_random_gpt(memory, c, 11);
  LocalFabricOptions fo;
  fo.engines = GetParam().engines;
  LocalFabric fabric(fo);
  GptModel model(memory, fabric, c);
  const TextBatch batch = random_batch(c, 3, 5);  // 3 sequences: 2 engines take 1 and 2
  double loss = 0;
  const std::vector<LayerGradient> grads = model.gradients(batch, &loss);
  const double expected = reference_loss(reference_of(memory), c, batch);
  EXPECT_NEAR(loss, expected, 1e-5 * expected);
  EXPECT_NEAR(model.loss(batch), expected, 1e-5 * expected);
  expect_gradients_match(memory, c, batch, grads, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Engines, GptGradients,
                         ::testing::Values(GptCase{1, 1}, GptCase{1, 2}, GptCase{2, 2}),
                         [](const auto& info) {
                           return std::to_string(info.param.blocks) + "Blocks" +
                                  std::to_string(info.param.engines) + "Engines";
                         });

// Projections streamed in bf16, with weights that bf16 holds exactly: the loss of the
// float64 reference whose projections take bf16-rounded inputs, as the bf16 products do;
// gradients within bf16's rounding of fp32's; fewer stream bytes. With any weights, a loss
// that differs from fp32's by bf16's rounding alone.
TEST(GptBf16, ProjectionsStreamInBf16) {
  const GptConfig c = tiny_config(2);
  const TextBatch batch = random_batch(c, 3, 5);
  LocalFabric fabric({.engines = 2});
  HostModelMemory exact, exact32;
  build_random_gpt(exact, c, 11, /*bf16_exact=*/true);
  build_random_gpt(exact32, c, 11, /*bf16_exact=*/true);
  GptModel bf16(exact, fabric, c, {}, Precision::bf16);
  GptModel fp32(exact32, fabric, c);
  double loss = 0, loss32 = 0;
  const std::vector<LayerGradient> grads = bf16.gradients(batch, &loss);
  const std::vector<LayerGradient> grads32 = fp32.gradients(batch, &loss32);
  Reference rounded = reference_of(exact);
  rounded.bf16_projections = true;
  const double expected = reference_loss(rounded, c, batch);
  EXPECT_NEAR(loss, expected, 1e-5 * expected);
  EXPECT_NE(loss, loss32);
  ASSERT_EQ(grads.size(), grads32.size());
  for (std::size_t l = 0; l < grads.size(); ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const std::vector<float>& got = grads[l].weights.values();
    const std::vector<float>& want = grads32[l].weights.values();
    ASSERT_EQ(got.size(), want.size());
    double bound = 1e-3;  // relative to the layer's largest gradient
    for (const float w : want) bound = std::max(bound, static_cast<double>(std::abs(w)));
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-2 * bound) << i;
  }

  HostModelMemory fp32_memory, bf16_memory;
  build_random_gpt(fp32_memory, c, 11);
  build_random_gpt(bf16_memory, c, 11);
  GptModel a_model(fp32_memory, fabric, c);
  GptModel b_model(bf16_memory, fabric, c, {}, Precision::bf16);
  const GptStep a = a_model.train_step(batch), b = b_model.train_step(batch);
  EXPECT_NE(a.loss, b.loss);
  EXPECT_NEAR(b.loss, a.loss, 1e-2 * a.loss);
  EXPECT_LT(static_cast<double>(b.metrics.stream_bytes),
            0.75 * static_cast<double>(a.metrics.stream_bytes));
}

/// A text with structure to learn: a few words repeated in a seeded order.
std::string small_text(std::size_t bytes) {
  const char* words[] = {"the ",  "quick ", "brown ", "fox ",  "jumps ",
                         "over ", "a ",     "lazy ",  "dog.\n"};
  std::string s;
  std::uint64_t x = 1;
  while (s.size() < bytes) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    s += words[(x >> 33) % 9];
  }
  s.resize(bytes);
  return s;
}

GptConfig text_config() {
  GptConfig c;
  c.context = 16;
  c.d_model = 32;
  c.heads = 2;
  c.blocks = 2;
  c.sparsity = 0.75;
  return c;
}

TEST(Gpt, TrainingOnATextLowersTheHeldOutLoss) {
  const GptConfig c = text_config();
  const TextCorpus corpus(small_text(20000), c.context);
  HostModelMemory memory;
  build_gpt(memory, c, 3);
  OptimizerConfig opt;
  opt.kind = OptimizerKind::adam;
  opt.learning_rate = 3e-3;
  memory.set_optimizer(opt);
  LocalFabricOptions fo;
  fo.engines = 2;
  LocalFabric fabric(fo);
  GptModel model(memory, fabric, c);
  const TextBatch held_out = corpus.held_out_batch(0, corpus.held_out_windows() / 2 * 2);
  const double before = model.loss(held_out);
  EXPECT_NEAR(before, std::log(256.0), 0.5);  // about uniform over the bytes at the start
  for (int step = 0; step < 60; ++step) {
    const GptStep s = model.train_step(corpus.sample(8, 1, static_cast<std::uint64_t>(step)));
    ASSERT_TRUE(s.report.applied) << step;
    ASSERT_TRUE(std::isfinite(s.loss));
  }
  const double after = model.loss(held_out);
  EXPECT_LT(after, 0.6 * before) << before << " -> " << after;
  EXPECT_EQ(model.totals().steps, 60);
  EXPECT_EQ(model.totals().tokens, 60 * 8 * c.context);
}

class GptCheckpoint : public testing::TempDirTest {};

TEST_F(GptCheckpoint, ResumesExactlyAsAnUninterruptedRun) {
  const GptConfig c = text_config();
  const TextCorpus corpus(small_text(8000), c.context);
  OptimizerConfig opt;
  opt.kind = OptimizerKind::adamw;
  opt.learning_rate = 2e-3;
  opt.weight_decay = 0.01;
  LocalFabric fabric;
  auto train = [&](ModelMemory& m, int first, int last) {
    GptModel model(m, fabric, gpt_config_of(m));
    for (int step = first; step < last; ++step) {
      model.train_step(corpus.sample(4, 9, static_cast<std::uint64_t>(step)));
    }
  };
  HostModelMemory straight;
  build_gpt(straight, c, 5);
  straight.set_optimizer(opt);
  train(straight, 0, 6);

  HostModelMemory first;
  build_gpt(first, c, 5);
  first.set_optimizer(opt);
  train(first, 0, 3);
  const std::filesystem::path path = dir_ / "gpt_resume.ck";
  first.save(path);
  HostModelMemory resumed;
  resumed.load(path);
  EXPECT_EQ(resumed.model, c.describe());
  const GptConfig loaded = gpt_config_of(resumed);
  EXPECT_EQ(loaded.describe(), c.describe());
  EXPECT_NEAR(loaded.sparsity, c.sparsity, 0.05);
  train(resumed, 3, 6);

  ASSERT_EQ(resumed.layer_count(), straight.layer_count());
  EXPECT_EQ(resumed.step(), straight.step());
  for (std::int32_t l = 0; l < straight.layer_count(); ++l) {
    EXPECT_EQ(resumed.weights(l).values(), straight.weights(l).values()) << "layer " << l;
    EXPECT_EQ(resumed.bias(l), straight.bias(l)) << "layer " << l;
  }
}

// A GPT in a model store (MemoryX's flash tier) trains bit for bit as in RAM and a store
// reopened goes on as if never closed: under a budget that holds its layers' patterns, and
// under one barely above its largest layer's working set (the backward's transposed
// patterns then read back from the store's files).
class GptModelStore : public testing::TempDirTest {
 protected:
  GptConfig config_ = store_config();
  TextCorpus corpus_{small_text(8000), config_.context};
  LocalFabric fabric_{LocalFabricOptions{.engines = 2}};

  static GptConfig store_config() {
    GptConfig c = text_config();
    c.d_model = 64;
    c.sparsity = 0.5;  // the blocks' projections as large as the byte table
    return c;
  }
  static OptimizerConfig adamw() {
    OptimizerConfig opt;
    opt.kind = OptimizerKind::adamw;
    opt.learning_rate = 2e-3;
    opt.weight_decay = 0.01;
    return opt;
  }
  /// The largest layer's working set, and (checked) less than half the model's.
  std::int64_t largest_working_set() const {
    HostModelMemory m;
    build_gpt(m, config_, 5);
    std::int64_t largest = 0, all = 0;
    for (std::int32_t l = 0; l < m.layer_count(); ++l) {
      const std::int64_t w = TieredModelMemory::working_set_bytes(m.layer_shape(l));
      largest = std::max(largest, w);
      all += w;
    }
    EXPECT_GT(all, 2 * largest);
    return largest;
  }
  /// The losses of steps [first, last) of `model`.
  std::vector<double> train(GptModel& model, int first, int last) {
    std::vector<double> losses;
    for (int step = first; step < last; ++step) {
      const GptStep s = model.train_step(corpus_.sample(4, 9, static_cast<std::uint64_t>(step)));
      EXPECT_TRUE(s.report.applied) << step;
      losses.push_back(s.loss);
    }
    return losses;
  }
};

TEST_F(GptModelStore, TrainsBitForBitAsInRamAndResumes) {
  HostModelMemory host;
  build_gpt(host, config_, 5);
  host.set_optimizer(adamw());
  GptModel in_ram(host, fabric_, config_);
  const std::vector<double> want = train(in_ram, 0, 6);
  const TextBatch held_out = corpus_.held_out_batch(0, 4);

  const std::int64_t largest = largest_working_set();
  for (const bool patterns_fit : {true, false}) {
    const std::int64_t budget = patterns_fit ? 3 * largest : largest + largest / 8;
    const std::filesystem::path dir = dir_ / (patterns_fit ? "roomy" : "tight");
    std::vector<double> got;
    {
      TieredModelMemory store(dir, budget);
      build_gpt(store, config_, 5);
      store.set_optimizer(adamw());
      EXPECT_EQ(store.by_input_from_ram(), patterns_fit);
      GptModel model(store, fabric_, config_);
      got = train(model, 0, 3);
      EXPECT_GT(store.counters().read_bytes, 0U);  // layers evicted and read back
    }
    TieredModelMemory reopened(dir, budget);
    EXPECT_EQ(reopened.model, config_.describe());
    EXPECT_EQ(reopened.step(), 3);
    GptModel model(reopened, fabric_, gpt_config_of(reopened));
    const std::vector<double> rest = train(model, 3, 6);
    got.insert(got.end(), rest.begin(), rest.end());
    EXPECT_EQ(got, want) << patterns_fit;
    EXPECT_EQ(model.loss(held_out), in_ram.loss(held_out)) << patterns_fit;
  }
}

// What a store's budget is checked against before a GPT is built is what build_gpt adds.
TEST(Gpt, LayerShapesAreThoseBuildGptAdds) {
  GptConfig c = text_config();
  c.blocks = 3;
  HostModelMemory m;
  build_gpt(m, c, 2);
  const std::vector<GptLayerShape> shapes = gpt_layer_shapes(c);
  ASSERT_EQ(static_cast<std::int32_t>(shapes.size()), m.layer_count());
  for (std::int32_t l = 0; l < m.layer_count(); ++l) {
    const GptLayerShape& want = shapes[static_cast<std::size_t>(l)];
    const LayerShape got = m.layer_shape(l);
    EXPECT_EQ(got.rows, want.rows) << l;
    EXPECT_EQ(got.cols, want.cols) << l;
    EXPECT_EQ(got.bias, want.bias ? want.rows : 0) << l;
    EXPECT_EQ(got.nnz < got.rows * got.cols, want.sparse) << l;
  }
}

TEST(Gpt, GenerationIsDeterministicForASeed) {
  const GptConfig c = text_config();
  HostModelMemory memory;
  build_gpt(memory, c, 8);
  LocalFabric fabric;
  GptModel model(memory, fabric, c);
  const std::string a = generate_text(model, "the quick", 40, 1.0, 7);
  EXPECT_EQ(a.size(), 40U);
  EXPECT_EQ(generate_text(model, "the quick", 40, 1.0, 7), a);
  // Longer than the context: the window slides.
  EXPECT_EQ(generate_text(model, "", 3 * c.context, 0.8, 2).size(),
            static_cast<std::size_t>(3 * c.context));
  // Temperature 0 is the argmax, whatever the seed.
  EXPECT_EQ(generate_text(model, "fox", 10, 0.0, 1), generate_text(model, "fox", 10, 0.0, 2));
  EXPECT_THROW(generate_text(model, "x", 5, -1.0, 1), ArgumentError);
}

TEST(Gpt, BadShapesAndModelsAreRefused) {
  GptConfig c = tiny_config();
  c.heads = 3;  // 16 is not a multiple of 3
  EXPECT_THROW(c.validate(), ShapeError);
  HostModelMemory memory;
  EXPECT_THROW(gpt_config_of(memory), FormatError);  // no model description
  build_gpt(memory, tiny_config(), 1);
  EXPECT_THROW(build_gpt(memory, tiny_config(), 1), ArgumentError);  // not empty
  LocalFabricOptions fo;
  fo.engines = 2;
  LocalFabric fabric(fo);
  EXPECT_THROW(GptModel(memory, fabric, tiny_config(2)), ShapeError);
  GptModel model(memory, fabric, tiny_config());
  EXPECT_THROW(model.loss(random_batch(tiny_config(), 1, 1)), ShapeError);  // 1 sequence, 2 engines
  TextBatch wrong = random_batch(tiny_config(), 2, 1);
  wrong.inputs[3] = 40;  // outside the vocabulary of 32
  EXPECT_THROW(model.loss(wrong), ArgumentError);
  EXPECT_THROW(GptConfig::parse("gpt vocab=256 context=8"), FormatError);
  EXPECT_THROW(GptConfig::parse("mlp"), FormatError);
  EXPECT_EQ(GptConfig::parse(tiny_config().describe()).describe(), tiny_config().describe());
}

// An engine's block operations (sluice/block_store.hpp) refuse a call out of order or with
// the wrong arguments, before they touch anything.
TEST(GptEngine, BlockCallsOutOfOrderOrWithWrongArgumentsAreRefused) {
  CpuEngine engine({.threads = 1});
  const BlockShape shape{32, 8, 16, 2, 1, true};
  auto run = [&](BlockOp op, StreamSource* stream = nullptr, std::int32_t block = 0) {
    BlockCall call;
    call.op = op;
    call.block = block;
    return engine.run_block(call, stream, nullptr, {});
  };
  EXPECT_THROW(run(BlockOp::embed), ArgumentError);  // nothing loaded
  EXPECT_THROW(engine.load_tokens(shape, std::vector<std::int32_t>(7, 3), {}), ShapeError);
  EXPECT_THROW(engine.load_tokens(shape, std::vector<std::int32_t>(8, 32), {}), ArgumentError);
  const std::vector<std::int32_t> tokens(16, 3);
  engine.load_tokens(shape, tokens, tokens);
  EXPECT_EQ(engine.block_store().tokens(), 16);
  EXPECT_THROW(run(BlockOp::embed), ArgumentError);              // the tables were not set
  EXPECT_THROW(run(BlockOp::norm1, nullptr, 1), ArgumentError);  // one block only
  EXPECT_THROW(run(BlockOp::set_table), ArgumentError);          // needs its stream
  const WeightStream wrong = encode_stream(CsrMatrix::random(31, 16, 0.0, 1));
  MemoryStreamSource wrong_source(wrong);
  EXPECT_THROW(run(BlockOp::set_table, &wrong_source), ShapeError);
  const WeightStream q = encode_stream(CsrMatrix::random(16, 16, 0.5, 2));
  MemoryStreamSource q_source(q);
  EXPECT_THROW(run(BlockOp::q, &q_source), ArgumentError);  // a projection needs a placement
  BlockCall loss;
  loss.op = BlockOp::loss;
  loss.want_delta = true;  // without the batch's token count
  EXPECT_THROW(engine.run_block(loss, nullptr, nullptr, {}), ArgumentError);
}

TEST(Gpt, ADenseModelStoresEveryParameterASparseOneFewer) {
  GptConfig c = tiny_config(2);
  c.sparsity = 0;
  HostModelMemory dense;
  build_gpt(dense, c, 1);
  EXPECT_EQ(stored_parameters(dense), gpt_parameters(c));
  c.sparsity = 0.9;
  HostModelMemory sparse;
  build_gpt(sparse, c, 1);
  EXPECT_LT(stored_parameters(sparse), gpt_parameters(c) / 3);
  EXPECT_NEAR(gpt_config_of(sparse).sparsity, 0.9, 0.05);
}

}  // namespace
}  // namespace sluice
