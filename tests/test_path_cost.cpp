// PathCosts, the engine's choice between its streamed and dense paths: the constants built
// in per bf16 unit, and a machine's own in a file (read back as written, a bad one refused
// naming the file and the key).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "sluice/error.hpp"
#include "sluice/path_cost.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using sluice::Bf16Unit;
using sluice::PathCosts;
using sluice::Precision;

class PathCostFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("sluice-path-cost-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path write(const std::string& text) {
    const fs::path file = dir_ / "costs.json";
    std::ofstream(file) << text;
    return file;
  }
  fs::path dir_;
};

void expect_same(const PathCosts& a, const PathCosts& b) {
  EXPECT_EQ(a.sparse_per_nnz_token, b.sparse_per_nnz_token);
  EXPECT_EQ(a.sparse_per_nnz, b.sparse_per_nnz);
  EXPECT_EQ(a.dense_per_mac, b.dense_per_mac);
  EXPECT_EQ(a.densify_per_slot, b.densify_per_slot);
  EXPECT_EQ(a.densify_per_packet, b.densify_per_packet);
}

TEST(PathCostsBuiltIn, EachUnitHasACrossoverAndBf16WithoutOneRunsAtFp32sRate) {
  for (const Bf16Unit unit : {Bf16Unit::none, Bf16Unit::avx512_bf16, Bf16Unit::amx}) {
    const PathCosts c = PathCosts::measured_with(unit);
    for (const Precision p : {Precision::fp32, Precision::bf16}) {
      const double crossover = c.crossover_sparsity(256, p);
      EXPECT_GT(crossover, 0.3);
      EXPECT_LT(crossover, 0.95);
      // However narrow the batch, a 99% sparse layer is streamed. (A dense one is not
      // always: on the Zen 5 densifying a bf16 layer for one token beat streaming it.)
      EXPECT_EQ(c.choose(4096, 4096, 0.01 * 4096 * 4096, 1, p, 2), sluice::ProductPath::sparse);
    }
  }
  const PathCosts none = PathCosts::measured_with(Bf16Unit::none);
  EXPECT_EQ(none.dense_per_mac[1], none.dense_per_mac[0]);
  // Matrix units multiply bf16 faster than the vector units do.
  EXPECT_LT(PathCosts::measured_with(Bf16Unit::amx).dense_per_mac[1],
            PathCosts::measured_with(Bf16Unit::avx512_bf16).dense_per_mac[1]);
  if (std::getenv("SLUICE_PATH_COSTS") == nullptr) {
    expect_same(PathCosts::for_this_cpu(),
                PathCosts::measured_with(PathCosts::this_cpus_bf16_unit()));
  }
}

TEST_F(PathCostFile, WhatToJsonWritesReadsBackExactly) {
  PathCosts c = PathCosts::measured_with(Bf16Unit::avx512_bf16);
  c.sparse_per_nnz_token = {1.2345678901234567e-11, 3e-11};
  c.densify_per_packet = {0, 7.25e-10};
  c.sparse_per_nnz = {6.5e-10, 0};
  const fs::path file = write(c.to_json());
  expect_same(PathCosts::read(file, PathCosts::measured_with(Bf16Unit::none)), c);
}

TEST_F(PathCostFile, APrecisionTheFileLeavesOutKeepsTheBase) {
  const PathCosts base = PathCosts::measured_with(Bf16Unit::amx);
  const fs::path file = write(R"({"format": "sluice path costs", "version": 1,
    "bf16": {"sparse_per_nnz_token": 2e-11, "dense_per_mac": 6e-12, "sparse_per_nnz": 5e-10,
             "densify_per_slot": 0, "densify_per_packet": 1e-10}})");
  const PathCosts c = PathCosts::read(file, base);
  EXPECT_EQ(c.sparse_per_nnz_token[0], base.sparse_per_nnz_token[0]);
  EXPECT_EQ(c.dense_per_mac[0], base.dense_per_mac[0]);
  EXPECT_EQ(c.sparse_per_nnz_token[1], 2e-11);
  EXPECT_EQ(c.dense_per_mac[1], 6e-12);
  EXPECT_EQ(c.sparse_per_nnz[1], 5e-10);
  EXPECT_EQ(c.densify_per_slot[1], 0);
  EXPECT_EQ(c.densify_per_packet[1], 1e-10);
}

TEST_F(PathCostFile, ABadFileIsRefusedNamingItAndTheKey) {
  const std::string head = R"({"format": "sluice path costs", "version": 1, )";
  const std::string terms =
      R"("dense_per_mac": 6e-12, "sparse_per_nnz": 0, "densify_per_slot": 0, )"
      R"("densify_per_packet": 1e-10)";
  const struct {
    std::string text, names;
  } cases[] = {
      {"", "not JSON"},
      {"{", "not JSON"},
      {"[1, 2]", "not a JSON object"},
      {R"({"format": "other", "version": 1})", "\"format\""},
      {R"({"format": "sluice path costs", "version": 2})", "\"version\""},
      {R"({"format": "sluice path costs"})", "\"version\""},
      {R"({"format": "sluice path costs", "version": 1})", "neither"},
      {head + R"("fp16": {}})", "unknown key \"fp16\""},
      {head + R"("fp32": 3})", "\"fp32\" is not an object"},
      {head + R"("fp32": {)" + terms + "}}", "\"fp32\".\"sparse_per_nnz_token\" is missing"},
      {head + R"("bf16": {"sparse_per_nnz_token": "fast", )" + terms + "}}",
       "\"bf16\".\"sparse_per_nnz_token\" is not a number"},
      {head + R"("bf16": {"sparse_per_nnz_token": 0, )" + terms + "}}",
       "\"bf16\".\"sparse_per_nnz_token\" is 0"},
      {head + R"("bf16": {"sparse_per_nnz_token": 1e-11, "extra": 1, )" + terms + "}}",
       "unknown term \"extra\""},
      {head + R"("fp32": {"sparse_per_nnz_token": 1e-11, "dense_per_mac": 6e-12, )"
              R"("sparse_per_nnz": 0, "densify_per_slot": -1e-12, "densify_per_packet": 1e-10}})",
       "\"fp32\".\"densify_per_slot\" is -1e-12"},
  };
  for (const auto& c : cases) {
    const fs::path file = write(c.text);
    try {
      PathCosts::read(file, PathCosts{});
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const sluice::FormatError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(file.string()), std::string::npos) << message;
      EXPECT_NE(message.find(c.names), std::string::npos) << message;
    }
  }
  EXPECT_THROW(PathCosts::read(dir_ / "missing.json", PathCosts{}), sluice::IoError);
}

}  // namespace
