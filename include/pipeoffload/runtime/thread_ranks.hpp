// pipeoffload/runtime/thread_ranks.hpp: running d pipeline ranks as threads of one process.
/// @file
#pragma once

#include <exception>
#include <string>
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
template <class World, class F>
std::vector<std::string> run_thread_ranks(World& world, F fn) {
  const int d = world.size();
  std::vector<std::string> errors(static_cast<std::size_t>(d));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r) try {
      threads.emplace_back([&, r] {
        std::string& err = errors[static_cast<std::size_t>(r)];
        try {
          fn(r);
        } catch (const std::exception& e) {
          err = e.what();
          if (err.empty()) err = "unnamed error";
        } catch (...) {
          err = "unknown exception";
        }
        if (!err.empty())
          world.abort(err.rfind("aborted: ", 0) == 0 ? err.substr(9) : "rank " + std::to_string(r) + " failed: " + err);
      });
    } catch (const std::system_error& e) {
      const std::string why = "cannot start the thread of rank " + std::to_string(r) + ": " + e.what() +
                              " (the process is at its thread or memory limit: ulimit -u, ulimit -v)";
      for (int q = r; q < d; ++q) errors[static_cast<std::size_t>(q)] = why;
      world.abort("rank " + std::to_string(r) + " failed: " + why);
      break;
    }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace pipeoffload
