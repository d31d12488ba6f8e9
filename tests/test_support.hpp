#pragma once
// Helpers the test files share: expected exceptions with their messages, a private
// temporary directory per test, and running the real `sluice` binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <set>
#include <sstream>
#include <string>

#include "sluice/csr_matrix.hpp"
#include "sluice/isa.hpp"

namespace sluice {
/// Names an ISA in test output (test names, failure messages) instead of its bytes.
inline void PrintTo(Isa isa, std::ostream* os) {
  *os << to_string(isa);
}
}  // namespace sluice

namespace sluice::testing {

/// The positions (row * cols + col) of w's non-zeros.
inline std::set<std::int64_t> active_positions(const CsrMatrix& w) {
  std::set<std::int64_t> out;
  for (std::int64_t r = 0; r < w.rows(); ++r) {
    for (std::int64_t k = w.row_offsets()[r]; k < w.row_offsets()[r + 1]; ++k) {
      out.insert(r * w.cols() + w.col_indices()[k]);
    }
  }
  return out;
}

/// Whether this build runs under AddressSanitizer or ThreadSanitizer (the test binaries and
/// the `sluice` they run are built alike). Their shadow memory reserves terabytes of address
/// space, so no process of theirs starts under an RLIMIT_AS, and ASan's quarantine keeps
/// freed memory resident, so peak RSS says nothing of what the code frees.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif
#else
inline constexpr bool kUnderSanitizer = false;
#endif

/// Runs `body`, expects it to throw exactly `E`, returns the message.
template <typename E, typename F>
std::string thrown_message(F&& body) {
  try {
    body();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "did not throw";
  return {};
}

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE((text).find(part), std::string::npos) << "message: " << (text)

/// A fresh, empty directory named after the running test, removed when the test ends.
/// Made by mkdtemp: a name of the test and the pid alone could be a directory that a killed
/// earlier run left behind under a pid now reused, and a store found there is resumed.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string("sluice-") + info->test_suite_name() + "-" + info->name() + "-" +
                       std::to_string(::getpid()) + "-XXXXXX";
    std::replace(name.begin(), name.end(), '/', '_');  // parameterised tests' names hold '/'
    std::string path = (std::filesystem::temp_directory_path() / name).string();
    ASSERT_NE(::mkdtemp(path.data()), nullptr) << path << ": " << std::strerror(errno);
    dir_ = path;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::filesystem::path dir_;
};

#ifdef SLUICE_CLI_PATH
/// A TempDirTest of the `sluice` binary, skipped when the CLI is not built.
class CliDirTest : public TempDirTest {
 protected:
  void SetUp() override {
    if (std::string(SLUICE_CLI_PATH).empty()) GTEST_SKIP() << "the CLI is not built";
    TempDirTest::SetUp();
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
};
#endif

/// The whole content of a file ("" when it cannot be read).
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct CliOutcome {
  int exit_code = -1;  // -1: killed by a signal; 124: timed out (timeout's code)
  std::string output;
};

/// Runs `sluice <args>` with a time limit; `merge_stderr` false keeps stdout alone.
inline CliOutcome run_cli(const std::string& cli, const std::string& args,
                          bool merge_stderr = true) {
  const std::string command =
      "timeout 120 " + cli + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  CliOutcome out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  std::array<char, 4096> buf{};  // read as bytes: an output may hold NULs (generated text)
  for (std::size_t n; (n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0;) {
    out.output.append(buf.data(), n);
  }
  const int status = pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

/// Every ISA the kernels are written for, whatever this CPU runs: a suite over them shows
/// an ISA the CPU lacks as skipped, never leaves it out unseen.
inline constexpr std::array<Isa, 3> kAllIsas = {Isa::scalar, Isa::avx2, Isa::avx512};

/// Base of the suites parameterised by ISA (over kAllIsas): skips the ISAs this CPU
/// cannot run, saying so.
class ByIsa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam())) {
      GTEST_SKIP() << "this CPU cannot run the " << to_string(GetParam()) << " kernels";
    }
  }
};

}  // namespace sluice::testing
