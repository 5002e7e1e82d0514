// pipeoffload/schedule/detail/parallel.hpp: independent per-rank work on the machine's cores.
//
// Building, validating and simulating a large schedule is mostly per-rank work that writes
// tens of megabytes of fresh memory; on a machine with more than one core, the ranks are split
// among short-lived threads. Each item (a rank, a pair of ranks) writes only its own outputs
// and its worker's scratch, so the results do not depend on which thread ran which item, and
// are bit-identical to a run on one thread. In a constant expression, or for work too small to
// pay for a thread, everything runs on the calling thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "../../error.hpp"

namespace pipeoffload {

/// Threads one call of build(), validate() or simulate() may use, the calling thread
/// included, given as that call's last argument: Workers{} (the default) for one per core (at
/// most 8) on work large enough to pay for them; Workers{n} for n on any work (Workers{1}:
/// everything on the calling thread). Results are bit-identical whatever the count. Nothing
/// is process-wide: each call says its own. Throws shape_error outside [0, 256].
struct Workers {
  int count = 0;  ///< 0: by the machine's cores and the work's size
  constexpr Workers() = default;
  constexpr explicit Workers(int n) : count(n) { detail::require_range("po::Workers: n", n, 0, 256); }
};

namespace detail {

/// Work (in ops) below which one more thread does not pay for starting it.
inline constexpr std::size_t parallel_grain = std::size_t{1} << 16;
/// Most threads one call uses by default: the per-rank passes are memory-bound and stop
/// scaling soon.
inline constexpr int max_workers = 8;

/// How many workers to split `items` items of `work` ops in total among: 1 in a constant
/// expression; under Workers{n > 0}, n (at most one per item); by default one per core (at
/// most max_workers), for work large enough to pay for them.
constexpr int worker_count(std::size_t work, int items, Workers threads) {
  if (std::is_constant_evaluated()) return 1;
  const int limit = threads.count;
  if (limit > 0) return std::max(1, std::min(limit, items));
  const int cores = std::min(max_workers, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const auto by_work = static_cast<int>(std::min<std::size_t>(work / parallel_grain, static_cast<std::size_t>(cores)));
  return std::max(1, std::min({cores, by_work, items}));
}

/// A flag that one item sets once and others read while it runs: release/acquire between
/// threads, plain in a constant expression (one thread).
constexpr void publish(bool& flag) {
  if (std::is_constant_evaluated())
    flag = true;
  else
    std::atomic_ref<bool>(flag).store(true, std::memory_order_release);
}
constexpr bool published(bool& flag) {
  if (std::is_constant_evaluated()) return flag;
  return std::atomic_ref<bool>(flag).load(std::memory_order_acquire);
}

/// A count that one item stores with release order (see TimesOut::progress), loaded with
/// acquire order; plain in a constant expression.
constexpr std::size_t acquired(std::size_t& count) {
  if (std::is_constant_evaluated()) return count;
  return std::atomic_ref<std::size_t>(count).load(std::memory_order_acquire);
}

/// What an item that waits for another's progress does when it found none: lets the thread
/// that makes it run, if it shares this core.
inline void pause() { std::this_thread::yield(); }

/// A reference to a callable run as body(item, worker): one function, not a template, runs
/// the threads, so that a translation unit compiles the thread machinery once.
struct ItemBody {
  void* object;
  void (*call)(void* object, int item, int worker);
};

/// body(item, worker) for every item in [0, items), on `workers` threads (the caller's
/// included), items handed out one at a time in order. An exception stops the handing out;
/// once every thread has finished, the one thrown by the lowest item is rethrown, which is
/// the one a run in item order on one thread throws (the items before it were all handed out
/// and, being independent, did not throw). If a thread cannot be started, the threads that
/// did start do the work.
inline void run_on_threads(int workers, int items, ItemBody body) {
  std::atomic<int> next{0};
  struct Failure {
    int item = -1;
    std::exception_ptr error;
  };
  std::vector<Failure> failed(static_cast<std::size_t>(workers));
  const auto loop = [&](int w) {
    int i = 0;
    try {
      while ((i = next.fetch_add(1, std::memory_order_relaxed)) < items) body.call(body.object, i, w);
    } catch (...) {
      failed[static_cast<std::size_t>(w)] = {i, std::current_exception()};
      next.store(items, std::memory_order_relaxed);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(loop, w);
    } catch (...) {  // no thread (std::system_error) or no memory for it: fewer threads
      break;
    }
  }
  loop(0);
  for (auto& t : threads) t.join();
  const Failure* first = nullptr;
  for (const Failure& f : failed)
    if (f.error && (first == nullptr || f.item < first->item)) first = &f;
  if (first != nullptr) std::rethrow_exception(first->error);
}

/// body(item, worker) for every item in [0, items), worker in [0, workers): on threads when
/// workers > 1 (see run_on_threads), else in item order on this thread.
template <class Body>
constexpr void for_each_item(int workers, int items, Body&& body) {
  if (workers > 1 && !std::is_constant_evaluated()) {
    using B = std::remove_reference_t<Body>;
    run_on_threads(workers, items,
                   ItemBody{const_cast<void*>(static_cast<const void*>(std::addressof(body))),
                            [](void* object, int item, int worker) { (*static_cast<B*>(object))(item, worker); }});
    return;
  }
  for (int i = 0; i < items; ++i) body(i, 0);
}

}  // namespace detail
}  // namespace pipeoffload
