// samples/train_gpt_options.hpp: train_gpt's command line: its usage text, its options and the
// parser that checks them (a bad one is a cli::bad_argument naming the flag, the value and
// the allowed range; main exits with status 2), and the Setup every rank derives from them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <pipeoffload/comm/handshake.hpp>
#include <pipeoffload/fnv1a.hpp>
#include <pipeoffload/plan/model.hpp>
#include <pipeoffload/runtime.hpp>
#include <pipeoffload/schedule/schedule.hpp>
#include <pipeoffload/schedule/torch_csv.hpp>

#include <models/gpt/cpu.hpp>
#include <models/gpt/cuda_layout.hpp>
#include <models/gpt/layout.hpp>
#include <models/llama/cpu.hpp>
#include <models/llama/cuda_layout.hpp>
#include <models/llama/layout.hpp>

#include "cli.hpp"
#include "tokens.hpp"

#ifndef PIPEOFFLOAD_CORPUS
#define PIPEOFFLOAD_CORPUS "data/corpus.txt"
#endif

namespace train_gpt {

namespace po = pipeoffload;
using cli::bad_argument;
using cli::to_int;
using cli::to_real;

inline constexpr const char* usage_text = R"(usage: train_gpt [options]

  --schedule NAME       1f1b, 1f1b-i, gis, gis-h, gis-g, po, po-h, po-f, zb-h1, zb-h2 (--chunks 1),
                        zb-v, v-half, v-min, dualpipe-v (--chunks 2; dualpipe-v: M >= 2D)
                        (default po-f; gis with --ranks 1)
  --import FILE         instead of --schedule: a schedule in torch.distributed.pipelining's CSV
                        form (one row per rank; D, V, M from the file, given ones must agree)
  --backend NAME        cpu (default) or cuda: rank r on GPU r (with --comm mpi: the process's local
                        rank), bf16 activations, NCCL messages; needs a CUDA build and D GPUs
  --comm NAME           threads (ranks are threads of this process, default) or mpi (one process per
                        rank: mpirun -np D train_gpt --comm mpi ...)
  --ranks D             pipeline ranks, 1..64; 1 is the one-rank sequential reference (default 4;
                        with --comm mpi the number of processes / R, which it must equal if given)
  --dp R                data-parallel replicas of the pipeline, 1..64: R*D ranks in all (threads, or
                        mpirun -np R*D ... --ranks D --dp R); global rank g = replica * D + rank
  --zero Z              0 (default) or 1: with --dp > 1, shard AdamW's moments across the replicas (ZeRO-1)
  --gradients NAME      standard (default: fp32 gradients accumulated in place, reduce-scattered over
                        the replicas) or exact (fixed-point sums: bit-identical under every schedule,
                        rank count and --dp; 16 more bytes a parameter; docs/gradients.md)
  --reduce-bucket N     with --dp > 1: gradients reduced in buckets of at most N values, 64..1073741824
                        (default 1048576; the staging holds about 8.5 bytes a value of one bucket)
  --reduce-dtype T      with --gradients standard: fp32 (default) or bf16, the type the reduce-scatter
                        sends gradients in (bf16: half its bytes; RuntimeOptions::reduce_dtype)
  --exact-block K       with --gradients exact: microbatches summed in fp32 (in order) between two
                        exact folds, 1..4096 dividing M (default 1; see RuntimeOptions::exact_block)
  --chunks V            chunks (stages) per rank, 1..64; 1 for 1f1b (default 2)
  --microbatches M      microbatches per step of each replica, 1..4096 (the global batch is R*M); a
                        multiple of D for 1f1b-i (default 8)
  --group G             group size of gis-g (required there), ceil(D/2)..D
  --offload-chunks N    offload chunks 0..N-1 (0..V) for any schedule (po-h, po-f imply ceil(V/2), V)
  --k K                 planning: round-trip copy time / (T_F+T_B+T_W), (0, 100]; default 1; auto:
                        measured: a first forward and backward with every chunk offloaded times
                        each stage's passes and copies (po::measured_costs), and the schedule is
                        rebuilt with those times (not counted as a step; the arena starts over)
  --flops F             planning: each stage's F, B and W cost its FLOPs at F FLOP/s, (0, 1e18], as
                        pipeoffload-plan times them (its train_gpt line passes its own); default:
                        every pass of every stage costs 1
  --copy-gbps X         pace the copy engine at X GB/s (a PCIe link); 0 = memcpy speed (default 0)
  --copy-streams N      1: offloads and reloads take turns on one copy stream (default); 2: each on a
                        stream of its own, both directions of the link at once (Costs::copy_streams;
                        ranks with a PCIe partner keep one stream's slots); auto: whichever the
                        simulator says is faster under the planning (or, with --k auto, measured) times
  --duplex-slowdown X   with --copy-streams 2 or auto: a copy's time while the other direction
                        copies too, over its time alone, [1, 100] (default 1; an H100 SXM: 1.31)
  --no-reload-parts     reload each offloaded unit whole, its B after it (default: in the model's
                        saved_parts, the head's then each block's, a B starting once the first is
                        back; RuntimeOptions::reload_parts, Costs::reload_shares)
  --steps N             optimizer steps, 1..1000000 (default 200)
  --eval-every N        hold out the corpus's last 10% and print the loss on it every N steps (forward
                        passes only); 0 = off, the whole corpus trains (default 0)
  --decay-all           weight decay on every parameter, as before parameter groups (default: none on
                        biases and LayerNorm gains, GPT-2's rule)
  --no-check-finite     do not scan activations and input gradients for NaN/Inf (losses are still checked)
  --graphs              capture each rank's training call once (the second step) and replay it at every
                        later step (CUDA graphs on --backend cuda, one rank: --ranks 1 --dp 1, not
                        with --pack or --trace; RuntimeOptions::graphs)
  --seed S              model, dropout and data seed (default 1)
  --trace FILE          write a Chrome trace of the last step's real run (compute and copy streams per rank;
                        on a GPU the times of CUDA events where each op starts and ends)
  --layers L --hidden H --heads A --seq S --batch B --lr LR --dropout P
                        model: 8 blocks, h=64, 4 heads, seq 64, batch 4 per microbatch, lr 3e-3, dropout 0.1
  --model NAME          gpt (default: LayerNorm, learned positions, GeLU MLP, dropout) or llama (RMSNorm,
                        RoPE, grouped-query attention, SwiGLU MLP, no biases or dropout)
  --kv-heads G          llama: key/value heads, dividing --heads (default --heads)
  --ffn F               llama: the SwiGLU MLP's inner width, 1..1048576 (default 8h/3 rounded up to 32)
  --pack ID             pack documents into each sequence, a new one starting at every token ID (an
                        end-of-text id: 50256 in GPT-2 shards, 10 for the corpus's lines); attention stays
                        within a document and positions restart (the step input cu_seqlens; on a GPU
                        through cuDNN's ragged attention)
  --tie-embeddings      the LM head's weight is the token embedding (one parameter held by the first and
                        the last stage, po::SharedParam; --backend cpu)
  --stage-blocks B0,B1,...
                        blocks of each stage (D*V counts, each >= 0, adding up to L; the first and
                        last stage also hold the embedding and the head); default as even as can be
  --corpus FILE         text to train on, byte-level (default data/corpus.txt)
  --data FILE           train on a token shard instead (llm.c's .bin layout: samples/tokens.hpp;
                        scripts/make_shard.py makes one from a text); the model's vocabulary is the shard's
  --val-data FILE       with --eval-every: held-out tokens from this shard (default: the last 10%)
  --vocab V             the vocabulary of a --data shard whose header leaves it 0, 2..1048576
  --comm-timeout S      with --comm mpi: a send or receive that waits S seconds fails, naming the op
                        and the peer (0, 86400]; default 300
  --checkpoint-every N  save parameters, AdamW state, step, RNG seed and data position every N steps
  --checkpoint-dir DIR  where (DIR/step-N/stage-S.bin, DIR/latest); defaults to --resume's DIR
  --resume DIR          continue from DIR/latest (same model, stages, batch, optimizer, steps, seed, data)
  --overwrite           let a fresh run's --checkpoint-dir replace another run's checkpoints (refused
                        without it)
  --inject-fault R:S:K  testing: global rank R fails in step S (0-based), mid-iteration, by K = kill (SIGKILL),
                        throw, or hang (--comm mpi only: its peers' timeout ends the run)
  --ranks-per-gpu N     --backend cuda, thread ranks: N = R x D ranks share one GPU (1..64; default 1), their
                        messages and replica collectives device copies ordered by events (comm::SharedGpu,
                        no NCCL); a mode to debug and check a pipeline on one GPU, not a speed-up
  --pcie-pairs          CPU thread ranks: treat ranks (r, r^1) as a PCIe pair and synchronise their copies
                        (po::PairLink); --backend cuda pairs the GPUs that share a switch by itself
  --quiet               no progress lines
)";

struct Options {
  std::string schedule;
  std::string import_text;  ///< --import: the torch CSV schedule (empty: --schedule)
  po::ScheduleSpec spec{};
  po::Shape shape{4, 2, 8};
  double k = 1, copy_gbps = 0;
  int copy_streams = 1;        // --copy-streams: 1 or 2; 0: auto
  double duplex_slowdown = 1;  // --duplex-slowdown (Costs::duplex_slowdown)
  double flops = 0;            // --flops; 0: unit pass costs
  bool k_auto = false;         // --k auto: measured in a profiling pass
  int steps = 200;
  std::uint64_t seed = 1;
  std::optional<std::string> trace;
  po::gpt::GptConfig model{};  // the model's sizes (both architectures) and the GPT's own settings
  bool llama = false;          // --model llama
  int kv_heads = 0, ffn = 0;   // llama: key/value heads (0: --heads), SwiGLU width (0: 8h/3)
  int pack = -1;               // --pack: the token id that starts a document (-1: rows unpacked)
  int batch = 4;
  float lr = 3e-3f;
  std::string corpus = PIPEOFFLOAD_CORPUS;
  std::string data, val_data;  // token shards (--data, --val-data)
  long long vocab = 0;         // --vocab
  bool quiet = false;
  bool mpi = false, ranks_given = false;
  double comm_timeout = 300;
  bool cuda = false;
  int ranks_per_gpu = 1;    // --ranks-per-gpu: thread ranks sharing each GPU (comm::SharedGpu)
  bool pcie_pairs = false;  // CPU thread ranks: synchronise the copies of ranks (r, r^1)
  int dp = 1, zero = 0;     // data-parallel replicas, ZeRO stage
  po::Gradients gradients = po::Gradients::standard;  // RuntimeOptions::gradients
  int exact_block = 1;                                // RuntimeOptions::exact_block
  std::size_t reduce_bucket = std::size_t{1} << 20;   // RuntimeOptions::reduce_bucket
  po::DType reduce_dtype = po::DType::float32;        // RuntimeOptions::reduce_dtype
  int eval_every = 0;                                 // steps between validation losses; 0: no held-out split
  bool decay_all = false;                             // weight decay on every parameter (before parameter groups)
  bool check_finite = true;
  bool graphs = false;       // RuntimeOptions::graphs
  bool reload_parts = true;  // RuntimeOptions::reload_parts (and Costs::reload_shares from the stages)
  int checkpoint_every = 0;
  std::string checkpoint_dir, resume;
  bool overwrite = false;  // --overwrite: a fresh run may replace another run's checkpoints
  struct Fault {
    int rank = -1, step = -1;
    std::string kind;  // kill, throw, hang
  } fault;
};

/// train_gpt's options; the switches take no value.
inline constexpr cli::Flag flags[] = {{"--schedule"},
                                      {"--import"},
                                      {"--ranks"},
                                      {"--chunks"},
                                      {"--microbatches"},
                                      {"--group"},
                                      {"--offload-chunks"},
                                      {"--k"},
                                      {"--flops"},
                                      {"--copy-gbps"},
                                      {"--copy-streams"},
                                      {"--duplex-slowdown"},
                                      {"--steps"},
                                      {"--seed"},
                                      {"--trace"},
                                      {"--layers"},
                                      {"--stage-blocks"},
                                      {"--hidden"},
                                      {"--heads"},
                                      {"--seq"},
                                      {"--batch"},
                                      {"--lr"},
                                      {"--dropout"},
                                      {"--corpus"},
                                      {"--comm"},
                                      {"--comm-timeout"},
                                      {"--checkpoint-every"},
                                      {"--checkpoint-dir"},
                                      {"--resume"},
                                      {"--inject-fault"},
                                      {"--backend"},
                                      {"--eval-every"},
                                      {"--dp"},
                                      {"--zero"},
                                      {"--exact-block"},
                                      {"--gradients"},
                                      {"--reduce-bucket"},
                                      {"--reduce-dtype"},
                                      {"--data"},
                                      {"--val-data"},
                                      {"--vocab"},
                                      {"--model"},
                                      {"--kv-heads"},
                                      {"--ffn"},
                                      {"--pack"},
                                      {"--ranks-per-gpu"},
                                      {"--quiet", false},
                                      {"--pcie-pairs", false},
                                      {"--overwrite", false},
                                      {"--decay-all", false},
                                      {"--tie-embeddings", false},
                                      {"--no-check-finite", false},
                                      {"--graphs", false},
                                      {"--no-reload-parts", false}};

inline Options parse(int argc, char** argv) {
  cli::help(argc, argv, usage_text);
  const cli::Args args(argc, argv, flags);
  const bool tie = args.has("--tie-embeddings");
  Options o;
  o.quiet = args.has("--quiet");
  o.pcie_pairs = args.has("--pcie-pairs");
  o.decay_all = args.has("--decay-all");
  o.overwrite = args.has("--overwrite");
  o.check_finite = !args.has("--no-check-finite");
  o.graphs = args.has("--graphs");
  o.reload_parts = !args.has("--no-reload-parts");
  o.model.tie_embeddings = tie;
  const auto get = [&](std::string_view f) { return args.get(f); };
  if (auto v = get("--ranks")) o.shape.d = static_cast<int>(to_int("--ranks", *v, 1, 64));
  o.ranks_given = get("--ranks") != nullptr;
  if (auto v = get("--comm")) {
    o.mpi = cli::one_of("--comm", *v, {"threads", "mpi"}) == "mpi";
#ifndef PIPEOFFLOAD_WITH_MPI
    if (o.mpi)
      throw bad_argument(
          "--comm mpi: this train_gpt was built without MPI (install openmpi-bin and libopenmpi-dev, then reconfigure)");
#endif
  }
  if (auto v = get("--model")) {
    o.llama = cli::one_of("--model", *v, {"gpt", "llama"}) == "llama";
  }
  for (const char* f : {"--kv-heads", "--ffn"})
    if (!o.llama && get(f)) throw bad_argument(std::string(f) + " applies only to --model llama");
  if (o.llama && get("--dropout")) throw bad_argument("--dropout does not apply to --model llama (it has no dropout)");
  if (auto v = get("--backend")) {
    cli::one_of("--backend", *v, {"cpu", "cuda"});
    if (*v == "cuda" && tie && !o.llama)
      throw bad_argument("--tie-embeddings: the CUDA GPT does not tie its embeddings yet; use --backend cpu");
    if (*v == "cuda" && get("--pack") && o.graphs)
      throw bad_argument(
          "--graphs with --pack on --backend cuda: a packed microbatch's attention follows its document count, read "
          "on the host at every call, which a replayed capture cannot; give one of them");
    if (*v == "cuda" && get("--trace") && o.graphs)
      throw bad_argument(
          "--trace with --graphs on --backend cuda: a replayed step records no event times, so the trace would be the "
          "captured step's enqueue times, not the last step's run; give one of them");
    if (const std::string* seq = get("--seq"); *v == "cuda" && seq && to_int("--seq", *seq, 1, 8192) < 2)
      throw bad_argument(
          "--seq 1 on --backend cuda: cuDNN's attention backward needs seq >= 2 (--backend cpu trains it)");
    o.cuda = *v == "cuda";
#ifndef PIPEOFFLOAD_WITH_CUDA
    if (o.cuda)
      throw bad_argument(
          "--backend cuda: this train_gpt was built without CUDA (install the CUDA toolkit, cuDNN and NCCL, then reconfigure)");
#endif
    if (o.cuda && get("--copy-gbps"))
      throw bad_argument("--copy-gbps applies only to --backend cpu (a GPU's copies run at its link's speed)");
  }
  if (auto v = get("--ranks-per-gpu")) {
    o.ranks_per_gpu = static_cast<int>(to_int("--ranks-per-gpu", *v, 1, 64));
    if (!o.cuda)
      throw bad_argument("--ranks-per-gpu applies only to --backend cuda (CPU ranks share the host already)");
    if (o.mpi)
      throw bad_argument(
          "--ranks-per-gpu: MPI processes cannot share a GPU here (that would need CUDA IPC); use --comm threads");
  }
  if (auto v = get("--comm-timeout")) {
    if (!o.mpi) throw bad_argument("--comm-timeout applies only to --comm mpi");
    o.comm_timeout = to_real("--comm-timeout", *v, 0, 86400, true);
  }
  if (auto v = get("--checkpoint-every"))
    o.checkpoint_every = static_cast<int>(to_int("--checkpoint-every", *v, 1, 1000000));
  if (auto v = get("--resume")) o.resume = *v;
  if (auto v = get("--checkpoint-dir"))
    o.checkpoint_dir = *v;
  else
    o.checkpoint_dir = o.resume;
  if (o.checkpoint_every > 0 && o.checkpoint_dir.empty())
    throw bad_argument("--checkpoint-every needs --checkpoint-dir DIR (or --resume DIR)");
  if (o.checkpoint_every == 0 && get("--checkpoint-dir"))
    throw bad_argument("--checkpoint-dir needs --checkpoint-every N");
  if (auto v = get("--inject-fault")) {
    const std::string& f = *v;
    const auto c1 = f.find(':'), c2 = c1 == std::string::npos ? c1 : f.find(':', c1 + 1);
    if (c2 == std::string::npos)
      throw bad_argument("--inject-fault must be RANK:STEP:KIND (KIND kill, throw or hang), got '" + f + "'");
    o.fault.rank = static_cast<int>(to_int("--inject-fault's rank", f.substr(0, c1), 0, 4095));
    o.fault.step = static_cast<int>(to_int("--inject-fault's step", f.substr(c1 + 1, c2 - c1 - 1), 0, 1000000));
    o.fault.kind = f.substr(c2 + 1);
    if (o.fault.kind != "kill" && o.fault.kind != "throw" && o.fault.kind != "hang")
      throw bad_argument("--inject-fault's kind must be kill, throw or hang, got '" + o.fault.kind + "'");
    if (o.fault.kind == "hang" && !o.mpi)
      throw bad_argument("--inject-fault R:S:hang needs --comm mpi (thread ranks have no receive timeout)");
  }
  if (auto v = get("--dp")) o.dp = static_cast<int>(to_int("--dp", *v, 1, 64));
  if (auto v = get("--zero")) o.zero = static_cast<int>(to_int("--zero", *v, 0, 1));
  if (auto v = get("--gradients")) {
    cli::one_of("--gradients", *v, {"standard", "exact"});
    o.gradients = *v == "exact" ? po::Gradients::exact : po::Gradients::standard;
  }
  if (auto v = get("--reduce-bucket"))
    o.reduce_bucket = static_cast<std::size_t>(to_int("--reduce-bucket", *v, 64, 1LL << 30));
  if (auto v = get("--reduce-dtype")) {
    cli::one_of("--reduce-dtype", *v, {"fp32", "bf16"});
    o.reduce_dtype = *v == "bf16" ? po::DType::bfloat16 : po::DType::float32;
    if (o.reduce_dtype == po::DType::bfloat16 && o.gradients != po::Gradients::standard)
      throw bad_argument("--reduce-dtype bf16 needs --gradients standard (the exact path reduces 128-bit sums)");
  }
  if (auto v = get("--exact-block")) {
    o.exact_block = static_cast<int>(to_int("--exact-block", *v, 1, 4096));
    if (o.gradients != po::Gradients::exact)
      throw bad_argument("--exact-block needs --gradients exact (the standard path has no exact folds)");
  }
  if (auto v = get("--chunks")) o.shape.v = static_cast<int>(to_int("--chunks", *v, 1, 64));
  if (auto v = get("--microbatches")) o.shape.m = static_cast<int>(to_int("--microbatches", *v, 1, 4096));
  if (o.shape.m % o.exact_block != 0)
    throw bad_argument("--exact-block " + std::to_string(o.exact_block) + " must divide --microbatches " +
                       std::to_string(o.shape.m));
  if (auto v = get("--steps")) o.steps = static_cast<int>(to_int("--steps", *v, 1, 1000000));
  if (auto v = get("--eval-every")) o.eval_every = static_cast<int>(to_int("--eval-every", *v, 0, 1000000));
  if (auto v = get("--seed")) o.seed = static_cast<std::uint64_t>(to_int("--seed", *v, 0, (1LL << 62)));
  if (auto v = get("--k")) {
    if (*v == "auto")
      o.k_auto = true;
    else
      o.k = to_real("--k", *v, 0, 100, true);
  }
  if (auto v = get("--flops")) o.flops = to_real("--flops", *v, 0, 1e18, true);
  if (auto v = get("--copy-gbps")) o.copy_gbps = to_real("--copy-gbps", *v, 0, 1e4, false);
  const cli::CopyStreams streams = cli::copy_streams(args, true);
  o.copy_streams = streams.streams;
  o.duplex_slowdown = streams.slowdown;
  if (o.copy_streams != 1 && o.pcie_pairs)
    throw bad_argument(
        "--copy-streams " + std::string(o.copy_streams == 0 ? "auto" : "2") +
        " with --pcie-pairs: paired ranks share their switch's link, so a second stream gains nothing and their "
        "counters count one stream's copies; give one of them");
  if (auto v = get("--trace")) o.trace = *v;
  if (auto v = get("--corpus")) o.corpus = *v;
  if (auto v = get("--data")) o.data = *v;
  if (auto v = get("--val-data")) o.val_data = *v;
  if (auto v = get("--vocab")) o.vocab = to_int("--vocab", *v, 2, sample::max_vocab);
  if (!o.data.empty() && get("--corpus")) throw bad_argument("--data and --corpus exclude each other");
  if (o.data.empty() && (get("--val-data") || get("--vocab")))
    throw bad_argument(std::string(get("--val-data") ? "--val-data" : "--vocab") + " needs --data FILE");
  if (!o.val_data.empty() && o.eval_every == 0) throw bad_argument("--val-data needs --eval-every N");
  o.model.layers = 8;
  o.model.hidden = 64;
  o.model.heads = 4;
  o.model.seq = 64;
  if (auto v = get("--layers")) o.model.layers = static_cast<int>(to_int("--layers", *v, 1, 4096));
  if (auto v = get("--hidden")) o.model.hidden = static_cast<int>(to_int("--hidden", *v, 1, 8192));
  if (auto v = get("--heads")) o.model.heads = static_cast<int>(to_int("--heads", *v, 1, 1024));
  if (auto v = get("--seq")) o.model.seq = static_cast<int>(to_int("--seq", *v, 1, 8192));
  if (auto v = get("--batch")) o.batch = static_cast<int>(to_int("--batch", *v, 1, 4096));
  if (auto v = get("--lr")) o.lr = static_cast<float>(to_real("--lr", *v, 0, 10, true));
  if (auto v = get("--dropout")) o.model.dropout = static_cast<float>(to_real("--dropout", *v, 0, 0.99, false));
  if (o.model.hidden % o.model.heads != 0)
    throw bad_argument("--heads " + std::to_string(o.model.heads) + " must divide --hidden " +
                       std::to_string(o.model.hidden));
  o.model.seed = o.seed;
  if (o.llama) {
    o.kv_heads = o.model.heads;
    if (auto v = get("--kv-heads")) o.kv_heads = static_cast<int>(to_int("--kv-heads", *v, 1, 1024));
    if (o.model.heads % o.kv_heads != 0)
      throw bad_argument("--kv-heads " + std::to_string(o.kv_heads) + " must divide --heads " +
                         std::to_string(o.model.heads));
    if ((o.model.hidden / o.model.heads) % 2 != 0)
      throw bad_argument("--model llama: --hidden / --heads = " + std::to_string(o.model.hidden / o.model.heads) +
                         " must be even (RoPE rotates pairs)");
    if (auto v = get("--ffn")) o.ffn = static_cast<int>(to_int("--ffn", *v, 1, 1 << 20));
    o.model.dropout = 0.0f;  // the Llama has none (the configuration text says so)
  }
  if (auto v = get("--pack")) o.pack = static_cast<int>(to_int("--pack", *v, 0, sample::max_vocab - 1));
  o.model.packed = o.pack >= 0;
  if (auto v = get("--stage-blocks")) {
    std::vector<int> blocks;
    long long sum = 0;
    for (std::size_t at = 0; at <= v->size();) {
      const std::size_t comma = std::min(v->find(',', at), v->size());
      const long long b = to_int("--stage-blocks", v->substr(at, comma - at), 0, 4096);
      blocks.push_back(static_cast<int>(b));
      sum += b;
      at = comma + 1;
    }
    if (sum != o.model.layers)
      throw bad_argument("--stage-blocks " + *v + " adds up to " + std::to_string(sum) + " blocks; --layers is " +
                         std::to_string(o.model.layers));
    o.model.stage_blocks = std::move(blocks);
  }

  o.schedule = get("--schedule") ? *get("--schedule") : (o.shape.d == 1 ? "gis" : "po-f");
  const std::string& n = o.schedule;
  o.spec = cli::schedule_option(n, get("--group"), o.shape.d);
  o.shape.placement = o.spec.placement;  // which rank holds which stage (the V families: a V)
  if (auto f = get("--import")) {
    if (get("--schedule") || get("--group"))
      throw bad_argument("--import cannot be combined with --schedule or --group: the file is the schedule");
    std::string text = sample::read_regular_file(*f, "--import");
    po::TorchCsvOptions io;
    io.d = o.ranks_given ? o.shape.d : 0;
    io.v = get("--chunks") ? o.shape.v : 0;
    io.m = get("--microbatches") ? o.shape.m : 0;
    try {
      const po::Program p = po::from_torch_csv(text, io);
      o.shape = p.shape;
      o.spec = p.spec;
    } catch (const po::schedule_error& e) {
      throw bad_argument(*f + ": " + e.what());
    }
    o.ranks_given = true;  // the file's rows, also under MPI
    o.schedule = "imported";
    o.import_text = std::move(text);
    if (o.shape.m % o.exact_block != 0)
      throw bad_argument("--exact-block " + std::to_string(o.exact_block) + " must divide the file's " +
                         std::to_string(o.shape.m) + " microbatches");
  }
  if (o.graphs && o.pcie_pairs)
    throw bad_argument(
        "--graphs replays captured copies, which cannot follow --pcie-pairs' counters; give one of them");
  if (o.graphs && o.cuda && (o.shape.d != 1 || o.dp != 1))
    throw bad_argument(
        "--graphs on --backend cuda captures one rank without replicas (--ranks 1 --dp 1); this run has "
        "--ranks " +
        std::to_string(o.shape.d) + " --dp " + std::to_string(o.dp));
  if (o.pcie_pairs && (o.mpi || o.cuda))
    throw bad_argument(
        "--pcie-pairs applies only to --backend cpu with thread ranks (MPI processes run unpaired; --backend cuda pairs GPUs by their PCIe switches)");
  if (!o.model.stage_blocks.empty() && static_cast<int>(o.model.stage_blocks.size()) != o.shape.stages())
    throw bad_argument("--stage-blocks gives " + std::to_string(o.model.stage_blocks.size()) +
                       " stages; the pipeline has " + std::to_string(o.shape.stages()) + " (--ranks " +
                       std::to_string(o.shape.d) + " x --chunks " + std::to_string(o.shape.v) + ")");
  if (auto v = get("--offload-chunks")) {
    const int x = static_cast<int>(to_int("--offload-chunks", *v, 0, o.shape.v));
    if (n == "po-h" || n == "po-f")
      throw bad_argument("--offload-chunks does not apply to " + n + " (it offloads " + (n == "po-h" ? "half" : "all") +
                         " the chunks)");
    o.spec.offload = po::offload::first(x);
  }
  return o;
}

/// The Llama configuration of the options (--model llama): the sizes, seed, tie and cut of
/// `model`, with --kv-heads and --ffn.
inline po::llama::LlamaConfig llama_config(const Options& o) {
  return {.vocab = o.model.vocab,
          .hidden = o.model.hidden,
          .heads = o.model.heads,
          .kv_heads = o.kv_heads > 0 ? o.kv_heads : o.model.heads,
          .ffn = o.ffn,
          .layers = o.model.layers,
          .seq = o.model.seq,
          .tie_embeddings = o.model.tie_embeddings,
          .packed = o.pack >= 0,
          .seed = o.model.seed,
          .stage_blocks = o.model.stage_blocks};
}

/// What stage s of S holds, for either architecture: blocks, the embedding, the head.
inline po::StageContent stage_content(const Options& o, int s, int S) {
  if (o.llama) {
    const po::llama::LlamaDims d = po::llama::llama_dims(llama_config(o), s, S);
    return {d.blocks, d.embeds, d.has_head};
  }
  const po::gpt::GptDims d = po::gpt::gpt_dims(o.model, s, S);
  return {d.blocks, d.embeds, d.has_head};
}

/// Costs::reload_shares of the model's stages: each stage's saved_parts as its backend lays
/// them out (the head's, then the blocks'), as shares of its unit; none with --no-reload-parts.
inline std::vector<std::vector<double>> reload_shares_of(const Options& o) {
  if (!o.reload_parts) return {};
  const po::MicrobatchShape mb{o.batch, o.model.seq};
  const int S = o.shape.stages();
  std::vector<std::vector<double>> out;
  for (int s = 0; s < S; ++s) {
    std::vector<po::SavedPart> parts;
    if (o.llama) {
      const po::llama::LlamaDims d = po::llama::llama_dims(llama_config(o), s, S);
      parts = o.cuda ? po::llama::llama_cuda_saved_parts(d, mb.tokens()) : po::llama::cpu_bytes::saved_parts(d, mb);
    } else {
      const po::gpt::GptDims d = po::gpt::gpt_dims(o.model, s, S);
      parts = o.cuda ? po::gpt::gpt_cuda_saved_parts(d, mb.tokens()) : po::gpt::gpt_cpu_bytes::saved_parts(d, mb);
    }
    out.push_back(po::saved_part_shares(parts));
  }
  return out;
}

/// " stage-blocks=B0,B1,..." for an uneven layout, "" for the default one.
inline std::string stage_blocks_text(const po::gpt::GptConfig& m) {
  std::string s;
  for (const int b : m.stage_blocks) s += (s.empty() ? " stage-blocks=" : ",") + std::to_string(b);
  return s;
}

/// --copy-streams auto: the program `make(costs)` builds with one copy stream and with two,
/// whichever simulates faster under its costs (one on a tie, and where a second stream cannot
/// help: po::second_copy_stream_may_help).
template <class Make>
po::Program best_copy_streams(po::Costs costs, const Make& make) {
  costs.copy_streams = 1;
  po::Program single = make(costs);
  if (!po::second_copy_stream_may_help(single.shape.d, costs.stagger_pairs)) return single;
  costs.copy_streams = 2;
  po::Program two = make(costs);
  return po::simulate(two).makespan < po::simulate(single).makespan ? two : single;
}

/// The program of the options: --import's file (with --offload-chunks as its offload) or
/// --schedule's build, under `costs`.
inline po::Program program_of(const Options& o, const po::Costs& costs = {}) {
  const auto one = [&](const po::Costs& c) {
    if (o.import_text.empty()) return po::build(o.spec, o.shape, c);
    po::TorchCsvOptions io;
    io.d = o.shape.d;
    io.v = o.shape.v;
    io.m = o.shape.m;
    io.placement = o.shape.placement;
    io.offload = o.spec.offload;
    io.costs = c;
    return po::from_torch_csv(o.import_text, io);
  };
  if (o.copy_streams != 0) return one(costs);
  return best_copy_streams(costs, one);
}

/// --k auto's profiling program: the run's schedule with every chunk offloaded (an imported
/// schedule offloads what its file says), so that every stage's copies are timed.
inline po::Program probe_program(Options o, po::Costs costs) {
  if (o.import_text.empty()) o.spec.offload = po::offload::all;
  // One copy stream: each copy timed alone (two streams' copies include the slowdown).
  o.copy_streams = 1;
  costs.copy_streams = 1;
  return program_of(o, costs);
}

/// The costs the program is built with: with --flops, po::stage_costs of this GPT and its cut
/// (what pipeoffload-plan builds the same schedule with, so a plan's command runs the program
/// the plan timed and lowered); otherwise every pass of every stage costs 1. Either way the
/// copy ratio is --k.
inline po::Costs program_costs(const Options& o) {
  po::Costs c;
  c.k = o.k;
  c.copy_streams = o.copy_streams == 2 ? 2 : 1;  // auto: program_of tries both
  c.duplex_slowdown = o.duplex_slowdown;
  c.reload_shares = reload_shares_of(o);
  if (!(o.flops > 0)) return c;
  const po::TransformerSpec m{.layers = o.model.layers,
                              .hidden = o.model.hidden,
                              .heads = o.model.heads,
                              .query_groups = o.llama ? llama_config(o).kv_heads : o.model.heads,
                              .seq = o.model.seq,
                              .micro_batch = o.batch,
                              .vocab = o.model.vocab,
                              .ffn_hidden = o.llama ? llama_config(o).ffn_width() : 0,
                              .swiglu = o.llama,
                              .recompute = o.model.recompute,
                              .tied_embeddings = o.model.tie_embeddings};
  std::vector<po::StageContent> cut;
  const int S = o.shape.stages();
  for (int s = 0; s < S; ++s) cut.push_back(stage_content(o, s, S));
  po::Costs out = po::stage_costs(m, cut, o.flops, o.k, o.cuda ? po::PlanBackend::cuda : po::PlanBackend::cpu);
  out.copy_streams = c.copy_streams;
  out.duplex_slowdown = c.duplex_slowdown;
  if (!o.reload_parts) out.reload_shares.clear();  // (po::stage_costs': the models' parts, as the planner has them)
  return out;
}

/// What every rank shares: the data, the schedule and its costs, the optimizer's settings,
/// the configuration it agrees on.
struct Setup {
  sample::Tokens tokens;  // tokens[0, train_tokens) train
  std::size_t train_tokens = 0;
  sample::Tokens held;  // held[held_begin, held_end): held out (--eval-every)
  std::size_t held_begin = 0, held_end = 0;
  po::Costs costs{};  // planning costs (the CUDA launcher sets stagger_pairs)
  po::RuntimeOptions runtime{};
  po::WarmupCosine lr{};
  float clip = 1.0f;
  po::AdamWOptions adamw{};
  std::vector<po::HandshakeField> fields;  // the handshake's
  std::uint64_t config_hash = 0;           // of what the training state depends on (checkpoints)
  std::string config;                      // the same as key=value words (CheckpointInfo::config)
  std::size_t tokens_per_step = 0;         // of one replica
};

/// `tokens`: the corpus's bytes or the --data shard; `val`: the --val-data shard, if any.
inline Setup make_setup(const Options& o, sample::Tokens tokens, std::optional<sample::Tokens> val = std::nullopt) {
  Setup s;
  s.tokens = std::move(tokens);
  const po::Shape sh = o.shape;
  const std::size_t n = s.tokens.size();
  if (val) {
    s.train_tokens = n;
    s.held = std::move(*val);
    s.held_end = s.held.size();
  } else {
    s.train_tokens = o.eval_every > 0 ? n - n / 10 : n;
    s.held = s.tokens;
    s.held_begin = s.train_tokens;
    s.held_end = n;
  }
  s.costs = program_costs(o);
  s.runtime = {.microbatch = {o.batch, o.model.seq},
               .check_finite = o.check_finite,
               .gradients = o.gradients,
               .reduce_bucket = o.reduce_bucket,
               .reduce_dtype = o.reduce_dtype,
               .exact_block = o.exact_block,
               .graphs = o.graphs,
               .reload_parts = o.reload_parts};
  s.lr = {.lr = o.lr,
          .warmup_steps = std::max(1, std::min(20, o.steps / 10)),
          .total_steps = o.steps,
          .min_lr_ratio = 0.1f};
  s.adamw.weight_decay = 0.01f;
  s.adamw.zero = o.zero;
  s.adamw.overlap_gather = true;  // ZeRO-1: the parameter gather runs behind the next step's first passes
  // GPT-2's rule: no weight decay on biases and LayerNorm gains (the 1-d tensors).
  if (!o.decay_all)
    s.adamw.groups.push_back({"no decay", [](const po::ParamInfo& t) { return t.shape.size() < 2; }, 1.0f, 0.0f});
  s.tokens_per_step = static_cast<std::size_t>(s.runtime.microbatch.tokens()) * static_cast<std::size_t>(sh.m);
  char lr[32], drop[32], k[32];
  std::snprintf(lr, sizeof lr, "%.9g", static_cast<double>(o.lr));
  std::snprintf(drop, sizeof drop, "%.9g", static_cast<double>(o.model.dropout));
  std::snprintf(k, sizeof k, "%.17g", o.k);
  char flops[32];
  std::snprintf(flops, sizeof flops, "%.17g", o.flops);
  const std::string model = "layers=" + std::to_string(o.model.layers) + " hidden=" + std::to_string(o.model.hidden) +
                            " heads=" + std::to_string(o.model.heads) + " seq=" + std::to_string(o.model.seq) +
                            " dropout=" + drop +
                            (o.model.vocab != 256 ? " vocab=" + std::to_string(o.model.vocab) : "") +
                            (o.model.tie_embeddings ? " tied" : "") +
                            (o.llama ? " arch=llama kv-heads=" + std::to_string(llama_config(o).kv_heads) +
                                           " ffn=" + std::to_string(llama_config(o).ffn_width())
                                     : "") +
                            (o.pack >= 0 ? " pack=" + std::to_string(o.pack) : "");
  // The global batch: R replicas of m microbatches train as one replica of R*m.
  const std::string batch = "batch=" + std::to_string(o.batch) + " microbatches=" + std::to_string(o.dp * sh.m) +
                            (o.exact_block > 1 ? " exact-block=" + std::to_string(o.exact_block) : "");
  const std::string train = "steps=" + std::to_string(o.steps) + " lr=" + lr + " seed=" + std::to_string(o.seed) +
                            " decay=" + (o.decay_all ? "all" : "2d-only");
  char data[160];
  std::snprintf(data, sizeof data, "%zu tokens, vocab %lld, fnv1a %016llx, %zu train, held out %016llx [%zu, %zu)", n,
                s.tokens.vocab(), static_cast<unsigned long long>(s.tokens.hash()), s.train_tokens,
                static_cast<unsigned long long>(s.held.hash()), s.held_begin, s.held_end);
  s.fields = po::handshake_fields(o.spec, sh);
  s.fields.push_back({"model", model + " stages=" + std::to_string(sh.stages()) + stage_blocks_text(o.model)});
  s.fields.push_back({"batch", batch});
  s.fields.push_back({"training", train});
  s.fields.push_back({"data parallel", "dp=" + std::to_string(o.dp) + " zero=" + std::to_string(o.zero) +
                                           " gradients=" + po::gradients_name(o.gradients) +
                                           (o.reduce_dtype == po::DType::bfloat16 ? " reduce=bf16" : "")});
  s.fields.push_back({"data", data});
  s.fields.push_back(
      {"planning",
       "k=" + (o.k_auto ? std::string("auto") : std::string(k)) + " flops=" + flops +
           " offload=" + std::to_string(po::offload::count(o.spec.offload, sh.v)) +
           (o.copy_streams != 1 ? " copy-streams=" + std::string(o.copy_streams == 0 ? "auto" : "2") : std::string())});
  s.fields.push_back({"run", "checkpoint-every=" + std::to_string(o.checkpoint_every) +
                                 " resume=" + (o.resume.empty() ? "no" : "yes") + " trace=" + (o.trace ? "yes" : "no") +
                                 " eval-every=" + std::to_string(o.eval_every) +
                                 " check-finite=" + (o.check_finite ? "yes" : "no") + (o.graphs ? " graphs=yes" : "")});
  // The training state depends on these, not on the schedule, the cut into stages, the rank
  // count or the replica count (every schedule, cut and split of the global batch trains
  // bit-identically), so a checkpoint resumes under any of them (another cut by tensor names).
  s.config_hash = po::fnv1a(model + "|" + batch + "|" + train + "|" + data);
  char data_words[160];
  std::snprintf(data_words, sizeof data_words, "tokens=%zu vocab=%lld data-fnv1a=%016llx train-tokens=%zu", n,
                s.tokens.vocab(), static_cast<unsigned long long>(s.tokens.hash()), s.train_tokens);
  s.config = model + " " + batch + " " + train + " " + data_words;
  return s;
}

}  // namespace train_gpt
