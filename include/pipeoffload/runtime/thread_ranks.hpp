// pipeoffload/runtime/thread_ranks.hpp: running d pipeline ranks as threads of one process.
#pragma once

#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace pipeoffload {

/// Runs fn(rank) for rank 0..d-1, each on its own thread, and returns each rank's error
/// message ("" when it returned normally). A rank that throws should have aborted its
/// communicator (po::Runtime does), so the others return too.
template <class F>
std::vector<std::string> run_thread_ranks(int d, F fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(d));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(d));
  for (int r = 0; r < d; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
        if (errors[static_cast<std::size_t>(r)].empty()) errors[static_cast<std::size_t>(r)] = "unnamed error";
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = "unknown exception";
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace pipeoffload
