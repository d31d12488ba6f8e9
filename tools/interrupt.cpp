// Stopping a training run between steps on SIGINT or SIGTERM (tools/interrupt.hpp).
#include "interrupt.hpp"

#include <unistd.h>

#include <atomic>

namespace sluice::cli {
namespace {

std::atomic<int> stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "set from a signal handler");

extern "C" void ask_to_stop(int signal) {
  stop_signal.store(signal);
  // (write: what a handler may call; SA_RESETHAND has made the next one fatal)
  static const char message[] =
      "\nsluice: interrupted: stopping at the end of this step (again to stop at once)\n";
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, message, sizeof message - 1);
}

/// Installs the handler for `signal` unless the process ignores it; whether it did.
bool take(int signal, struct sigaction& old) {
  if (::sigaction(signal, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) return false;
  struct sigaction mine {};
  mine.sa_handler = ask_to_stop;
  ::sigemptyset(&mine.sa_mask);
  mine.sa_flags = SA_RESETHAND | SA_RESTART;  // the second signal: its default, at once
  return ::sigaction(signal, &mine, nullptr) == 0;
}

}  // namespace

StopOnInterrupt::StopOnInterrupt() {
  stop_signal.store(0);
  took_int_ = take(SIGINT, old_int_);
  took_term_ = take(SIGTERM, old_term_);
}

StopOnInterrupt::~StopOnInterrupt() {
  if (took_int_) ::sigaction(SIGINT, &old_int_, nullptr);
  if (took_term_) ::sigaction(SIGTERM, &old_term_, nullptr);
}

int interrupting_signal() {
  return stop_signal.load();
}

int interrupted_exit_code() {
  const int signal = interrupting_signal();
  return signal == 0 ? 0 : 128 + signal;
}

std::string interruption_note(std::int64_t steps, const std::string& checkpoint,
                              const std::string& store) {
  const int signal = interrupting_signal();
  const std::string name = signal == SIGINT    ? "SIGINT"
                           : signal == SIGTERM ? "SIGTERM"
                                               : "signal " + std::to_string(signal);
  const std::string kept = !checkpoint.empty() ? "the model is saved to " + checkpoint
                           : !store.empty()    ? "model store " + store + " holds them"
                                               : "no --checkpoint keeps them";
  return "interrupted (" + name + ") after " + std::to_string(steps) + " steps; " + kept;
}

}  // namespace sluice::cli
