// tests/runtime/thread_limit.cpp: d thread ranks, each with a backend::Cpu of three streams,
// meeting in one all_gather. test_thread_limit.py runs it under an address-space limit that
// leaves room for only some of those threads: every rank must then end with a sentence (the
// thread that could not start, or the abort it caused), never std::terminate.
//
// usage: thread_limit D        exit 0 when every rank returned, 1 when a rank failed (each
//                              rank's error on a line of standard error)
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include <pipeoffload/runtime.hpp>

namespace po = pipeoffload;

int main(int argc, char** argv) {
  const int d = argc > 1 ? std::atoi(argv[1]) : 4;
  if (d < 1 || d > 4096) {
    std::fprintf(stderr, "thread_limit: D = %s must be in [1, 4096]\n", argc > 1 ? argv[1] : "");
    return 2;
  }
  po::comm::ThreadsWorld world(d);
  const std::vector<std::string> errors = po::run_thread_ranks(world, [&](int r) {
    po::backend::Cpu dev({.rank = r});
    for (const char* s : {"compute", "copy", "comm"}) dev.make_stream(s);
    po::comm::Threads comm(world, r);
    const double mine = r;
    std::vector<double> all(static_cast<std::size_t>(d));
    comm.all_gather(std::span<const double>(&mine, 1), std::span(all));
  });
  int failed = 0;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      std::fprintf(stderr, "rank %zu: %s\n", r, errors[r].c_str());
      ++failed;
    }
  std::printf("%d of %d ranks failed\n", failed, d);
  return failed > 0 ? 1 : 0;
}
