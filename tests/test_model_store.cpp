// A TieredModelMemory's store as files: every corrupt byte refused naming the file and
// nothing changed (read at the open or later), one process and object at a time, a budget
// smaller than a layer (or than the trainer's reserve leaves) refused, the step, epochs,
// seed, optimizer, schedules, model, class names, scaling and training data committed with
// it (older manifests read with none), and SIGKILL at a random moment leaving a committed
// step that opens.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "sluice/tiered_model_memory.hpp"
#include "test_support.hpp"
#include "tiered_training.hpp"

namespace sluice {
namespace {

// The helpers of tiered_training.hpp, TempDirTest and thrown_message.
using namespace testing;

class TieredStore : public TempDirTest {
 protected:
  std::filesystem::path store() const { return dir_ / "store"; }
  /// A store of kSizes trained `steps` Adam steps.
  void make_store(int steps) {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    m.set_optimizer(config_of(OptimizerKind::adam));
    build_sparse_mlp(m, kSizes, 0.5, 3);
    Trainer t(m, 1, Precision::fp32);
    const Data d = make_data(steps, 7);
    for (int s = 0; s < steps; ++s) t.step(d, s);
  }
  std::map<std::string, std::string> files() const {
    std::map<std::string, std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(store())) {
      std::ifstream in(e.path(), std::ios::binary);
      out[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
    return out;
  }
  void write(const std::string& name, const std::string& bytes) const {
    std::ofstream(store() / name, std::ios::binary | std::ios::trunc) << bytes;
  }
  /// Writes `bytes` as `name` with one bit flipped at random; returns the byte's offset.
  std::size_t write_flipped(const std::string& name, const std::string& bytes,
                            std::mt19937_64& rng) const {
    std::string bad = bytes;
    const std::size_t at = rng() % bad.size();
    bad[at] = static_cast<char>(bad[at] ^ (1 << (rng() % 8)));
    write(name, bad);
    return at;
  }
};

TEST_F(TieredStore, EveryCorruptByteIsRefusedNamingTheFileAndNothingChanges) {
  make_store(2);
  const auto good = files();
  EXPECT_EQ(good.size(), 1U + 2 * (kSizes.size() - 1));  // MANIFEST, pattern and state per layer
  std::mt19937_64 rng(5);
  for (const auto& [name, bytes] : good) {
    for (int trial = 0; trial < 12; ++trial) {
      const std::size_t at = write_flipped(name, bytes, rng);
      std::string message;
      try {
        TieredModelMemory m(store(), std::int64_t{1} << 30);
        ADD_FAILURE() << name << ": byte " << at << " flipped, and the store opened";
      } catch (const FormatError& e) {
        message = e.what();
      } catch (const IoError& e) {
        message = e.what();
      }
      EXPECT_CONTAINS(message, name);
      EXPECT_CONTAINS(message, "byte");
      auto now = files();
      now[name] = bytes;
      EXPECT_EQ(now, good) << "a refused open changed the store (" << name << ")";
      write(name, bytes);
    }
    // Truncated, and missing.
    write(name, bytes.substr(0, bytes.size() / 2));
    EXPECT_ANY_THROW(TieredModelMemory(store(), std::int64_t{1} << 30)) << name;
    std::filesystem::remove(store() / name);
    std::string message;
    try {
      TieredModelMemory m(store(), std::int64_t{1} << 30);
      if (name != "MANIFEST") ADD_FAILURE() << name << " missing, and the store opened";
    } catch (const Error& e) {
      message = e.what();
    }
    if (name != "MANIFEST") EXPECT_CONTAINS(message, name);
    write(name, bytes);
  }
  TieredModelMemory m(store(), std::int64_t{1} << 30);
  EXPECT_EQ(m.step(), 2);
}

// A pattern file is checked in full when the store opens; a layer evicted and read again
// is checked by its CRCs, which still refuse any changed byte, naming the file and the byte,
// and leave the layer to be read again once the file is whole — also when its values (from
// the state file) are what fails: the failed load keeps none of what it read.
TEST_F(TieredStore, AFileCorruptedAfterTheOpenIsRefusedWhenReadAgain) {
  const CsrMatrix layer = CsrMatrix::random(64, 64, 0.5, 1);
  const LayerShape shape{64, 64, layer.nnz(), 64};
  TieredModelMemory m(store(), TieredModelMemory::working_set_bytes(shape));
  for (int l = 0; l < 4; ++l) m.add_layer(layer, std::vector<float>(64));
  auto by_input = [&](std::int32_t l) {
    return m.stream(l, StreamKind::weights, Precision::fp32, StreamOrder::by_input);
  };
  const WeightStream expected = by_input(0);
  for (std::int32_t l = 1; l < 4; ++l) by_input(l);  // layer 0's pieces are evicted
  const std::string name = "layer-000000.pattern";
  const std::string bytes = files().at(name);
  std::mt19937_64 rng(8);
  for (int trial = 0; trial < 24; ++trial) {
    const std::size_t at = write_flipped(name, bytes, rng);
    std::string message;
    try {
      by_input(0);
      ADD_FAILURE() << "byte " << at << " flipped, and the layer was read";
    } catch (const FormatError& e) {
      message = e.what();
    }
    EXPECT_CONTAINS(message, name);
    EXPECT_CONTAINS(message, "byte");
  }
  write(name, bytes);
  // The values come from the state file: a changed byte of them is refused the same way,
  // and the load that failed leaves nothing behind in the cache.
  std::string state;
  for (const auto& [file, content] : files()) {
    if (file.rfind("layer-000000.", 0) == 0 && file.ends_with(".state")) state = file;
  }
  ASSERT_FALSE(state.empty());
  const std::string state_bytes = files().at(state);
  const std::size_t values_at = state_bytes.find("VALS") + 16;  // tag, length, CRC
  ASSERT_LT(values_at + 4 * static_cast<std::size_t>(layer.nnz()), state_bytes.size());
  for (int trial = 0; trial < 4; ++trial) {
    std::string bad = state_bytes;
    const std::size_t at = values_at + rng() % (4 * static_cast<std::size_t>(layer.nnz()));
    bad[at] = static_cast<char>(bad[at] ^ 0x10);
    for (std::int32_t l = 1; l < 4; ++l) by_input(l);  // layer 0's pieces are evicted
    write(state, bad);
    EXPECT_CONTAINS(thrown_message<FormatError>([&] { by_input(0); }), state);
    write(state, state_bytes);
    ASSERT_EQ(decode_stream(by_input(0)).values(), decode_stream(expected).values()) << trial;
  }
  EXPECT_EQ(decode_stream(by_input(0)).values(), decode_stream(expected).values());
  EXPECT_EQ(decode_stream(by_input(0)).col_indices(), decode_stream(expected).col_indices());
}

TEST_F(TieredStore, AStoreIsOpenInOneProcessAndObjectAtATime) {
  make_store(2);
  const auto before = files();
  auto refused = [&] {
    try {
      TieredModelMemory second(store(), std::int64_t{1} << 30);
    } catch (const IoError& e) {
      return std::string(e.what()).find("is open in another process") != std::string::npos;
    }
    return false;
  };
  {
    TieredModelMemory first(store(), std::int64_t{1} << 30);
    EXPECT_TRUE(refused());
    // Another process: it would take this one's uncommitted files for leftovers.
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) _exit(refused() ? 0 : 1);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT_EQ(first.layer_count(), static_cast<std::int32_t>(kSizes.size()) - 1);
  }
  EXPECT_EQ(files(), before);
  TieredModelMemory again(store(), std::int64_t{1} << 30);  // free once the first is gone
  EXPECT_EQ(again.layer_count(), static_cast<std::int32_t>(kSizes.size()) - 1);
  // A file where the store's directory should be.
  write("not-a-store", "x");
  EXPECT_THROW(TieredModelMemory(store() / "not-a-store", std::int64_t{1} << 30), IoError);
}

TEST_F(TieredStore, ABudgetSmallerThanALayerIsRefused) {
  {
    TieredModelMemory m(store(), 4096);
    const std::string message = thrown_message<ResourceError>(
        [&] { m.add_layer(CsrMatrix::random(64, 64, 0.5, 1), std::vector<float>(64)); });
    EXPECT_CONTAINS(message, "budget");
    EXPECT_EQ(m.layer_count(), 0);
  }
  make_store(1);
  const std::string message =
      thrown_message<ResourceError>([&] { TieredModelMemory m(store(), 4096); });
  EXPECT_CONTAINS(message, "layer 0");
  EXPECT_CONTAINS(message, "budget");
  EXPECT_THROW(TieredModelMemory(store(), 0), ArgumentError);
}

// The trainer's reserve (ModelMemory::reserve_ram_bytes) comes out of the cache: a layer
// that fitted beside the others is evicted and read again. It never takes a layer's
// working set: a reserve that would is refused, and so is a layer added that does not fit
// beside the reserve.
TEST_F(TieredStore, TheTrainersReserveComesOutOfTheCacheAndOneLeavingNoLayerRoomIsRefused) {
  const CsrMatrix layer = CsrMatrix::random(64, 64, 0.5, 1);
  const LayerShape shape{64, 64, layer.nnz(), 64};
  const std::int64_t ws = TieredModelMemory::working_set_bytes(shape);
  TieredModelMemory m(store(), 3 * ws);  // every layer's mask, values and transpose fit
  for (int l = 0; l < 3; ++l) m.add_layer(layer, std::vector<float>(64));
  auto reads = [&] { return m.counters().read_bytes; };
  auto stream_all = [&] {
    for (std::int32_t l = 0; l < 3; ++l) {
      m.stream(l, StreamKind::weights, Precision::fp32, StreamOrder::by_input);
    }
  };
  stream_all();
  const std::uint64_t cached = reads();
  stream_all();
  EXPECT_EQ(reads(), cached);   // all three held
  m.reserve_ram_bytes(2 * ws);  // room for two layers' pieces, not three
  stream_all();
  EXPECT_GT(reads(), cached);
  m.reserve_ram_bytes(0);
  stream_all();
  const std::uint64_t again = reads();
  stream_all();
  EXPECT_EQ(reads(), again);
  // A reserve that leaves no layer's working set room would put the process over the
  // budget: refused, naming the least budget that holds both, and the old one stays.
  const std::string message =
      thrown_message<ResourceError>([&] { m.reserve_ram_bytes(2 * ws + 1); });
  EXPECT_CONTAINS(message, "needs at least " + std::to_string(3 * ws + 1));
  EXPECT_CONTAINS(message, "layer 0's working set (" + std::to_string(ws) + " bytes)");
  stream_all();
  EXPECT_EQ(reads(), again);
  m.reserve_ram_bytes(2 * ws);  // exactly what leaves one working set
  EXPECT_NO_THROW(stream_all());
  EXPECT_EQ(m.ram_budget_bytes(), 3 * ws);
  // A layer added later must fit beside the reserve too: a denser one does not.
  const std::string denser = thrown_message<ResourceError>(
      [&] { m.add_layer(CsrMatrix::random(64, 64, 0.25, 2), std::vector<float>(64)); });
  EXPECT_CONTAINS(denser, "of which a trainer holds " + std::to_string(2 * ws));
  EXPECT_EQ(m.layer_count(), 3);
}

TEST_F(TieredStore, SaveAndLoadSayTheStoreIsTheCheckpoint) {
  TieredModelMemory m(store(), 1 << 20);
  EXPECT_CONTAINS(thrown_message<UnsupportedError>([&] { m.save(dir_ / "x.ckpt"); }),
                  "own checkpoint");
  EXPECT_THROW(m.load(dir_ / "x.ckpt"), UnsupportedError);
  EXPECT_THROW(m.weights(0), ArgumentError);
}

// What a trainer resuming from the store needs besides the model, as a checkpoint keeps it.
TEST_F(TieredStore, StepEpochsSeedAndOptimizerAreCommittedWithTheStore) {
  make_store(3);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.step(), 3);
    EXPECT_EQ(m.seed, 0U);
    EXPECT_EQ(m.epochs, 0);
    m.epochs = 4;
    m.seed = 11;
    m.commit_counters();
    OptimizerConfig c;
    c.kind = OptimizerKind::adamw;
    c.learning_rate = 0.003;
    c.weight_decay = 0.01;
    m.set_optimizer(c);
  }
  TieredModelMemory m(store(), std::int64_t{1} << 30);
  EXPECT_EQ(m.epochs, 4);
  EXPECT_EQ(m.seed, 11U);
  EXPECT_EQ(m.step(), 3);
  EXPECT_EQ(m.optimizer().kind, OptimizerKind::adamw);
  EXPECT_EQ(m.optimizer().learning_rate, 0.003);
  EXPECT_EQ(m.optimizer().weight_decay, 0.01);
}
TEST_F(TieredStore, TheSchedulesModelClassesScalingAndDataAreCommittedAndOlderManifestsHaveNone) {
  make_store(1);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::none);
    EXPECT_FALSE(m.optimizer().decay.active());
    EXPECT_EQ(m.model, "");
    m.model = "gpt vocab=256 (a description)";
    m.class_names = {"cat", "dog"};
    m.input_mean = {-3.0};
    m.input_scale = {0.125};
    m.training_data = "synthetic";
    m.dynamic.rule = MaskUpdateRule::set;
    m.dynamic.drop = 0.25;
    m.dynamic.total_steps = 40;
    m.dynamic.seed = 8;
    m.commit_counters();
    OptimizerConfig c = m.optimizer();
    c.decay = {5, 30, 0.2};
    m.set_optimizer(c);
  }
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::set);
    EXPECT_EQ(m.dynamic.drop, 0.25);
    EXPECT_EQ(m.dynamic.total_steps, 40);
    EXPECT_EQ(m.dynamic.seed, 8U);
    EXPECT_EQ(m.optimizer().decay, (LearningRateDecay{5, 30, 0.2}));
    EXPECT_EQ(m.model, "gpt vocab=256 (a description)");
    EXPECT_EQ(m.class_names, (std::vector<std::string>{"cat", "dog"}));
    EXPECT_EQ(m.input_mean, std::vector<double>{-3.0});
    EXPECT_EQ(m.input_scale, std::vector<double>{0.125});
    EXPECT_EQ(m.training_data, "synthetic");
    m.model = std::string(1, '\n');  // no manifest holds it: refused, nothing written
    EXPECT_THROW(m.commit_counters(), ShapeError);
    m.model = "gpt vocab=256 (a description)";
    m.class_names = {"cat", "cat"};  // nor these
    EXPECT_THROW(m.commit_counters(), ShapeError);
    m.class_names = {"cat", "dog"};
    m.training_data = std::string("a\0b", 3);  // nor this
    EXPECT_THROW(m.commit_counters(), ShapeError);
  }
  // Version 6 wrote no training data: it opens as none; version 5 no class names or input
  // scaling either, version 4 no model section (a stack of layers), version 3 no decay
  // section, version 2 no schedule.
  std::string bytes = files()["MANIFEST"];
  const std::size_t data = bytes.find("DATA");
  ASSERT_NE(data, std::string::npos);
  bytes.erase(data, 16 + 9);
  std::uint32_t version = 6;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.training_data, "");
    EXPECT_EQ(m.class_names, (std::vector<std::string>{"cat", "dog"}));
  }
  const std::size_t names = bytes.find("CLAS");
  ASSERT_NE(names, std::string::npos);
  bytes.erase(names, 16 + 8 + 16 + 8 + 16);
  version = 5;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_TRUE(m.class_names.empty());
    EXPECT_TRUE(m.input_mean.empty() && m.input_scale.empty());
    EXPECT_EQ(m.model, "gpt vocab=256 (a description)");
  }
  const std::size_t model = bytes.find("MODL");
  ASSERT_NE(model, std::string::npos);
  bytes.erase(model, 16 + 29);
  version = 4;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.model, "");
    EXPECT_EQ(m.optimizer().decay, (LearningRateDecay{5, 30, 0.2}));
  }
  const std::size_t decay = bytes.find("LRDC");
  ASSERT_NE(decay, std::string::npos);
  bytes.erase(decay, 16 + 24);
  version = 3;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  {
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    EXPECT_EQ(m.optimizer().decay, LearningRateDecay{});
    EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::set);
  }
  const std::size_t at = bytes.find("DYNS");
  ASSERT_NE(at, std::string::npos);
  bytes.erase(at, 16 + 44);
  version = 2;
  std::memcpy(bytes.data() + 8, &version, 4);
  write("MANIFEST", bytes);
  TieredModelMemory m(store(), std::int64_t{1} << 30);
  EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::none);
  EXPECT_EQ(m.step(), 1);
}

// A child trains on the store and is killed with SIGKILL at a random moment; the store
// must open at a committed step whose weights are exactly the reference's after as many
// steps, with nothing left over from the step that was cut short.
// Every other round clips, so that the gradients are spilled to files until the commit
// (and written over the last step's spills).
TEST_F(TieredStore, KilledAtARandomMomentOpensAtACommittedStep) {
  constexpr int kMaxSteps = 60;
  const Data data = make_data(kMaxSteps, 11);
  const std::array<double, 2> clips{0.0, 0.05};
  std::array<std::vector<std::vector<std::vector<float>>>, 2> references;
  for (std::size_t c = 0; c < clips.size(); ++c) {
    HostModelMemory host;
    host.set_optimizer(config_of(OptimizerKind::adamw, clips[c]));
    build_sparse_mlp(host, kSizes, 0.5, 3);
    Trainer t(host, 1, Precision::fp32);
    references[c].push_back(snapshot(host));
    for (int s = 0; s < kMaxSteps; ++s) {
      t.step(data, s);
      references[c].push_back(snapshot(host));
    }
  }
  std::mt19937_64 rng(99);
  int mid_run = 0;
  for (int round = 0; round < 12; ++round) {
    const auto& reference = references[static_cast<std::size_t>(round % 2)];
    const double clip = clips[static_cast<std::size_t>(round % 2)];
    std::filesystem::remove_all(store());
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      try {
        TieredModelMemory m(store(), tight_budget());
        m.set_optimizer(config_of(OptimizerKind::adamw, clip));
        build_sparse_mlp(m, kSizes, 0.5, 3);
        Trainer t(m, 1, Precision::fp32);
        for (int s = 0; s < kMaxSteps; ++s) t.step(data, s);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    ::usleep(static_cast<useconds_t>(2000 + rng() % 150000));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (WIFSIGNALED(status)) ++mid_run;
    if (!std::filesystem::exists(store() / "MANIFEST")) continue;  // killed before creating it
    TieredModelMemory m(store(), std::int64_t{1} << 30);
    const std::int64_t step = m.step();
    ASSERT_LE(step, kMaxSteps);
    if (m.layer_count() < static_cast<std::int32_t>(kSizes.size()) - 1) {
      EXPECT_EQ(step, 0);  // killed while the layers were being added
      continue;
    }
    expect_bitwise_equal(reference[static_cast<std::size_t>(step)], snapshot(m),
                         "round " + std::to_string(round) + ", step " + std::to_string(step));
    EXPECT_EQ(files().size(), 1U + 2 * (kSizes.size() - 1)) << "leftovers not removed";
  }
  EXPECT_GT(mid_run, 0) << "no child was killed mid-run";
}

}  // namespace
}  // namespace sluice
