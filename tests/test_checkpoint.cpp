// ModelMemory checkpoints: bit-exact round trips, corrupt files refused without touching
// the target, and a save killed at a random moment never destroys the last good one.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/crc32.hpp"  // fix_crc: edited sections keep a valid CRC
#include "sluice/model_memory.hpp"

namespace sluice {
namespace {

namespace fs = std::filesystem;

// --- helpers ------------------------------------------------------------------------------

fs::path temp_dir() {
  static const fs::path dir = [] {
    fs::path d =
        fs::temp_directory_path() / ("sluice_test_checkpoint_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

std::vector<char> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

WeightStream gradient_stream(const CsrMatrix& mask, const std::vector<float>& gradient) {
  WeightStream s;
  s.header = {StreamKind::gradient, static_cast<std::uint32_t>(mask.rows()),
              static_cast<std::uint32_t>(mask.cols()), static_cast<std::uint64_t>(mask.nnz())};
  auto chunk = std::make_shared<StreamChunk>();
  chunk->outputs = static_cast<std::uint32_t>(mask.rows());
  for (std::int64_t o = 0; o < mask.rows(); ++o) {
    for (std::int64_t k = mask.row_offsets()[o]; k < mask.row_offsets()[o + 1]; ++k) {
      chunk->packets.push_back({mask.col_indices()[k], gradient[k]});
    }
    chunk->packets.push_back({kCarriageReturn, 0.0F});
  }
  chunk->packets.push_back({kEndOfLayer, 0.0F});
  s.chunks.push_back(std::move(chunk));
  return s;
}

void train(ModelMemory& mm, int steps, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0F, 1.0F);
  for (int s = 0; s < steps; ++s) {
    for (std::int32_t l = 0; l < mm.layer_count(); ++l) {
      std::vector<float> g(static_cast<std::size_t>(mm.weights(l).nnz()));
      for (float& x : g) x = n(rng);
      std::vector<float> b(mm.bias(l).size());
      for (float& x : b) x = n(rng);
      mm.submit_gradient(l, gradient_stream(mm.weights(l), g), b);
    }
    ASSERT_TRUE(mm.commit_step().applied);
  }
}

OptimizerConfig odd_config() {
  OptimizerConfig c;
  c.kind = OptimizerKind::adamw;
  c.learning_rate = 0.0123;
  c.momentum = 0.25;  // unused by AdamW, but must survive the round trip
  c.beta1 = 0.85;
  c.beta2 = 0.995;
  c.epsilon = 3e-7;
  c.weight_decay = 0.07;
  c.clip_global_norm = 5.5;
  c.schedule = [](std::int64_t step) { return 1.0 / static_cast<double>(step); };
  c.decay.warmup_steps = 3;  // data, saved: the round trips must bring it back
  c.decay.decay_steps = 40;
  c.decay.final_fraction = 0.25;
  return c;
}

// Odd shapes: bias and none, a matrix without non-zeros, one without rows. `small` keeps
// the file around a kilobyte, for tests that try every byte.
void build(HostModelMemory& mm, std::uint64_t seed, const OptimizerConfig& config,
           bool small = false) {
  mm.set_optimizer(config);
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  std::uniform_real_distribution<float> u(-1.0F, 1.0F);
  const std::int64_t rows = small ? 7 : 23;
  std::vector<float> bias(static_cast<std::size_t>(rows));
  for (float& b : bias) b = u(rng);
  mm.add_layer(CsrMatrix::random(rows, small ? 6 : 17, 0.5, seed), bias);
  mm.add_layer(CsrMatrix::random(small ? 3 : 9, rows, 0.3, seed + 1));
  mm.add_layer(CsrMatrix(3, 4, {0, 0, 0, 0}, {}, {}), std::vector<float>(3, 0.5F));
  mm.add_layer(CsrMatrix(0, 5, {0}, {}, {}));
  mm.seed = seed * 1000 + 7;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Bit-exact equality of everything a checkpoint holds that the API shows; the optimizer
// state is compared by the test through the bytes of a second save (see RoundTrip).
void expect_same(const ModelMemory& a, const ModelMemory& b) {
  ASSERT_EQ(a.layer_count(), b.layer_count());
  EXPECT_EQ(a.step(), b.step());
  EXPECT_EQ(a.seed, b.seed);
  const OptimizerConfig& x = a.optimizer();
  const OptimizerConfig& y = b.optimizer();
  EXPECT_EQ(x.kind, y.kind);
  EXPECT_EQ(x.learning_rate, y.learning_rate);
  EXPECT_EQ(x.momentum, y.momentum);
  EXPECT_EQ(x.beta1, y.beta1);
  EXPECT_EQ(x.beta2, y.beta2);
  EXPECT_EQ(x.epsilon, y.epsilon);
  EXPECT_EQ(x.weight_decay, y.weight_decay);
  EXPECT_EQ(x.clip_global_norm, y.clip_global_norm);
  EXPECT_EQ(x.decay, y.decay);
  for (std::int32_t l = 0; l < a.layer_count(); ++l) {
    const CsrMatrix& p = a.weights(l);
    const CsrMatrix& q = b.weights(l);
    EXPECT_EQ(p.rows(), q.rows());
    EXPECT_EQ(p.cols(), q.cols());
    EXPECT_EQ(p.row_offsets(), q.row_offsets());
    EXPECT_EQ(p.col_indices(), q.col_indices());
    EXPECT_TRUE(same_bits(p.values(), q.values()));
    EXPECT_TRUE(same_bits(a.bias(l), b.bias(l)));
  }
}

// --- round trips --------------------------------------------------------------------------

TEST(Checkpoint, RoundTripIsBitExact) {
  HostModelMemory a;
  build(a, 3, odd_config());
  a.set_non_finite_policy(NonFinitePolicy::error);
  train(a, 3, 10);
  const fs::path path = temp_dir() / "roundtrip.ck";
  a.save(path);
  EXPECT_FALSE(fs::exists(path.string() + ".tmp." + std::to_string(::getpid())));

  HostModelMemory b;
  OptimizerConfig with_schedule;
  with_schedule.schedule = odd_config().schedule;  // code is not saved: the target keeps its own
  b.set_optimizer(with_schedule);
  b.load(path);
  expect_same(a, b);
  EXPECT_TRUE(static_cast<bool>(b.optimizer().schedule));

  // Optimizer state, per-layer update counts and the policy: a second save is the same file.
  const fs::path again = temp_dir() / "roundtrip2.ck";
  b.save(again);
  EXPECT_TRUE(read_bytes(path) == read_bytes(again));

  // And both train on identically.
  train(a, 1, 20);
  train(b, 1, 20);
  expect_same(a, b);

  // The policy came back too: a NaN step throws.
  std::vector<float> nan_gradient(static_cast<std::size_t>(b.weights(1).nnz()),
                                  std::numeric_limits<float>::quiet_NaN());
  b.submit_gradient(1, gradient_stream(b.weights(1), nan_gradient), {});
  EXPECT_THROW(b.commit_step(), NumericError);
}

TEST(Checkpoint, EveryOptimizerKindRoundTrips) {
  for (OptimizerKind kind : {OptimizerKind::sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
    SCOPED_TRACE(to_string(kind));
    OptimizerConfig c;
    c.kind = kind;
    c.momentum = 0.9;
    HostModelMemory a;
    build(a, 4, c);
    train(a, 2, 30);
    const fs::path path = temp_dir() / "kinds.ck";
    a.save(path);
    HostModelMemory b;
    b.load(path);
    expect_same(a, b);
    EXPECT_FALSE(static_cast<bool>(b.optimizer().schedule));
    train(a, 1, 31);
    train(b, 1, 31);
    expect_same(a, b);
  }
}

TEST(Checkpoint, EmptyModelRoundTrips) {
  HostModelMemory a;
  a.seed = 99;
  const fs::path path = temp_dir() / "empty.ck";
  a.save(path);
  HostModelMemory b;
  build(b, 5, OptimizerConfig{});
  b.load(path);
  EXPECT_EQ(b.layer_count(), 0);
  EXPECT_EQ(b.seed, 99U);
  EXPECT_EQ(b.step(), 0);
}

TEST(Checkpoint, SaveReplacesAnExistingFile) {
  HostModelMemory a, b;
  build(a, 6, OptimizerConfig{});
  build(b, 7, OptimizerConfig{});
  const fs::path path = temp_dir() / "replace.ck";
  a.save(path);
  b.save(path);
  HostModelMemory c;
  c.load(path);
  expect_same(b, c);
}

// Saving renames a new file over the path: a pipe or device there is refused, not replaced.
// is_checkpoint tells a checkpoint from the user's other files by its magic.
TEST(Checkpoint, SaveRefusesWhatIsNotAFileAndIsCheckpointTellsOne) {
  HostModelMemory a;
  build(a, 3, OptimizerConfig{});
  const fs::path pipe = temp_dir() / "pipe.ck";
  ASSERT_EQ(::mkfifo(pipe.c_str(), 0600), 0);
  EXPECT_THROW(a.save(pipe), ArgumentError);
  EXPECT_TRUE(fs::is_fifo(pipe));
  const fs::path saved = temp_dir() / "saved.ck";
  a.save(saved);
  EXPECT_TRUE(ModelMemory::is_checkpoint(saved));
  const fs::path text = temp_dir() / "text.csv";
  std::ofstream(text) << "1,2,0\n";
  EXPECT_FALSE(ModelMemory::is_checkpoint(text));
  EXPECT_FALSE(ModelMemory::is_checkpoint(temp_dir() / "none.ck"));
}

// --- refused files ------------------------------------------------------------------------

class CorruptCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    HostModelMemory source;
    build(source, 8, odd_config(), /*small=*/true);
    train(source, 2, 40);
    source.class_names = {"ant", "bee"};
    source.input_mean = {0.5, -1.0};
    source.input_scale = {2.0, 0.25};
    source.training_data = "/data/iris.csv";
    good_path = temp_dir() / "good.ck";
    source.save(good_path);
    good = read_bytes(good_path);
    // The target has different contents, which a failed load must leave alone.
    OptimizerConfig c;
    c.kind = OptimizerKind::sgd;
    c.learning_rate = 0.5;
    target.set_optimizer(c);
    target.add_layer(CsrMatrix::random(6, 6, 0.5, 77));
    train(target, 1, 50);
    target.seed = 4242;
    target_values = target.weights(0).values();
    const fs::path before_path = temp_dir() / "target_before.ck";
    target.save(before_path);
    target_before = read_bytes(before_path);
  }

  // Loads `bytes` into the target: must throw E and leave the target as it was.
  template <typename E = FormatError>
  std::string expect_refused(const std::vector<char>& bytes) {
    const fs::path p = temp_dir() / "bad.ck";
    // A fresh file each time: ext4 flushes a file that is truncated and rewritten on close,
    // which would make the thousands of cases here slow.
    fs::remove(p);
    write_bytes(p, bytes);
    std::string message;
    try {
      target.load(p);
      ADD_FAILURE() << "a corrupt file of " << bytes.size() << " bytes was accepted";
    } catch (const E& e) {
      message = e.what();
    }
    // Cheap checks every time; the full comparison once in TearDown.
    EXPECT_EQ(target.layer_count(), 1);
    EXPECT_EQ(target.step(), 1);
    EXPECT_EQ(target.seed, 4242U);
    EXPECT_EQ(target.optimizer().kind, OptimizerKind::sgd);
    EXPECT_TRUE(target.weights(0).values() == target_values);
    return message;
  }

  void TearDown() override {
    const fs::path after_path = temp_dir() / "target_after.ck";
    target.save(after_path);
    EXPECT_TRUE(read_bytes(after_path) == target_before) << "a failed load changed the target";
  }

  // Rewrites the CRC of the section that starts at `offset` (after an edit of its payload).
  void fix_crc(std::vector<char>& bytes, std::size_t offset) {
    std::uint64_t length = 0;
    std::memcpy(&length, bytes.data() + offset + 4, 8);
    const auto payload = std::as_bytes(std::span(bytes.data() + offset + 16, length));
    const std::uint32_t crc = crc32(payload);
    std::memcpy(bytes.data() + offset + 12, &crc, 4);
  }
  // The good file as `version` (below 7) writes it: without the training data section,
  // below 6 without the class names and input scaling sections, below 5 without the decay
  // section, and below 4 without the schedule section.
  std::vector<char> as_version(std::uint32_t version) {
    std::vector<char> old = good;
    std::memcpy(old.data() + 8, &version, 4);
    const std::size_t data = section(old, "DATA");
    old.erase(old.begin() + static_cast<long>(data),
              old.begin() + static_cast<long>(data + 16 + std::strlen("/data/iris.csv")));
    if (version < 6) {
      const std::size_t names = section(old, "CLAS");
      old.erase(old.begin() + static_cast<long>(names),
                old.begin() + static_cast<long>(names + 16 + 8 + 16 + 8 + 2 * 16));
    }
    if (version < 5) {
      const std::size_t decay = section(old, "LRDC");
      old.erase(old.begin() + static_cast<long>(decay),
                old.begin() + static_cast<long>(decay + 16 + 24));
    }
    if (version < 4) {
      const std::size_t schedule = section(old, "DYNS");
      old.erase(old.begin() + static_cast<long>(schedule),
                old.begin() + static_cast<long>(schedule + 16 + 44));
    }
    return old;
  }
  // What loading the good file throws with `value` at byte `field` of the payload of its
  // section `tag` (the section's CRC fixed, so the field's check is what refuses it).
  template <typename T>
  std::string refused_at(const char* tag, std::size_t field, T value) {
    const std::size_t at = section(good, tag);
    std::vector<char> bad = good;
    std::memcpy(bad.data() + at + 16 + field, &value, sizeof value);
    fix_crc(bad, at);
    return expect_refused(bad);
  }
  // Offset of the first section with this tag.
  std::size_t section(const std::vector<char>& bytes, const char* tag) {
    std::size_t at = 12;
    while (at + 16 <= bytes.size()) {
      if (std::memcmp(bytes.data() + at, tag, 4) == 0) return at;
      std::uint64_t length = 0;
      std::memcpy(&length, bytes.data() + at + 4, 8);
      at += 16 + length;
    }
    ADD_FAILURE() << "no section " << tag;
    return 0;
  }

  fs::path good_path;
  std::vector<char> good;
  HostModelMemory target;
  std::vector<float> target_values;
  std::vector<char> target_before;
};

TEST_F(CorruptCheckpoint, TheGoodFileLoads) {
  HostModelMemory m;
  EXPECT_NO_THROW(m.load(good_path));
}

TEST_F(CorruptCheckpoint, EveryTruncationIsRefused) {
  ASSERT_LT(good.size(), 2000U) << "keep the file small: every length is tried";
  for (std::size_t n = 0; n < good.size(); ++n) {
    SCOPED_TRACE(n);
    expect_refused(std::vector<char>(good.begin(), good.begin() + static_cast<long>(n)));
    if (HasFailure()) break;
  }
}

TEST_F(CorruptCheckpoint, EveryFlippedByteIsRefused) {
  for (std::size_t i = 0; i < good.size(); ++i) {
    SCOPED_TRACE(i);
    std::vector<char> bad = good;
    bad[i] = static_cast<char>(bad[i] ^ (1 << (i % 8)));
    expect_refused(bad);
    if (HasFailure()) break;
  }
}

TEST_F(CorruptCheckpoint, WrongMagic) {
  std::vector<char> bad = good;
  std::memcpy(bad.data(), "SLUICEXX", 8);
  EXPECT_NE(expect_refused(bad).find("magic"), std::string::npos);
  EXPECT_NE(expect_refused(std::vector<char>(1000, 'x')).find("magic"), std::string::npos);
}

TEST_F(CorruptCheckpoint, WrongVersion) {
  std::vector<char> bad = good;
  const std::uint32_t version = 8;
  std::memcpy(bad.data() + 8, &version, 4);
  const std::string message = expect_refused(bad);
  EXPECT_NE(message.find("version 8, expected 1 to 7"), std::string::npos) << message;
}

TEST_F(CorruptCheckpoint, CountersOutOfRangeAreRefused) {
  const std::size_t head = section(good, "HEAD");
  const std::size_t layer = section(good, "LAYR");
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  std::vector<char> bad = good;  // the step count at INT64_MAX would overflow at the next step
  std::memcpy(bad.data() + head + 16 + 4, &huge, 8);
  fix_crc(bad, head);
  EXPECT_NE(expect_refused(bad).find("step 9223372036854775807 out of range"), std::string::npos);

  bad = good;  // the epochs, last in the header
  std::uint64_t head_length = 0;
  std::memcpy(&head_length, good.data() + head + 4, 8);
  std::memcpy(bad.data() + head + 16 + head_length - 8, &huge, 8);
  fix_crc(bad, head);
  EXPECT_NE(expect_refused(bad).find("epochs"), std::string::npos);

  bad = good;                      // a layer updated more often than there were steps
  const std::int64_t updates = 3;  // two steps taken
  std::memcpy(bad.data() + layer + 16 + 4 + 8 * 4 + 4, &updates, 8);
  fix_crc(bad, layer);
  EXPECT_NE(expect_refused(bad).find("updates 3 exceed the 2 steps"), std::string::npos);

  bad = good;  // the schedule flag is 0 or 1
  const std::uint32_t flag = 7;
  std::memcpy(bad.data() + head + 16 + head_length - 12, &flag, 4);
  fix_crc(bad, head);
  EXPECT_NE(expect_refused(bad).find("schedule flag 7"), std::string::npos);
}

TEST_F(CorruptCheckpoint, VersionOneFilesStillLoadWithNoEpochs) {
  // Version 1: the same, less the model and schedule sections and the header's last 8
  // bytes (the epochs).
  std::vector<char> old = as_version(1);
  const std::size_t model = section(old, "MODL");
  old.erase(old.begin() + static_cast<long>(model), old.begin() + static_cast<long>(model + 16));
  const std::size_t head = section(old, "HEAD");
  std::uint64_t length = 0;
  std::memcpy(&length, old.data() + head + 4, 8);
  old.erase(old.begin() + static_cast<long>(head + 16 + length - 8),
            old.begin() + static_cast<long>(head + 16 + length));
  length -= 8;
  std::memcpy(old.data() + head + 4, &length, 8);
  fix_crc(old, head);
  const fs::path p = temp_dir() / "v1.ck";
  write_bytes(p, old);
  HostModelMemory m;
  m.epochs = 12;
  m.load(p);
  EXPECT_EQ(m.epochs, 0);
  EXPECT_EQ(m.step(), 2);
}

TEST_F(CorruptCheckpoint, ScheduleFieldsOutOfRangeAreRefused) {
  const std::size_t at = section(good, "DYNS") + 16;  // its payload
  auto refused_with = [&](std::size_t field, auto value) {
    return refused_at("DYNS", field, value);
  };
  EXPECT_NE(refused_with(0, std::uint32_t{3}).find("unknown dynamic sparsity rule 3"),
            std::string::npos);
  EXPECT_NE(refused_with(4, std::int64_t{0}).find("update_every"), std::string::npos);
  EXPECT_NE(refused_with(4, std::int64_t{1} << 41).find("update_every"), std::string::npos);
  EXPECT_NE(refused_with(12, 1.5).find("drop"), std::string::npos);
  EXPECT_NE(refused_with(12, std::numeric_limits<double>::quiet_NaN()).find("drop"),
            std::string::npos);
  EXPECT_NE(refused_with(20, -0.25).find("update_until"), std::string::npos);
  EXPECT_NE(refused_with(28, std::int64_t{-1}).find("total_steps"), std::string::npos);
  EXPECT_NE(refused_with(28, std::numeric_limits<std::int64_t>::max()).find("total_steps"),
            std::string::npos);
  // A rule other than none needs a horizon.
  std::vector<char> bad = good;
  const std::uint32_t rigl = 2;
  const std::int64_t no_horizon = 0;
  std::memcpy(bad.data() + at, &rigl, 4);
  std::memcpy(bad.data() + at + 28, &no_horizon, 8);
  fix_crc(bad, at - 16);
  EXPECT_NE(expect_refused(bad).find("total_steps"), std::string::npos);
}

TEST_F(CorruptCheckpoint, VersionThreeFilesStillLoadWithNoSchedule) {
  const fs::path p = temp_dir() / "v3.ck";
  write_bytes(p, as_version(3));
  HostModelMemory m;
  m.dynamic.rule = MaskUpdateRule::set;
  m.load(p);
  EXPECT_EQ(m.dynamic.rule, MaskUpdateRule::none);
  EXPECT_EQ(m.step(), 2);
}

TEST_F(CorruptCheckpoint, VersionFourFilesStillLoadWithNoDecay) {
  const fs::path p = temp_dir() / "v4.ck";
  write_bytes(p, as_version(4));
  HostModelMemory m;
  m.load(p);
  EXPECT_FALSE(m.optimizer().decay.active());
  EXPECT_EQ(m.optimizer().decay, LearningRateDecay{});
  EXPECT_EQ(m.step(), 2);
}

TEST_F(CorruptCheckpoint, VersionFiveFilesStillLoadWithNoClassNames) {
  const fs::path p = temp_dir() / "v5.ck";
  write_bytes(p, as_version(5));
  HostModelMemory m;
  m.class_names = {"kept from before"};
  m.input_mean = m.input_scale = {1.0};
  m.load(p);
  EXPECT_TRUE(m.class_names.empty());
  EXPECT_TRUE(m.input_mean.empty());
  EXPECT_TRUE(m.input_scale.empty());
  EXPECT_EQ(m.step(), 2);
  m.load(good_path);
  EXPECT_EQ(m.class_names, (std::vector<std::string>{"ant", "bee"}));
  EXPECT_EQ(m.input_mean, (std::vector<double>{0.5, -1.0}));
  EXPECT_EQ(m.input_scale, (std::vector<double>{2.0, 0.25}));
}

TEST_F(CorruptCheckpoint, VersionSixFilesStillLoadWithNoTrainingData) {
  const fs::path p = temp_dir() / "v6.ck";
  write_bytes(p, as_version(6));
  HostModelMemory m;
  m.training_data = "kept from before";
  m.load(p);
  EXPECT_EQ(m.training_data, "");
  EXPECT_EQ(m.class_names, (std::vector<std::string>{"ant", "bee"}));
  m.load(good_path);
  EXPECT_EQ(m.training_data, "/data/iris.csv");
}

// The training data section holds "/data/iris.csv".
TEST_F(CorruptCheckpoint, ATrainingDataNameWithANulIsRefused) {
  const std::string message = refused_at("DATA", 5, '\0');
  EXPECT_NE(message.find("training data section"), std::string::npos) << message;
  EXPECT_NE(message.find("holds a NUL"), std::string::npos) << message;
}

// The input scaling section holds count 2, means {0.5, -1}, scales {2, 0.25}.
TEST_F(CorruptCheckpoint, InputScalingAWriterWouldRefuseIsRefused) {
  EXPECT_NE(refused_at("SCAL", 0, std::uint64_t{3}).find("does not hold 3 inputs"),
            std::string::npos);
  EXPECT_NE(refused_at("SCAL", 0, std::uint64_t{1} << 60).find("does not hold"), std::string::npos);
  EXPECT_NE(refused_at("SCAL", 8, std::numeric_limits<double>::infinity()).find("input 0's mean"),
            std::string::npos);
  EXPECT_NE(refused_at("SCAL", 32, 0.0).find("input 1's mean"), std::string::npos);
  EXPECT_NE(refused_at("SCAL", 24, -2.0).find("positive scale"), std::string::npos);
}

// The class names section holds "ant\0bee\0": each edit keeps its length (the CRC fixed).
TEST_F(CorruptCheckpoint, ClassNamesAWriterWouldRefuseAreRefused) {
  EXPECT_NE(refused_at("CLAS", 7, 'x').find("the last class name is not ended"), std::string::npos);
  const std::string repeated = refused_at("CLAS", 4, std::array<char, 3>{'a', 'n', 't'});
  EXPECT_NE(repeated.find("class name 1 repeats an earlier one"), std::string::npos) << repeated;
  EXPECT_NE(refused_at("CLAS", 0, std::array<char, 4>{'\0', 'n', 't', '\0'}).find("is empty"),
            std::string::npos);
}

TEST_F(CorruptCheckpoint, DecayFieldsOutOfRangeAreRefused) {
  auto refused_with = [&](std::size_t field, auto value) {
    return refused_at("LRDC", field, value);
  };
  EXPECT_NE(refused_with(0, std::int64_t{-1}).find("warmup_steps -1"), std::string::npos);
  EXPECT_NE(refused_with(0, std::int64_t{40}).find("decay_steps 40"),
            std::string::npos);  // not after warmup
  EXPECT_NE(refused_with(8, std::int64_t{-5}).find("decay_steps -5"), std::string::npos);
  EXPECT_NE(refused_with(8, std::numeric_limits<std::int64_t>::max()).find("decay_steps"),
            std::string::npos);
  EXPECT_NE(refused_with(16, 1.5).find("final_fraction"), std::string::npos);
  EXPECT_NE(refused_with(16, std::numeric_limits<double>::quiet_NaN()).find("final_fraction"),
            std::string::npos);
}

TEST(Checkpoint, TheMaskUpdateScheduleRoundTrips) {
  HostModelMemory a;
  build(a, 3, OptimizerConfig{});
  a.dynamic.rule = MaskUpdateRule::rigl;
  a.dynamic.update_every = 7;
  a.dynamic.drop = 0.125;
  a.dynamic.update_until = 0.5;
  a.dynamic.total_steps = 1234;
  a.dynamic.seed = 99;
  const fs::path path = temp_dir() / "schedule.ck";
  a.save(path);
  HostModelMemory b;
  b.load(path);
  EXPECT_EQ(b.dynamic.rule, MaskUpdateRule::rigl);
  EXPECT_EQ(b.dynamic.update_every, 7);
  EXPECT_EQ(b.dynamic.drop, 0.125);
  EXPECT_EQ(b.dynamic.update_until, 0.5);
  EXPECT_EQ(b.dynamic.total_steps, 1234);
  EXPECT_EQ(b.dynamic.seed, 99U);
}

TEST(Checkpoint, ModelDescriptionRoundTrips) {
  HostModelMemory a;
  build(a, 3, OptimizerConfig{});
  a.model = "gpt vocab=256 context=8 d_model=16 heads=2 blocks=1";
  const fs::path path = temp_dir() / "model.ck";
  a.save(path);
  HostModelMemory b;
  b.model = "something else";
  b.load(path);
  EXPECT_EQ(b.model, a.model);
  a.model = "";  // a stack of layers: empty, and loading it clears the target's
  a.save(path);
  b.load(path);
  EXPECT_EQ(b.model, "");
}

TEST(Checkpoint, AModelDescriptionACheckpointCannotHoldIsRefusedBeforeWriting) {
  HostModelMemory a;
  build(a, 3, OptimizerConfig{});
  const fs::path path = temp_dir() / "bad_model.ck";
  a.model = "line\nbreak";
  EXPECT_THROW(a.save(path), ShapeError);
  a.model = std::string(ModelMemory::kMaxModelDescription + 1, 'x');
  EXPECT_THROW(a.save(path), ShapeError);
  EXPECT_FALSE(fs::exists(path));
}

TEST(Checkpoint, ClassNamesScalingAndDataRoundTripAndWhatACheckpointCannotHoldIsRefused) {
  HostModelMemory a;
  build(a, 3, OptimizerConfig{});
  a.class_names = {"setosa", "versicolor", "Iris virginica \xc3\xa9"};  // any bytes but NUL
  const fs::path path = temp_dir() / "names.ck";
  a.save(path);
  HostModelMemory b;
  b.class_names = {"other"};
  b.load(path);
  EXPECT_EQ(b.class_names, a.class_names);
  a.class_names.clear();  // classes by number: loading it clears the target's
  a.save(path);
  b.load(path);
  EXPECT_TRUE(b.class_names.empty());
  a.input_mean = {1.5, -0.0, 1e300};  // the standardisation an MLP's inputs had
  a.input_scale = {0.5, 1.0, 1e-300};
  a.save(path);
  b.load(path);
  EXPECT_EQ(b.input_mean, a.input_mean);
  EXPECT_EQ(b.input_scale, a.input_scale);
  a.training_data = "/home/u/data \xff.csv";  // a path's bytes, whatever they are
  a.save(path);
  b.load(path);
  EXPECT_EQ(b.training_data, a.training_data);
  const fs::path refused = temp_dir() / "bad_names.ck";
  for (const std::string& bad :
       {std::string("a\0b", 3), std::string(HostModelMemory::kMaxTrainingData + 1, 'x')}) {
    a.training_data = bad;
    EXPECT_THROW(a.save(refused), ShapeError);
  }
  a.training_data.clear();
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"a", "b", "a"}, std::vector<std::string>{"a", ""},
        std::vector<std::string>{std::string("a\0b", 3)}}) {
    a.class_names = bad;
    EXPECT_THROW(a.save(refused), ShapeError);
  }
  a.class_names.clear();
  for (const auto& [mean, scale] :
       {std::pair{std::vector<double>{1.0}, std::vector<double>{}},
        std::pair{std::vector<double>{1.0}, std::vector<double>{0.0}},
        std::pair{std::vector<double>{std::nan("")}, std::vector<double>{1.0}}}) {
    a.input_mean = mean;
    a.input_scale = scale;
    EXPECT_THROW(a.save(refused), ShapeError);
  }
  EXPECT_FALSE(fs::exists(refused));
}

TEST(Checkpoint, EpochsRoundTrip) {
  HostModelMemory a;
  build(a, 3, OptimizerConfig{});
  a.epochs = 17;
  const fs::path path = temp_dir() / "epochs.ck";
  a.save(path);
  HostModelMemory b;
  b.load(path);
  EXPECT_EQ(b.epochs, 17);
}

TEST_F(CorruptCheckpoint, TrailingBytes) {
  std::vector<char> bad = good;
  bad.push_back(0);
  expect_refused(bad);
}

TEST_F(CorruptCheckpoint, HugeLengthsAreRefusedBeforeAllocating) {
  // A section length beyond the file.
  std::vector<char> bad = good;
  const std::size_t layer = section(bad, "LAYR");
  const std::uint64_t huge = std::uint64_t{1} << 62;
  std::memcpy(bad.data() + layer + 4, &huge, 8);
  EXPECT_NE(expect_refused(bad).find("claims"), std::string::npos);

  // A non-zero count that would need exabytes, with a valid CRC: refused by the length check.
  bad = good;
  std::memcpy(bad.data() + layer + 16 + 20, &huge, 8);
  fix_crc(bad, layer);
  EXPECT_NE(expect_refused(bad).find("does not match"), std::string::npos);

  // A layer count far beyond what the file can hold.
  bad = good;
  const std::size_t head = section(bad, "HEAD");
  const std::uint32_t many = 0x7FFFFFFF;
  std::memcpy(bad.data() + head + 16, &many, 4);
  fix_crc(bad, head);
  expect_refused(bad);
}

TEST_F(CorruptCheckpoint, InvalidContentWithValidCrcIsRefused) {
  const std::size_t layer = section(good, "LAYR");
  std::int64_t rows = 0, nnz = 0;
  std::memcpy(&rows, good.data() + layer + 16 + 4, 8);
  std::memcpy(&nnz, good.data() + layer + 16 + 20, 8);
  const std::size_t fixed = 16 + 4 + 8 * 4 + 4 + 8;
  const std::size_t indices = layer + fixed + static_cast<std::size_t>(rows + 1) * 8;
  const std::size_t values = indices + static_cast<std::size_t>(nnz) * 4;
  ASSERT_GE(nnz, 2);

  std::vector<char> bad = good;  // column index out of range
  const std::uint32_t col = 1000;
  std::memcpy(bad.data() + indices, &col, 4);
  fix_crc(bad, layer);
  EXPECT_NE(expect_refused(bad).find("layer 0"), std::string::npos);

  bad = good;  // indices not increasing within a row (the first row with two or more)
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t begin = 0, end = 0;
    std::memcpy(&begin, good.data() + layer + fixed + static_cast<std::size_t>(r) * 8, 8);
    std::memcpy(&end, good.data() + layer + fixed + static_cast<std::size_t>(r + 1) * 8, 8);
    if (end - begin < 2) continue;
    const std::size_t at = indices + static_cast<std::size_t>(begin) * 4;
    std::memcpy(bad.data() + at + 4, bad.data() + at, 4);
    break;
  }
  ASSERT_TRUE(bad != good);
  fix_crc(bad, layer);
  expect_refused(bad);

  bad = good;  // a NaN weight
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad.data() + values, &nan, 4);
  fix_crc(bad, layer);
  expect_refused(bad);

  bad = good;  // row offsets not monotone
  const std::int64_t offset = nnz + 5;
  std::memcpy(bad.data() + layer + fixed + 8, &offset, 8);
  fix_crc(bad, layer);
  expect_refused(bad);

  bad = good;  // an unknown optimizer kind in the header
  const std::size_t head = section(bad, "HEAD");
  const std::uint32_t kind = 9;
  std::memcpy(bad.data() + head + 16 + 20, &kind, 4);
  fix_crc(bad, head);
  EXPECT_NE(expect_refused(bad).find("optimizer kind"), std::string::npos);
}

TEST_F(CorruptCheckpoint, MissingFileIsAnIoError) {
  EXPECT_THROW(target.load(temp_dir() / "does_not_exist.ck"), IoError);
  EXPECT_EQ(target.seed, 4242U);
}

TEST(Checkpoint, SaveIntoMissingDirectoryIsAnIoErrorAndLeavesNothing) {
  HostModelMemory a;
  build(a, 9, OptimizerConfig{});
  const fs::path dir = temp_dir() / "no_such_dir";
  EXPECT_THROW(a.save(dir / "x.ck"), IoError);
  EXPECT_FALSE(fs::exists(dir));
}

TEST(Checkpoint, StrayTemporaryFileIsNotMistakenForTheCheckpoint) {
  HostModelMemory a;
  build(a, 10, OptimizerConfig{});
  const fs::path path = temp_dir() / "stray.ck";
  a.save(path);
  // A half-written file from a crashed saver (another pid), next to the real one.
  std::vector<char> half = read_bytes(path);
  half.resize(half.size() / 2);
  write_bytes(path.string() + ".tmp.999999", half);
  HostModelMemory b;
  b.load(path);
  expect_same(a, b);
  EXPECT_THROW(b.load(path.string() + ".tmp.999999"), FormatError);
  expect_same(a, b);
}

TEST(Checkpoint, SaveRemovesTemporaryFilesOfDeadSaversOnly) {
  HostModelMemory a;
  build(a, 11, OptimizerConfig{});
  const fs::path path = temp_dir() / "stale.ck";
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ::waitpid(dead, nullptr, 0);
  const fs::path of_dead = path.string() + ".tmp." + std::to_string(dead);
  const fs::path of_live = path.string() + ".tmp." + std::to_string(::getppid());
  const fs::path other = temp_dir() / ("other.ck.tmp." + std::to_string(dead));
  for (const auto& p : {of_dead, of_live, other}) write_bytes(p, {'x'});
  a.save(path);
  EXPECT_FALSE(fs::exists(of_dead));
  EXPECT_TRUE(fs::exists(of_live)) << "a live process may be saving";
  EXPECT_TRUE(fs::exists(other)) << "another checkpoint's file";
  for (const auto& p : {of_live, other}) fs::remove(p);
}

// --- crash safety ---------------------------------------------------------------------------

// A child saves large checkpoints over the file in a loop and is killed with SIGKILL at a
// random moment; the file must then load and be one of the saved states.
TEST(Checkpoint, SaveKilledAtARandomMomentLeavesAGoodCheckpoint) {
  // About 24 MB: 1.5M non-zeros with Adam state (values, indices, m, v).
  CsrMatrix pattern = CsrMatrix::random(1500, 2000, 0.5, 123);
  HostModelMemory a, b;
  a.set_optimizer(OptimizerConfig{});
  b.set_optimizer(OptimizerConfig{});
  a.add_layer(pattern);
  pattern.fill_values(456);
  b.add_layer(pattern);
  a.seed = 1;
  b.seed = 2;
  const std::vector<float>& a_values = a.weights(0).values();
  const std::vector<float>& b_values = b.weights(0).values();
  ASSERT_NE(a_values, b_values);

  const fs::path dir = temp_dir() / "kill";
  fs::create_directories(dir);
  const fs::path path = dir / "model.ck";
  const auto t0 = std::chrono::steady_clock::now();
  a.save(path);
  const double save_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_GT(fs::file_size(path), 20'000'000U);

  std::mt19937 rng(2024);
  std::uniform_real_distribution<double> delay(0.0, 2.5 * save_ms + 1.0);
  int saw_a = 0, saw_b = 0;
  for (int iteration = 0; iteration < 6; ++iteration) {
    SCOPED_TRACE(iteration);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // The child only saves, alternating B and A, until it is killed.
      try {
        for (;;) {
          b.save(path);
          a.save(path);
        }
      } catch (...) {
        ::_exit(3);
      }
    }
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(delay(rng)));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saver exited by itself, status " << status;

    HostModelMemory loaded;
    ASSERT_NO_THROW(loaded.load(path));
    ASSERT_EQ(loaded.layer_count(), 1);
    const std::vector<float>& v = loaded.weights(0).values();
    const bool is_a = loaded.seed == 1 && v == a_values;
    const bool is_b = loaded.seed == 2 && v == b_values;
    EXPECT_TRUE(is_a || is_b) << "the checkpoint is neither of the saved states";
    saw_a += is_a;
    saw_b += is_b;
  }
  // The killed saver leaves its temporary file behind; it never replaced the checkpoint.
  int strays = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path() == path) continue;
    EXPECT_NE(entry.path().filename().string().find("model.ck.tmp."), std::string::npos)
        << entry.path();
    ++strays;
    fs::remove(entry.path());
  }
  std::cout << "[          ] save " << save_ms << " ms; checkpoint was A " << saw_a << "x, B "
            << saw_b << "x; " << strays << " stray temporary file(s)\n";
}

struct CleanUp : ::testing::Environment {
  void TearDown() override { fs::remove_all(temp_dir()); }
};
const auto* const clean_up = ::testing::AddGlobalTestEnvironment(new CleanUp);

}  // namespace
}  // namespace sluice
