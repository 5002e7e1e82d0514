// pipeoffload/backend/failure.hpp: how a device fails, once for backend::Cpu and backend::Cuda:
// the first failure's message, abort(), failed(), and the error hook that runs once.
#pragma once

#include <functional>
#include <mutex>
#include <string>

namespace pipeoffload::backend::detail {

/// The failure state of a device `Device` (which derives from it and defines on_failure(): wake
/// whatever sleeps on the device). mu_ guards it and is the device's own lock too, so a waiter
/// that checks failed_ under mu_ before it sleeps cannot miss the wake-up.
template <class Device>
class Failure {
 public:
  /// Fails the device with `why`: its queued and new work is dropped, and its waits, in
  /// progress and to come, throw naming `why`.
  void abort(std::string why) { fail(std::move(why)); }

  /// Has a pass, a device call or abort() failed the device?
  bool failed() const {
    std::lock_guard lk(mu_);
    return failed_;
  }

  /// `hook(message)` runs once, on the first failure, from the failing thread.
  void set_error_hook(std::function<void(const std::string&)> hook) {
    std::lock_guard lk(mu_);
    hook_ = std::move(hook);
  }

 protected:
  /// Records the first failure (later ones are dropped), lets the device wake its waiters, then
  /// runs the hook outside the lock (error_ no longer changes once failed_ is set).
  void fail(std::string why) {
    std::function<void(const std::string&)> hook;
    {
      std::lock_guard lk(mu_);
      if (failed_) return;
      failed_ = true;
      error_ = std::move(why);
      hook = hook_;
    }
    static_cast<Device*>(this)->on_failure();
    if (hook) hook(error_);
  }

  mutable std::mutex mu_;
  bool failed_ = false;
  std::string error_;

 private:
  std::function<void(const std::string&)> hook_;
};

}  // namespace pipeoffload::backend::detail
