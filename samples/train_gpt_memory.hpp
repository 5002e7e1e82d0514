// samples/train_gpt_memory.hpp: what each rank of a train_gpt run holds, on the CPU backend
// (cpu_rank_bytes) and on backend::Cuda (cuda_rank_bytes, which sizes each GPU's arena),
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
#include <string_view>
#include <vector>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda_layout.hpp>
#include <models/llama/cpu.hpp>
#include <models/llama/cuda_layout.hpp>
#include <pipeoffload/backend/cpu/cpu.hpp>
#include <pipeoffload/backend/cuda/pools.hpp>
#include <pipeoffload/backend/cuda/shapes.hpp>
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

/// What one stage of the run's model holds: its saved and stash bytes per microbatch on the
/// CPU (`cuda` false) or the GPU, its parameters, the step inputs it reads (the layer's own
/// inputs(): the token ids, the targets, with --pack the document offsets), and with tied
/// embeddings the run of its parameters that is the head's copy (or, on stage 0, the primary's
/// values).
struct StageFacts {
  po::StageBytes own{};
  std::size_t params = 0;
  bool embeds = false, tokens = false, targets = false, documents = false;
  std::size_t tied_values = 0;  ///< V * h where the stage holds a tied tensor, else 0
  po::ParamRange copy{};        ///< the head's tied copy (empty elsewhere)
};
/// `f` with what either model's dims `d`, parameter layout `p` and step inputs `in` say: the
/// parameters, the inputs read, and the tied tensor.
inline StageFacts with_layout(StageFacts f, const auto& d, const auto& p, const std::vector<po::InputSpec>& in) {
  f.params = static_cast<std::size_t>(p.total);
  f.embeds = d.embeds;
  for (const po::InputSpec& i : in) {
    const std::string_view name = i.name;
    f.tokens = f.tokens || name == "tokens";
    f.targets = f.targets || name == "targets";
    f.documents = f.documents || name == po::document_offsets_input;
  }
  if (d.tied) {
    f.tied_values = static_cast<std::size_t>(d.vocab * d.hidden);
    const auto at = static_cast<std::size_t>(p.head_begin + p.head_w);
    if (d.has_head) f.copy = {at, at + f.tied_values};
  }
  return f;
}
inline StageFacts stage_facts(const Options& o, int s, int S, bool cuda, po::MicrobatchShape mb) {
  StageFacts f;
  if (o.llama) {
    const po::llama::LlamaDims d = po::llama::llama_dims(llama_config(o), s, S);
    if (cuda) {
      const po::llama::LlamaStageBuffers b = po::llama::llama_cuda_buffers(d, mb.tokens());
      f.own = {.saved = b.saved_bytes, .stash = b.stash_bytes};
    } else {
      f.own = {.saved = po::llama::cpu_bytes::saved(d, mb), .stash = po::llama::cpu_bytes::stash(d, mb)};
    }
    return with_layout(f, d, po::llama::llama_stage_params(d), po::llama::llama_inputs(d, mb));
  }
  const po::gpt::GptDims d = po::gpt::gpt_dims(o.model, s, S);
  if (cuda) {
    const po::gpt::GptStageBuffers b = po::gpt::gpt_stage_buffers(d, mb.tokens());
    f.own = {.saved = b.saved_bytes, .stash = b.stash_bytes};
  } else {
    f.own = {.saved = po::gpt::gpt_cpu_bytes::saved(d, mb), .stash = po::gpt::gpt_cpu_bytes::stash(d, mb)};
  }
  return with_layout(f, d, po::gpt::gpt_stage_params(d), po::gpt::gpt_inputs(d, mb));
}

/// Every stage's buffer sizes as pipeline rank `r` sees them (every boundary tensor's bytes;
/// its own stages' saved and stash bytes), and the parameter count of each of its chunks: what
/// po::reservation_plan and po::state_bytes take.
struct RankStages {
  std::vector<po::StageBytes> stages;    ///< by stage
  std::vector<std::size_t> params;       ///< by chunk
  bool tokens = false, targets = false;  ///< whether it reads the token ids, the targets
  bool documents = false;                ///< whether it reads the document offsets (--pack)
  po::TiedState ties;                    ///< --tie-embeddings: stage 0's embedding is the primary, the head's a copy
};

/// The bytes of one boundary tensor: fp32 on the CPU, bf16 between the CUDA stages.
inline std::size_t boundary_bytes(bool cuda, const Options& o, po::MicrobatchShape mb) {
  return static_cast<std::size_t>(mb.tokens()) * static_cast<std::size_t>(o.model.hidden) * (cuda ? 2 : 4);
}

/// rank_stages of rank `r` on the CPU (`cuda` false) or the GPU.
inline RankStages rank_stages(const Options& o, const Setup& su, const po::Shape& sh, int r, bool cuda) {
  const po::MicrobatchShape mb = su.runtime.microbatch;
  const std::size_t boundary = boundary_bytes(cuda, o, mb);
  RankStages out;
  out.stages.resize(static_cast<std::size_t>(sh.stages()));
  out.params.resize(static_cast<std::size_t>(sh.v));
  for (int s = 0; s < sh.stages(); ++s) {
    po::StageBytes& b = out.stages[static_cast<std::size_t>(s)];
    b.input = s > 0 ? boundary : 0;
    b.output = s + 1 < sh.stages() ? boundary : 0;
    if (sh.rank_of(s) != r) continue;
    const StageFacts f = stage_facts(o, s, sh.stages(), cuda, mb);
    b.saved = f.own.saved;
    b.stash = f.own.stash;
    out.params[static_cast<std::size_t>(sh.chunk_of(s))] = f.params;
    out.tokens = out.tokens || f.tokens;
    out.targets = out.targets || f.targets;
    out.documents = out.documents || f.documents;
    if (f.tied_values > 0) {
      out.ties.copies.resize(static_cast<std::size_t>(sh.v));
      if (f.embeds) out.ties.primary_values = f.tied_values;
      if (f.copy.size() > 0) out.ties.copies[static_cast<std::size_t>(sh.chunk_of(s))].push_back(f.copy);
    }
  }
  return out;
}

/// Every pipeline rank's po::Reservation under `program`, lowering it once (what
/// po::reservation_plan gives rank by rank): for a launcher or a test sizing every rank.
inline std::vector<po::Reservation> reservations(const Options& o, const Setup& su, const po::Program& program,
                                                 bool cuda) {
  const po::Shape& sh = program.shape;
  std::vector<po::StageBytes> all(static_cast<std::size_t>(sh.stages()));
  for (int r = 0; r < sh.d; ++r) {
    const RankStages rs = rank_stages(o, su, sh, r, cuda);
    for (int c = 0; c < sh.v; ++c) {
      const auto s = static_cast<std::size_t>(sh.stage_of(r, c));
      all[s] = rs.stages[s];
    }
  }
  return po::reservation_plans(program, all);
}

namespace detail {

/// The blocks rank `r`'s runtime and optimizer take for themselves, each in the backend's size
/// class (`round`): the step's token ids, targets and document offsets, its results (a non-finite flag per compute
/// op and the last stage's losses, one block), and po::state_bytes's blocks (exact sums, staging, the optimizer's
/// moments and, with bf16 working parameters, its fp32 master). `state` also gets the stages'
/// parameters and gradients as po::state_bytes counts them.
template <class Round>
std::size_t own_blocks(const Options& o, const Setup& su, const po::Program& program, int r, int replica,
                       const RankStages& rs, std::size_t parameter_bytes, Round round, po::StateBytes& state) {
  const std::size_t T = static_cast<std::size_t>(su.runtime.microbatch.tokens()),
                    m = static_cast<std::size_t>(program.shape.m);
  const std::size_t inputs = (rs.tokens ? 1 : 0) + (rs.targets ? 1 : 0);
  std::size_t out = inputs * round(m * T * sizeof(std::int32_t));  // the step's token ids and targets
  if (rs.documents)  // and (--pack) its rows' document offsets, seq + 1 a row
    out += round(m * static_cast<std::size_t>(su.runtime.microbatch.batch) *
                 (static_cast<std::size_t>(su.runtime.microbatch.seq) + 1) * sizeof(std::int32_t));
  // The step's results: a non-finite flag per compute op, then the last stage's losses.
  out += round(std::max<std::size_t>(1, program.ranks[static_cast<std::size_t>(r)].compute.size()) *
                   sizeof(std::uint32_t) +
               m * sizeof(float));
  state = po::state_bytes(rs.params,
                          {.gradients = o.gradients,
                           .dp = o.dp,
                           .replica = replica,
                           .zero = o.zero,
                           .optimizer_states = 2,
                           .reduce_bucket = su.runtime.reduce_bucket,
                           .parameter_bytes = parameter_bytes},
                          rs.ties);
  for (const std::size_t bytes : state.blocks) out += round(bytes);
  return out;
}

}  // namespace detail

/// Pipeline rank `r` of replica `replica` under `program` on backend::Cpu: every block the
/// runtime reserves (po::reservation_plan's region for the CPU GPT's saved, stash and fp32
/// boundary sizes, and its offload bins), the blocks it and AdamW take for themselves
/// (detail::own_blocks), each in its 64-byte size class, and the stages' fp32 parameters and
/// gradients. `res`: rank r's reservation where the caller has it (reservations()).
inline RankBytes cpu_rank_bytes(const Options& o, const Setup& su, const po::Program& program, int r, int replica,
                                const po::Reservation* res = nullptr) {
  using po::backend::Cpu;
  const RankStages rs = rank_stages(o, su, program.shape, r, false);
  const po::Reservation mine = res ? *res : po::reservation_plan(program, r, rs.stages);
  RankBytes out;
  out.device += Cpu::round_up(mine.device);
  for (const po::BlockCount& b : mine.host) out.host += Cpu::round_up(b.bytes) * b.count;
  po::StateBytes state;
  out.device += detail::own_blocks(
      o, su, program, r, replica, rs, sizeof(float), [](std::size_t b) { return Cpu::round_up(b); }, state);
  out.device += state.parameters + state.gradients;
  return out;
}

/// backend::Cuda::Options::arena_bytes for pipeline rank `r` of replica `replica` with either
/// CUDA model (cuda::arena_bytes_for): the libraries' `workspace`, the memory plan's region for
/// the CUDA stages' saved and stash bytes and bf16 boundaries, the blocks the runtime and
/// AdamW take for themselves (detail::own_blocks, with an fp32 master of the bf16 working
/// parameters), and the gradient norm's buffers (one per chunk at most), each in its 256-byte
/// size class. `res`: rank r's reservation where the caller has it (reservations()).
inline std::size_t cuda_arena_bytes(const Options& o, const Setup& su, const po::Program& program, int r, int replica,
                                    std::size_t workspace, const po::Reservation* res = nullptr) {
  const RankStages rs = rank_stages(o, su, program.shape, r, true);
  const po::Reservation mine = res ? *res : po::reservation_plan(program, r, rs.stages);
  po::StateBytes state;
  std::size_t own = detail::own_blocks(o, su, program, r, replica, rs, 2, po::cuda::pool_size_class, state);
  // The gradient norm's buffer: reserved for each chunk's groups in chunk order, one of a
  // larger size class a new block (backend::Cuda::reserve_sum_squares).
  for (std::size_t c = 0, most = 0; c < static_cast<std::size_t>(program.shape.v); ++c) {
    const int s = program.shape.stage_of(r, static_cast<int>(c)), S = program.shape.stages();
    const std::vector<std::size_t> groups =
        o.llama ? po::llama::llama_norm_groups(po::llama::llama_dims(llama_config(o), s, S))
                : po::gpt::gpt_norm_groups(po::gpt::gpt_dims(o.model, s, S));
    const std::size_t need = po::cuda::pool_size_class(po::cuda::norm_buffer_bytes(groups));
    if (need > most) own += need;
    most = std::max(most, need);
  }
  return po::cuda::arena_bytes_for(mine, workspace, own);
}

/// Everything pipeline rank `r` of replica `replica` holds on its GPU with either CUDA model:
/// its arena (cuda_arena_bytes) and its stages' own cudaMalloc'd bf16 parameters, fp32
/// gradients and scratch (gpt::gpt_state_bytes and gpt_workspace, or llama::
/// llama_cuda_state_bytes and llama_cuda_workspace); `host`: the pinned offload bins and
/// backend::Cuda's own pinned staging (po::cuda_staging_bytes of its default Options).
/// What train_gpt --backend cuda reports as reserved_bytes_per_rank; the CUDA context and
/// NCCL's buffers are not counted (the planner's PlanBudget::reserved_bytes).
inline RankBytes cuda_rank_bytes(const Options& o, const Setup& su, const po::Program& program, int r, int replica,
                                 std::size_t workspace, const po::Reservation* res = nullptr) {
  const po::Shape& sh = program.shape;
  const RankStages rs = rank_stages(o, su, sh, r, true);
  const po::Reservation mine = res ? *res : po::reservation_plan(program, r, rs.stages);
  RankBytes out{.device = cuda_arena_bytes(o, su, program, r, replica, workspace, &mine),
                .host = po::cuda::pinned_bytes_for(mine) + po::cuda_staging_bytes()};
  const long long T = su.runtime.microbatch.tokens();
  for (int c = 0; c < sh.v; ++c) {
    if (o.llama) {
      const po::llama::LlamaConfig cfg = llama_config(o);
      const po::llama::LlamaDims d = po::llama::llama_dims(cfg, sh.stage_of(r, c), sh.stages());
      out.device += po::llama::llama_cuda_state_bytes(d, cfg.seq) + po::llama::llama_cuda_workspace(d, T).bytes;
    } else {
      const po::gpt::GptDims d = po::gpt::gpt_dims(o.model, sh.stage_of(r, c), sh.stages());
      out.device += po::gpt::gpt_state_bytes(d) + po::gpt::gpt_workspace(d, T).bytes;
    }
  }
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
  // Several ranks: lower the program once for all of them (a rank at a time lowers it each time).
  const std::vector<po::Reservation> all =
      count > 1 ? reservations(o, su, program, false) : std::vector<po::Reservation>{};
  for (int g = first; g < first + count; ++g) {
    const int r = g % o.shape.d;
    const RankBytes b =
        cpu_rank_bytes(o, su, program, r, g / o.shape.d, all.empty() ? nullptr : &all[static_cast<std::size_t>(r)]);
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
  throw cli::bad_argument(
      "this run needs " + gib(need) + " of memory for its " + std::to_string(count) + " rank" + (count > 1 ? "s" : "") +
      " (activations, stashes, messages, offload bins and model state; rank " + std::to_string(worst_rank) +
      " the most, " + gib(worst) + "), and 10 % more for scratch and stacks, but " + gib(avail) +
      " is available (MemAvailable, or the address-space limit); use fewer ranks, microbatches, layers or a smaller --hidden, --seq or --batch");
}

/// --k auto after its profiling pass: `dev`'s arena made again at `bytes` (reset_arena; 0 keeps
/// its size) where it now holds `held`. Ranks that share one GPU (`shared`: --ranks-per-gpu)
/// take turns, so that no new slab asks for memory a neighbour's old one still holds: every
/// rank lines up (`line_up`: a barrier of every rank of the run, abort-aware), the ranks whose
/// slab shrinks or stays make theirs, every rank lines up again, then the ranks whose slab
/// grows make theirs (together they need what the GPU has free once the others are done).
template <class Device, class LineUp>
void remake_arena(Device& dev, std::size_t bytes, std::size_t held, bool shared, const LineUp& line_up) {
  if (!shared) {
    dev.reset_arena(bytes);
    return;
  }
  const bool grows = bytes > held;
  line_up();
  if (!grows) dev.reset_arena(bytes);
  line_up();
  if (grows) dev.reset_arena(bytes);
}

}  // namespace train_gpt
