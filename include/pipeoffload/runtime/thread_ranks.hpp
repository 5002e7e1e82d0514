// pipeoffload/runtime/thread_ranks.hpp: running d pipeline ranks as threads of one process.
/// @file
#pragma once

#include <exception>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

namespace pipeoffload {

/// Runs fn(rank) for every rank of `world` (a comm::ThreadsWorld, or any world with size()
/// and abort(why)), each on its own thread, and returns each rank's error message ("" when
/// it returned normally). A rank that throws aborts the world with its message, so every
/// other rank's next wait throws too: no rank is left waiting, whatever the code that threw.
/// A rank whose thread cannot be started (the process at its thread or memory limit) gets
/// that sentence as its error, as does every rank after it, and the world is aborted so that
/// the ranks already running end too.
namespace detail {

/// Sets `err` to `what` (or "unnamed error"); when memory is out, to as much of it as err's
/// reserved capacity holds, without allocating.
inline void set_error(std::string& err, const char* what) noexcept {
  const std::string_view w = what != nullptr && *what != 0 ? what : "unnamed error";
  try {
    err.assign(w);
  } catch (...) {
    err.assign(w.substr(0, err.capacity()));  // within capacity: no allocation
  }
}

/// Aborts `world` with "rank r failed: err" (or err's own "aborted: ..." reason); when memory
/// is out, with err alone.
template <class World>
void abort_for(World& world, int r, const std::string& err) noexcept {
  try {
    world.abort(err.rfind("aborted: ", 0) == 0 ? err.substr(9) : "rank " + std::to_string(r) + " failed: " + err);
  } catch (...) {
    try {
      world.abort(err);
    } catch (...) {  // nothing left to tell the others with
    }
  }
}

}  // namespace detail

/// Runs fn(rank) for every rank of `world` (a comm::ThreadsWorld, or any world with size()
/// and abort(why)), each on its own thread, and returns each rank's error message ("" when
/// it returned normally). A rank that throws aborts the world with its message, so every
/// other rank's next wait throws too: no rank is left waiting, whatever the code that threw.
/// A rank whose thread cannot be started (the process at its thread or memory limit) gets
/// that sentence as its error, as does every rank after it, and the world is aborted so that
/// the ranks already running end too. Out of memory never ends the process: errors are kept
/// within reserved room, and every thread started is joined however this function is left.
template <class World, class F>
std::vector<std::string> run_thread_ranks(World& world, F fn) {
  const int d = world.size();
  std::vector<std::string> errors(static_cast<std::size_t>(d));
  for (std::string& e : errors) e.reserve(256);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(d));
  struct JoinAll {  // a joinable std::thread destroyed is std::terminate
    std::vector<std::thread>& threads;
    ~JoinAll() {
      for (std::thread& t : threads)
        if (t.joinable()) t.join();
    }
  } join_all{threads};
  for (int r = 0; r < d; ++r) try {
      threads.emplace_back([&, r]() noexcept {
        std::string& err = errors[static_cast<std::size_t>(r)];
        try {
          fn(r);
        } catch (const std::exception& e) {
          detail::set_error(err, e.what());
        } catch (...) {
          detail::set_error(err, "unknown exception");
        }
        if (!err.empty()) detail::abort_for(world, r, err);
      });
    } catch (const std::exception& e) {  // std::system_error, or std::bad_alloc for the thread's state
      std::string& err = errors[static_cast<std::size_t>(r)];
      try {
        err = "cannot start the thread of rank " + std::to_string(r) + ": " + e.what() +
              " (the process is at its thread or memory limit: ulimit -u, ulimit -v)";
      } catch (...) {
        detail::set_error(err, e.what());
      }
      for (int q = r + 1; q < d; ++q) detail::set_error(errors[static_cast<std::size_t>(q)], err.c_str());
      detail::abort_for(world, r, err);
      break;
    }
  for (std::thread& t : threads) t.join();
  return errors;
}

}  // namespace pipeoffload
