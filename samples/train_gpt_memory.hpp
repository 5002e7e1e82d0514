// samples/train_gpt_memory.hpp: what each rank of a train_gpt run holds on the CPU backend,
// computed before anything is allocated from the functions the runtime reserves with
// (po::reservation_plan, po::state_bytes, the stages' layouts), and the check that refuses a
// run the machine cannot hold (exit 2) instead of meeting the kernel's OOM killer mid-run.
#pragma once

#include <sys/resource.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <pipeoffload/backend/cpu/cpu.hpp>
#include <pipeoffload/memory/state.hpp>
#include <pipeoffload/runtime/reserve.hpp>

#include "cli.hpp"
#include "train_gpt_options.hpp"

namespace train_gpt {

/// One rank's bytes: its arena's blocks (MemoryStats::device_held, host_held) and its stages'
/// own parameters and gradients (counted in `device`, as reserved_bytes_per_rank does).
struct RankBytes {
  std::size_t device = 0;  ///< the arena's device blocks plus the stages' own buffers
  std::size_t host = 0;    ///< the arena's pinned host blocks (offload bins)
};

/// Every stage's buffer sizes as pipeline rank `r` sees them (every boundary `boundary`
/// bytes; its own stages' saved and stash bytes from `own(dims)`, a po::StageBytes), and the
/// parameter count of each of its chunks: what po::reservation_plan and po::state_bytes take.
struct RankStages {
  std::vector<po::StageBytes> stages;    ///< by stage
  std::vector<std::size_t> params;       ///< by chunk
  bool tokens = false, targets = false;  ///< whether it reads the token ids, the targets
};
template <class Own>
RankStages rank_stages(const Options& o, const po::Shape& sh, int r, std::size_t boundary, Own own) {
  RankStages out;
  out.stages.resize(static_cast<std::size_t>(sh.stages()));
  out.params.resize(static_cast<std::size_t>(sh.v));
  for (int s = 0; s < sh.stages(); ++s) {
    po::StageBytes& b = out.stages[static_cast<std::size_t>(s)];
    b.input = s > 0 ? boundary : 0;
    b.output = s + 1 < sh.stages() ? boundary : 0;
    if (sh.rank_of(s) != r) continue;
    const po::model::GptDims dims = po::model::gpt_dims(o.model, s, sh.stages());
    const po::StageBytes mine = own(dims);
    b.saved = mine.saved;
    b.stash = mine.stash;
    out.params[static_cast<std::size_t>(sh.chunk_of(s))] =
        static_cast<std::size_t>(po::model::gpt_stage_params(dims).total);
    out.tokens = out.tokens || dims.embeds;
    out.targets = out.targets || dims.has_head;
  }
  return out;
}

/// Pipeline rank `r` of replica `replica` under `program` on backend::Cpu: every block the
/// runtime reserves (po::reservation_plan's region for the CPU GPT's saved, stash and fp32
/// boundary sizes, and its offload bins), the blocks it and AdamW take for themselves (the step's inputs and losses, the
/// non-finite flags, po::state_bytes's sums, staging and moments), each in its 64-byte size
/// class, and the stages' fp32 parameters and gradients.
inline RankBytes cpu_rank_bytes(const Options& o, const Setup& su, const po::Program& program, int r, int replica) {
  using po::backend::Cpu;
  const po::Shape& sh = program.shape;
  const po::MicrobatchShape mb = su.runtime.microbatch;
  const std::size_t T = static_cast<std::size_t>(mb.tokens()), m = static_cast<std::size_t>(sh.m);
  const RankStages rs = rank_stages(o, sh, r, T * static_cast<std::size_t>(o.model.hidden) * sizeof(float),
                                    [&](const po::model::GptDims& d) {
                                      return po::StageBytes{.saved = po::model::gpt_cpu_bytes::saved(d, mb),
                                                            .stash = po::model::gpt_cpu_bytes::stash(d, mb)};
                                    });
  RankBytes out;
  const po::Reservation res = po::reservation_plan(program, r, rs.stages);
  out.device += Cpu::round_up(res.device);
  for (const po::BlockCount& b : res.host) out.host += Cpu::round_up(b.bytes) * b.count;
  const std::size_t inputs = (rs.tokens ? 1 : 0) + (rs.targets ? 1 : 0);
  out.device += inputs * Cpu::round_up(m * T * sizeof(std::int32_t));  // the step's token ids and targets
  out.device += Cpu::round_up(m * sizeof(float));                      // the last stage's losses
  out.device += Cpu::round_up(std::max<std::size_t>(1, program.ranks[static_cast<std::size_t>(r)].compute.size()) *
                              sizeof(std::uint32_t));  // a non-finite flag per compute op
  const po::StateBytes state = po::state_bytes(rs.params, {.gradients = o.gradients,
                                                           .dp = o.dp,
                                                           .replica = replica,
                                                           .zero = o.zero,
                                                           .optimizer_states = 2,
                                                           .reduce_bucket = su.runtime.reduce_bucket});
  for (const std::size_t bytes : state.blocks) out.device += Cpu::round_up(bytes);
  out.device += state.parameters + state.gradients;
  return out;
}

/// Bytes the system can still give this process: /proc/meminfo's MemAvailable, and below
/// RLIMIT_AS the room left under the limit (0 when neither is known: nothing is checked).
inline std::size_t available_bytes() {
  std::size_t avail = 0;
  std::ifstream info("/proc/meminfo");
  for (std::string key; info >> key;) {
    std::size_t kib = 0;
    info >> kib;
    info.ignore(64, '\n');
    if (key == "MemAvailable:") avail = kib * 1024;
  }
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    std::size_t used = 0;  // the address space this process already has
    std::ifstream st("/proc/self/statm");
    std::size_t pages = 0;
    if (st >> pages) used = pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    const std::size_t room = lim.rlim_cur > used ? lim.rlim_cur - used : 0;
    avail = avail == 0 ? room : std::min(avail, room);
  }
  return avail;
}

/// Every rank this process runs (global ranks `first` .. `first + count - 1`) needs its
/// RankBytes, and 10 % more for what they hold outside the arena (the stages' scratch, thread
/// stacks); throws bad_argument when that exceeds what the system can give (the largest rank
/// named), before any rank allocates.
inline void check_memory(const Options& o, const Setup& su, const po::Program& program, int first, int count) {
  const std::size_t avail = available_bytes();
  if (avail == 0) return;
  std::size_t need = 0, worst = 0;
  int worst_rank = first;
  for (int g = first; g < first + count; ++g) {
    const RankBytes b = cpu_rank_bytes(o, su, program, g % o.shape.d, g / o.shape.d);
    need += b.device + b.host;
    if (b.device + b.host > worst) {
      worst = b.device + b.host;
      worst_rank = g;
    }
  }
  if (need + need / 10 <= avail) return;
  const auto gib = [](std::size_t b) {
    char t[32];
    std::snprintf(t, sizeof t, "%.2f GiB", static_cast<double>(b) / (1ull << 30));
    return std::string(t);
  };
  throw sample::bad_argument(
      "this run needs " + gib(need) + " of memory for its " + std::to_string(count) + " rank" + (count > 1 ? "s" : "") +
      " (activations, stashes, messages, offload bins and model state; rank " + std::to_string(worst_rank) +
      " the most, " + gib(worst) + "), and 10 % more for scratch and stacks, but " + gib(avail) +
      " is available (MemAvailable, or the address-space limit); use fewer ranks, microbatches, layers or a smaller --hidden, --seq or --batch");
}

}  // namespace train_gpt
