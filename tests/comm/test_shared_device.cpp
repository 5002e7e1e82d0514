// tests/comm/test_shared_device.cpp: comm::SharedDevice's protocol (comm/shared_device.hpp)
// without a GPU, through the code comm::SharedGpu runs, on streams of this file's own: each
// stream a thread running its tasks in order, events with CUDA's semantics (a wait is for the
// last record made before it), copies with random delays. Checked: data arrive intact while
// both sides reuse their buffers at once; a sender's stream waits for the receiver's copy and a
// receiver's for the sender's data (deterministically, behind closed gates); the collectives;
// tags, sizes and abort as comm::Threads'; no rank destroys an event or frees memory a peer is
// still enqueuing on, leaving or unwinding; the event pool stays small; and po::Runtime trains
// under every family on the CPU with it, bit-identical to comm::Threads. A communicator is
// declared before the streams it posts to, so the streams finish their tasks (which touch its
// events) before it destroys them.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <pipeoffload/comm/shared_device.hpp>
#include <pipeoffload/runtime.hpp>

namespace {

namespace po = pipeoffload;

/// A stream: a thread that runs its tasks in order.
class HostStream {
 public:
  HostStream() : th_([this] { run(); }) {}
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;
  ~HostStream() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    th_.join();
  }
  void enqueue(std::function<void()> f) {
    {
      std::lock_guard lk(mu_);
      q_.push_back(std::move(f));
    }
    cv_.notify_all();
  }
  /// Blocks until every task enqueued so far has run.
  void drain() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return q_.empty() && !busy_; });
  }

 private:
  void run() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;
      std::function<void()> f = std::move(q_.front());
      q_.pop_front();
      busy_ = true;
      lk.unlock();
      f();
      lk.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool busy_ = false, stop_ = false;
  std::thread th_;
};

struct HostEvent {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t recorded = 0, completed = 0;
};

struct StreamContext {
  HostStream* stream = nullptr;
};

/// What the teardown tests watch: events destroyed (kept, not deleted, so that a late call on
/// one is counted rather than undefined), memory a rank has freed, and every call that used
/// either after the fact.
struct Teardown {
  std::mutex mu;
  std::vector<HostEvent*> dead;
  std::vector<std::span<const std::byte>> freed;
  int misuse = 0;
  void check_event(HostEvent* e) {
    std::lock_guard lk(mu);
    if (std::find(dead.begin(), dead.end(), e) != dead.end()) ++misuse;
  }
  void check_memory(const std::byte* p) {
    std::lock_guard lk(mu);
    for (const auto& f : freed)
      if (p >= f.data() && p < f.data() + f.size()) ++misuse;
  }
  void free(std::span<const std::byte> m) {
    std::lock_guard lk(mu);
    freed.push_back(m);
  }
  // The "device": every stream of the test, which synchronize() drains, as backend::Cuda's
  // destructor synchronizes the device before it frees its memory.
  std::mutex streams_mu;
  std::vector<HostStream*> streams;
  void synchronize() {
    std::lock_guard lk(streams_mu);
    for (HostStream* st : streams) st->drain();
  }
  /// A rank's stream, on the device from construction to destruction.
  struct Attached {
    Teardown& t;
    HostStream* st;
    Attached(Teardown& td, HostStream& s) : t(td), st(&s) {
      std::lock_guard lk(t.streams_mu);
      t.streams.push_back(st);
    }
    ~Attached() {
      std::lock_guard lk(t.streams_mu);
      t.streams.erase(std::find(t.streams.begin(), t.streams.end(), st));
    }
  };
  /// A rank's memory: freed (after the device synchronizes) when it goes.
  struct Frees {
    Teardown& t;
    std::span<const std::byte> m;
    ~Frees() {
      t.synchronize();
      t.free(m);
    }
  };
  ~Teardown() {
    for (HostEvent* e : dead) delete e;
  }
};

/// The device calls on HostStreams, with a random delay before every copy. With `teardown`,
/// destroyed events are kept and every call is checked against it; `slow_us` delays each wait
/// call itself (a rank's thread slow between a round and its enqueues); `fail_copy` makes each
/// copy call throw.
struct HostStreams {
  using Context = StreamContext;
  using Event = HostEvent*;
  std::atomic<int>* live = nullptr;  // events alive, across every transport of a test
  unsigned seed = 1;
  std::mt19937 rng{seed};
  Teardown* teardown = nullptr;
  int slow_us = 0;
  bool fail_copy = false;

  Event create() {
    if (live) ++*live;
    return new HostEvent;
  }
  void destroy(Event e) {
    if (live) --*live;
    if (teardown) {
      std::lock_guard lk(teardown->mu);
      teardown->dead.push_back(e);
      return;
    }
    delete e;
  }
  void record(const Context& c, Event e) {
    if (teardown) teardown->check_event(e);
    std::uint64_t g = 0;
    {
      std::lock_guard lk(e->mu);
      g = ++e->recorded;
    }
    c.stream->enqueue([e, g] {
      std::lock_guard lk(e->mu);
      e->completed = std::max(e->completed, g);
      e->cv.notify_all();
    });
  }
  void wait(const Context& c, Event e) {
    if (slow_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
    if (teardown) teardown->check_event(e);
    std::uint64_t g = 0;
    {
      std::lock_guard lk(e->mu);
      g = e->recorded;
    }
    c.stream->enqueue([e, g] {
      std::unique_lock lk(e->mu);
      e->cv.wait(lk, [&] { return e->completed >= g; });
    });
  }
  void copy(const Context& c, std::byte* dst, const std::byte* src, std::size_t n) {
    if (fail_copy) throw po::error("the copy failed");
    if (teardown) teardown->check_memory(src);
    const int us = static_cast<int>(rng() % 40);
    c.stream->enqueue([=] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      std::memcpy(dst, src, n);
    });
  }
};
static_assert(po::comm::device_streams<HostStreams>);
using Shared = po::comm::SharedDevice<HostStreams>;
static_assert(po::replica_communicator<Shared, StreamContext>,
              "comm::SharedDevice must model replica_communicator with its streams' context.");

/// A gate a stream can be held behind.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void hold(HostStream& s) {
    s.enqueue([this] {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return open; });
    });
  }
  void release() {
    {
      std::lock_guard lk(mu);
      open = true;
    }
    cv.notify_all();
  }
};

std::byte pattern(int k, std::size_t i) { return static_cast<std::byte>((k * 131 + static_cast<int>(i) * 7) & 0xff); }

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("shared device: messages arrive intact while sender and receiver reuse their buffers at once") {
  // A ring of 3 ranks, 300 messages each way round, one source and one destination buffer per
  // rank: the source is rewritten on the stream right after each send, the destination read
  // and then scribbled on right after each recv.
  const int d = 3, messages = 300;
  const std::size_t bytes = 4096;
  std::atomic<int> live{0};
  {
    po::comm::ThreadsWorld world(d);
    std::vector<int> bad(d, 0);
    std::vector<std::size_t> pool(d, 0);
    const auto errors = po::run_thread_ranks(world, [&](int r) {
      Shared comm(world, r, po::comm::DeviceCopy<HostStreams>(HostStreams{&live, static_cast<unsigned>(r + 1)}));
      HostStream stream;
      const StreamContext ctx{&stream};
      std::vector<std::byte> src(bytes), dst(bytes);
      const int next = (r + 1) % d, prev = (r + d - 1) % d;
      for (int k = 0; k < messages; ++k) {
        stream.enqueue([&, k] {
          for (std::size_t i = 0; i < bytes; ++i) src[i] = pattern(k + r, i);
        });
        const po::Tag tag{next, k, po::Dir::forward};
        if (r % 2 == 0) {  // even ranks send first, odd ones receive first: no cycle of rendezvous
          comm.send(ctx, next, tag, src);
          comm.recv(ctx, prev, {r, k, po::Dir::forward}, dst);
        } else {
          comm.recv(ctx, prev, {r, k, po::Dir::forward}, dst);
          comm.send(ctx, next, tag, src);
        }
        stream.enqueue([&, k] { std::fill(src.begin(), src.end(), std::byte{0xee}); });
        stream.enqueue([&, k] {
          for (std::size_t i = 0; i < bytes; ++i)
            if (dst[i] != pattern(k + prev, i)) {
              ++bad[static_cast<std::size_t>(r)];
              break;
            }
          std::fill(dst.begin(), dst.end(), std::byte{0xdd});
        });
      }
      stream.drain();
      pool[static_cast<std::size_t>(r)] = comm.transport().events();
    });
    for (const auto& e : errors) REQUIRE(e == "");
    for (int r = 0; r < d; ++r) {
      CHECK(bad[static_cast<std::size_t>(r)] == 0);
      CHECK(pool[static_cast<std::size_t>(r)] == 2);  // one message in flight at a time: two events
    }
  }
  CHECK(live.load() == 0);  // every event destroyed with its transport
}

TEST_CASE("shared device: the sender's stream waits for the copy, the receiver's for the sender's data") {
  po::comm::ThreadsWorld world(2);
  Shared c0(world, 0), c1(world, 1);  // before the streams: they finish their tasks before its events go
  HostStream s0, s1;
  std::vector<std::byte> src(256, std::byte{7}), dst(256, std::byte{0});
  const po::Tag tag{1, 0, po::Dir::forward};
  SUBCASE("the receiver's stream is held: the sender's reuse of its buffer waits") {
    Gate gate;
    gate.hold(s1);
    std::atomic<bool> reused{false};
    std::thread recv([&] { c1.recv(StreamContext{&s1}, 0, tag, dst); });
    c0.send(StreamContext{&s0}, 1, tag, src);
    recv.join();
    s0.enqueue([&] {
      std::fill(src.begin(), src.end(), std::byte{9});
      reused = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK_FALSE(reused.load());  // behind the receiver's copy, which is behind the gate
    gate.release();
    s0.drain();
    s1.drain();
    CHECK(reused.load());
    CHECK(dst == std::vector<std::byte>(256, std::byte{7}));
  }
  SUBCASE("the sender's stream is held: the receiver reads only once the data are there") {
    Gate gate;
    gate.hold(s0);
    s0.enqueue([&] { std::fill(src.begin(), src.end(), std::byte{5}); });  // the data, produced late
    std::atomic<bool> read{false};
    std::thread send([&] { c0.send(StreamContext{&s0}, 1, tag, src); });
    c1.recv(StreamContext{&s1}, 0, tag, dst);
    send.join();
    s1.enqueue([&] { read = true; });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK_FALSE(read.load());
    gate.release();
    s0.drain();
    s1.drain();
    CHECK(read.load());
    CHECK(dst == std::vector<std::byte>(256, std::byte{5}));
  }
}

TEST_CASE("shared device: all_to_all and all_gather on the streams, inputs rewritten at once, sizes checked") {
  const int dp = 3, rounds = 60;
  const std::size_t block = 512;
  po::comm::ThreadsWorld world(dp);
  std::vector<int> bad(dp, 0);
  std::vector<std::size_t> pool(dp, 0);
  std::vector<po::Traffic> traffic(dp);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    Shared comm(world, r, po::comm::DeviceCopy<HostStreams>(HostStreams{nullptr, static_cast<unsigned>(r + 7)}));
    HostStream stream;
    const StreamContext ctx{&stream};
    std::vector<std::byte> in(dp * block), out(dp * block), mine(block), all(dp * block);
    for (int k = 0; k < rounds; ++k) {
      stream.enqueue([&, k] {
        for (int to = 0; to < dp; ++to)
          for (std::size_t i = 0; i < block; ++i)
            in[static_cast<std::size_t>(to) * block + i] = pattern(k + r * 5 + to, i);
        for (std::size_t i = 0; i < block; ++i) mine[i] = pattern(k * 3 + r, i);
      });
      comm.all_to_all(ctx, std::span<const std::byte>(in), std::span(out));
      comm.all_gather(ctx, std::span<const std::byte>(mine), std::span(all));
      stream.enqueue([&] {
        std::fill(in.begin(), in.end(), std::byte{0xee});
        std::fill(mine.begin(), mine.end(), std::byte{0xee});
      });
      stream.enqueue([&, k] {
        for (int j = 0; j < dp; ++j)
          for (std::size_t i = 0; i < block; ++i) {
            if (out[static_cast<std::size_t>(j) * block + i] != pattern(k + j * 5 + r, i) ||
                all[static_cast<std::size_t>(j) * block + i] != pattern(k * 3 + j, i)) {
              ++bad[static_cast<std::size_t>(r)];
              return;
            }
          }
      });
    }
    stream.drain();
    pool[static_cast<std::size_t>(r)] = comm.transport().events();
    traffic[static_cast<std::size_t>(r)] = comm.traffic();
    // Another size on one rank: a comm_error naming both, on every rank.
    std::vector<std::byte> odd(r == 1 ? 2 * dp : dp), odd_out(odd.size());
    const std::string e = error_of([&] { comm.all_to_all(ctx, std::span<const std::byte>(odd), std::span(odd_out)); });
    CHECK(e ==
          "comm::SharedDevice: ranks passed buffers of different sizes to a device collective (rank 0: 3 bytes, "
          "rank 1: 6 bytes)");
    // Another collective on one rank, of the same bytes: a comm_error naming both, on every rank.
    std::vector<std::byte> three(dp), scattered(dp);
    const std::string other = error_of([&] {
      if (r == 2)
        comm.all_gather(ctx, std::span<const std::byte>(three.data(), 1), std::span(three));
      else
        comm.all_to_all(ctx, std::span<const std::byte>(three), std::span(scattered));
    });
    CHECK(other ==
          "comm::SharedDevice: ranks called different device collectives at once (rank 0: all_to_all, rank 2: "
          "all_gather)");
    stream.drain();
  });
  for (const auto& e : errors) REQUIRE(e == "");
  for (int r = 0; r < dp; ++r) {
    CHECK(bad[static_cast<std::size_t>(r)] == 0);
    CHECK(pool[static_cast<std::size_t>(r)] <= 4);  // two in use, two retired
    CHECK(traffic[static_cast<std::size_t>(r)].all_to_all == rounds * (dp - 1) * block);
    CHECK(traffic[static_cast<std::size_t>(r)].all_gather == rounds * (dp - 1) * block);
  }
}

TEST_CASE("shared device: no rank destroys events or frees memory a peer is still enqueuing on") {
  // Each rank's memory is declared before its handle (as a backend is) and marked freed once
  // the handle has gone and every stream has drained (backend::Cuda synchronizes the device
  // before it frees); rank 0's thread is slow between each round and its enqueues.
  Teardown t;
  const std::size_t block = 64;
  // Two ranks, one all_gather; with `fail`, rank 1's copy throws.
  const auto run = [&](bool fail) {
    po::comm::ThreadsWorld world(2);
    return po::run_thread_ranks(world, [&](int r) {
      HostStream stream;
      const Teardown::Attached on_device(t, stream);
      std::vector<std::byte> mine(block, std::byte{1}), all(2 * block);
      const Teardown::Frees frees{t, mine};
      Shared comm(world, r,
                  po::comm::DeviceCopy<HostStreams>(
                      HostStreams{.teardown = &t, .slow_us = r == 0 ? 30000 : 0, .fail_copy = fail && r == 1}));
      const std::string e =
          error_of([&] { comm.all_gather(StreamContext{&stream}, std::span<const std::byte>(mine), std::span(all)); });
      stream.drain();
      if (!e.empty()) throw po::error(e);
    });
  };
  SUBCASE("a collective's end: the fast rank leaves while the slow one still waits on its event") {
    for (const auto& e : run(false)) CHECK(e == "");
  }
  SUBCASE("the abort path: a rank that throws mid-collective unwinds while the slow one still copies from it") {
    const auto errors = run(true);
    CHECK(errors[1] == "the copy failed");
    CHECK(errors[0] == "aborted: rank 1 failed: the copy failed");
  }
  CHECK(t.misuse == 0);
}

TEST_CASE("shared device: tags, sizes and abort as comm::Threads") {
  po::comm::ThreadsWorld world(2);
  std::vector<std::byte> a(16), b(8);
  const auto errors = po::run_thread_ranks(world, [&](int r) {
    Shared comm(world, r);
    HostStream stream;
    const StreamContext ctx{&stream};
    if (r == 0) {
      comm.send(ctx, 1, {1, 3, po::Dir::forward}, a);
      stream.drain();
      return;
    }
    const std::string e = error_of([&] { comm.recv(ctx, 0, {1, 3, po::Dir::backward}, b); });
    CHECK(e ==
          "comm::Threads: rank 1 expected (backward, stage 1, mb 3) of 8 bytes from rank 0 but received (forward, "
          "stage 1, mb 3) of 16 bytes");
    comm.abort("rank 1 gave up");
    stream.drain();
  });
  CHECK(errors[0] == "aborted: rank 1 gave up");
  CHECK(errors[1] == "");
}

namespace {

/// The same protocol on the CPU backend's comm stream, which runs each call to its end: events
/// that are complete when recorded and copies made at once (what a stream that ran every task
/// as it came would do), so po::Runtime can train through comm::SharedDevice on the CPU.
struct ImmediateStreams {
  using Context = po::backend::CpuContext;
  using Event = int*;
  Event create() { return new int(0); }
  void destroy(Event e) { delete e; }
  void record(const Context&, Event e) { ++*e; }
  void wait(const Context&, Event) {}
  void copy(const Context&, std::byte* dst, const std::byte* src, std::size_t n) { std::memcpy(dst, src, n); }
};

struct Trained {
  std::vector<float> losses, params;
  std::vector<std::string> errors;
};

/// Two steps of a 4-block GPT under `name` with dp replicas, the ranks' communicators made by
/// make(handle) from comm::ThreadsGrid's handles.
template <class Make>
Trained train(const std::string& name, int dp, Make make) {
  po::ScheduleSpec spec = po::parse_schedule(name, 1);
  po::Program program = [&] {
    for (const int v : {2, 1}) try {
        return po::build(spec, {2, v, 4});
      } catch (const std::exception&) {
      }
    throw std::runtime_error("no shape for " + name);
  }();
  const po::Shape sh = program.shape;
  const po::gpt::GptConfig cfg{.vocab = 32, .hidden = 16, .heads = 2, .layers = 4, .seq = 8, .dropout = 0.0f};
  const po::MicrobatchShape mbs{2, 8};
  po::comm::ThreadsGrid grid(dp, sh.d);
  Trained out;
  out.losses.resize(2);
  std::vector<std::vector<float>> by_stage(static_cast<std::size_t>(sh.stages()));
  std::mutex mu;
  out.errors = po::run_thread_ranks(grid, [&](int g) {
    const int r = g % sh.d, j = g / sh.d;
    po::backend::Cpu dev({.rank = r});
    auto comm = make(grid.pipeline(g));
    auto reps = make(grid.replicas(g));
    std::vector<po::gpt::GptStage> layers;
    for (int c = 0; c < sh.v; ++c) layers.emplace_back(cfg, sh.stage_of(r, c), sh.stages());
    po::Runtime rt(program, dev, comm, reps, std::span(layers), {.microbatch = mbs});
    po::AdamW opt(rt, {.zero = dp > 1 ? 1 : 0});
    const std::size_t per = static_cast<std::size_t>(mbs.tokens() * sh.m);
    std::vector<std::int32_t> tok(per), tgt(per);
    for (int s = 0; s < 2; ++s) {
      for (std::size_t i = 0; i < per; ++i) {
        const std::size_t k = static_cast<std::size_t>(j) * per + i;
        tok[i] = static_cast<std::int32_t>((k * 7 + static_cast<std::size_t>(s)) % 32);
        tgt[i] = static_cast<std::int32_t>((k * 5 + 1) % 32);
      }
      po::Batch batch;
      batch.add("tokens", tok, {sh.m * mbs.batch, mbs.seq}).add("targets", tgt, {sh.m * mbs.batch, mbs.seq});
      rt.zero_grad();
      const po::PassStats st = rt.forward_backward(batch, {.step = s});
      opt.step(1e-2f, 1.0f);
      if (g == 0) out.losses[static_cast<std::size_t>(s)] = st.loss;
    }
    rt.settle();
    if (j != 0) return;
    std::lock_guard lk(mu);
    for (int c = 0; c < sh.v; ++c) {
      auto p = layers[static_cast<std::size_t>(c)].parameters();
      by_stage[static_cast<std::size_t>(sh.stage_of(r, c))].assign(p.begin(), p.end());
    }
  });
  for (const auto& p : by_stage) out.params.insert(out.params.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST_CASE("shared device: po::Runtime trains through it under every family, bit-identical to comm::Threads") {
  const auto threads = [](po::comm::Threads h) { return h; };
  const auto shared = [](po::comm::Threads h) {
    return po::comm::SharedDevice<ImmediateStreams>(h, po::comm::DeviceCopy<ImmediateStreams>{});
  };
  for (const po::NamedSchedule& e : po::named_schedules) {
    const std::string name(e.name);
    for (const int dp : {1, 2}) {
      if (dp == 2 && name != "1f1b-i" && name != "zb-v") continue;
      CAPTURE(name);
      CAPTURE(dp);
      const Trained ref = train(name, dp, threads), got = train(name, dp, shared);
      for (const auto& e : ref.errors) REQUIRE(e == "");
      for (const auto& e : got.errors) REQUIRE(e == "");
      CHECK(std::memcmp(ref.losses.data(), got.losses.data(), 2 * sizeof(float)) == 0);
      REQUIRE(ref.params.size() == got.params.size());
      CHECK(std::memcmp(ref.params.data(), got.params.data(), ref.params.size() * sizeof(float)) == 0);
    }
  }
}
