// pipeoffload/runtime/thread_ranks.hpp: running d pipeline ranks as threads of one process.
/// @file
#pragma once

#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace pipeoffload {

/// Runs fn(rank) for every rank of `world` (a comm::ThreadsWorld, or any world with size()
/// and abort(why)), each on its own thread, and returns each rank's error message ("" when
/// it returned normally). A rank that throws aborts the world with its message, so every
/// other rank's next wait throws too: no rank is left waiting, whatever the code that threw.
template <class World, class F>
std::vector<std::string> run_thread_ranks(World& world, F fn) {
  const int d = world.size();
  std::vector<std::string> errors(static_cast<std::size_t>(d));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r)
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
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace pipeoffload
