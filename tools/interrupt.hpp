#pragma once
// Ctrl-C (SIGINT) or SIGTERM during a training run: the run ends at the end of the step it
// is in and keeps what it trained (its checkpoint is written, its store is committed), as
// when its steps run out, instead of losing every step since it began. A second signal
// ends the process at once, as the first would have by default.
#include <signal.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sluice::cli {

/// Takes SIGINT and SIGTERM while it lives, and gives back the handlers it found. A signal
/// the process ignores (a job started in the background, under nohup) stays ignored.
class StopOnInterrupt {
 public:
  StopOnInterrupt();
  ~StopOnInterrupt();
  StopOnInterrupt(const StopOnInterrupt&) = delete;
  StopOnInterrupt& operator=(const StopOnInterrupt&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
  bool took_int_ = false;
  bool took_term_ = false;
};

/// The signal that asked the run to stop since the StopOnInterrupt began; 0 if none.
int interrupting_signal();

/// 128 + that signal, as a shell reports a process the signal ended; 0 if none came.
int interrupted_exit_code();

/// What a run a signal stopped says: which signal, after how many steps, and where the
/// model was kept (`checkpoint` or `store`, either may be empty).
std::string interruption_note(std::int64_t steps, const std::string& checkpoint,
                              const std::string& store);

/// A signal stopped the run before it had trained anything to keep; the CLI exits with
/// interrupted_exit_code().
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace sluice::cli
