// pipeoffload/plan/model.hpp: what the planner knows about a transformer and a machine: the
// bytes one layer (and the embedding, the LM head) saves and the FLOPs of its passes, per
// microbatch, for GPT-like and Llama-class layers, counted once here for the planner, the plan
// tool and bench/paper. The derivation, term by term: docs/layer_counts.md.
/// @file
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../memory/scratch.hpp"
#include "../memory/state.hpp"
#include "../policy/host_bins.hpp"
#include "../schedule/program.hpp"

namespace pipeoffload {

/// Bytes in a GiB (2^30).
inline constexpr double gib = 1024.0 * 1024.0 * 1024.0;

/// A GPT-like decoder-only transformer and how it is trained (one microbatch = micro_batch
/// sequences; an iteration = global_batch sequences, so m = global_batch / micro_batch).
/// @code
///   pipeoffload::TransformerSpec m{.layers = 78, .hidden = 10240, .heads = 80, .query_groups = 8};
///   double a = pipeoffload::activation_bytes_per_layer(m);   // 31bsh at s = 4096, b = 1
/// @endcode
struct TransformerSpec {
  int layers = 32;        ///< transformer layers
  int hidden = 4096;      ///< h: hidden size
  int heads = 32;         ///< a: attention heads (head size h/a)
  int query_groups = 32;  ///< G; = heads is multi-head attention, fewer is grouped-query attention
  int seq = 4096;         ///< s: tokens per sequence
  int micro_batch = 1;    ///< b: sequences per microbatch
  int global_batch = 32;  ///< sequences per iteration (all replicas)
  int vocab = 51200;      ///< V: vocabulary size
  /// f: the MLP's inner width; 0 means 4h (GPT's). Llama-3-8B's is 14336.
  int ffn_hidden = 0;
  /// A Llama-class layer: a gated SwiGLU MLP (gate and up h x f, down f x h), RMSNorm (one
  /// weight vector per norm), no linear biases and no dropout. false: GPT's layer (GeLU MLP
  /// h x f and f x h with biases, LayerNorm, dropout).
  bool swiglu = false;
  int dtype_bytes = 2;       ///< bf16 activations and weights
  bool recompute = false;    ///< recompute LayerNorm, GeLU and dropout in backward (34bsh -> 20bsh)
  bool vocab_stages = true;  ///< stage 0 holds the embedding, stage S-1 the LM head (one layer slot each)
  /// The LM head's weight is the token embedding (po::SharedParam): both stages hold it, the
  /// head's copy without optimizer state (head_weight_range), stage 0's rank with the runtime's
  /// staging for the copy's gradients (po::tie_staging_bytes).
  bool tied_embeddings = false;
  /// Each row packs several documents (train_gpt --pack): the stages read the rows' document
  /// offsets (stage_inputs) and on CUDA hold the documents' table (stage_scratch_bytes). The
  /// times stay the unpacked rows' (an upper bound: attention within documents does less).
  bool packed = false;
};

/// One pipeline of `ranks` devices (one rank per device).
struct MachineSpec {
  int ranks = 8;                   ///< d: devices (and ranks) of the pipeline
  double device_bytes = 80 * gib;  ///< memory of one device
  double host_bytes = 256 * gib;   ///< pinned host memory available to one rank
  double flops = 220e12;           ///< Bc: achieved FLOP/s of one device
  double pcie_bytes_per_s = 15e9;  ///< Bo: host<->device bandwidth of one device, one direction
  bool pairs_share_switch = true;  ///< ranks r and r^1 share a PCIe switch (stagger their copies)
  /// Copy streams a rank offloads and reloads on (Costs::copy_streams): 1, 2, or 0 to plan
  /// every candidate that offloads with one and with two and keep the faster (one on a tie).
  /// With 0, two are tried only where ranks have no PCIe partner (one rank, or
  /// pairs_share_switch false): a partner fills the other direction's slots already.
  int copy_streams = 1;
  /// With two copy streams: a copy's time while the other direction copies too, over its time
  /// alone (Costs::duplex_slowdown, >= 1; an H100 SXM measured 1.31).
  double duplex_slowdown = 1;
};

/// Whether a second copy stream can gain anything on d ranks: only where ranks have no PCIe
/// partner (one rank, or no shared switches); a partner's copies fill the other direction's
/// slots already. The planner (MachineSpec::copy_streams 0) and train_gpt --copy-streams auto
/// try two streams only where this holds.
constexpr bool second_copy_stream_may_help(int d, bool pairs_share_switch) { return d == 1 || !pairs_share_switch; }

/// Whose memory a plan counts: the CUDA GPT's on backend::Cuda (bf16 activations, boundaries
/// and working parameters, the arena's 256-byte blocks, a reserve for the CUDA context), or
/// train_gpt's CPU GPT's on backend::Cpu (fp32 everything, its own saved layout, 64-byte
/// blocks, no reserve, no master copy).
enum class PlanBackend : std::uint8_t { cuda, cpu };

/// What the planner may spend and assumes about the rest of device memory. A rank's model
/// state is what po::state_bytes (memory/state.hpp) says the layers, the runtime and the
/// optimizer hold for its chunks' parameters: with the defaults (bf16 working parameters,
/// fp32 main gradients, AdamW with an fp32 master, the standard gradient path) 2 + 4 + 12
/// bytes a parameter, the 12 divided across the replicas with ZeRO-1, plus the reduction's
/// staging with replicas; the exact path adds 16 (its 128-bit sums).
struct PlanBudget {
  Gradients gradients = Gradients::standard;  ///< how gradients are summed (RuntimeOptions::gradients)
  /// Bytes of a working parameter: 2 (bfloat16; the optimizer keeps an fp32 master copy of
  /// what it owns) or 4 (fp32, the master itself).
  int parameter_bytes = 2;
  /// fp32 optimizer state buffers per parameter: AdamW 2, SGD with momentum 1, plain SGD 0.
  int optimizer_states = 2;
  /// Values per gradient reduction bucket (RuntimeOptions::reduce_bucket).
  std::size_t reduce_bucket = std::size_t{1} << 20;
  /// Bytes of a gradient in the standard path's reduce-scatter: 4, or 2 for a bfloat16 one
  /// (RuntimeOptions::reduce_dtype).
  int reduce_bytes = 4;
  /// Device memory outside what the runtime, the stages and the optimizer reserve: the CUDA
  /// context, NCCL's buffers, the libraries' own allocations.
  double reserved_bytes = 1 * gib;
  /// The cuBLASLt and cuDNN workspace in the backend's arena (backend::Cuda::Options::
  /// workspace_bytes' default; train_gpt takes cuDNN attention's need where a shape asks for
  /// more, which only a device can say). Not counted on the CPU.
  double workspace_bytes = 256.0 * 1024 * 1024;
  /// Pinned host bytes backend::Cuda stages through (po::cuda_staging_bytes of its Options'
  /// defaults: the norm's tables and sums, the uploads' staging), in every rank's host bytes on
  /// CUDA (not on the CPU, whose memory is not pinned).
  double staging_bytes = static_cast<double>(cuda_staging_bytes());
  /// Largest v searched (0: as many as the layout allows, at most 64).
  int max_chunks = 0;
  /// Consider schedules that offload activations to host memory.
  bool allow_offload = true;
  /// Whose memory is counted. cpu: train_gpt's CPU models' units and stashes
  /// (cpu_stage_unit_bytes), fp32 boundaries, 4-byte working parameters, no reserve or
  /// transient (what train_gpt --backend cpu reports as reserved_bytes_per_rank); it needs a
  /// GPT layer (multi-head attention, 4h MLP) or a Llama-class one (swiglu).
  PlanBackend backend = PlanBackend::cuda;
  /// Only this family's candidates (a name as schedule_name() writes it: 1f1b, 1f1b-i, gis,
  /// ..., dualpipe-v; the plan tool's --schedule beside --auto); empty: every family.
  std::string schedule{};
};

/// Which global ranks share a node (see the rank layout below).
enum class NodeLayout : std::uint8_t {
  contiguous,  ///< pipeline rank r of replica j is global rank j*d + r
  balanced,    ///< a pipeline over K > 1 nodes puts its early and its late ranks on each node
};

/// The data-parallel dimension: dp replicas of one pipeline of MachineSpec::ranks (d) devices,
/// d*dp GPUs in all, on nodes of gpus_per_node GPUs. Each stage's gradients are all-reduced
/// across its dp replicas once per iteration; with ZeRO-1 its optimizer state is sharded
/// across them.
struct GridSpec {
  int dp = 1;    ///< replicas; 0: search every dp that divides `gpus` (d = gpus / dp) and the global batch
  int zero = 0;  ///< ZeRO stage: 0 (every replica holds the whole optimizer state) or 1 (sharded)
  int gpus = 0;  ///< GPUs in all: required with dp = 0; otherwise 0 or dp * ranks
  /// Bandwidth of the gradient reduction in bytes/s (per GPU): a stage reduces in the bytes
  /// po::traffic_bytes says a replica sends for it / this.
  double allreduce_bytes_per_s = 100e9;
  int gpus_per_node = 8;                            ///< G: GPUs of one node
  NodeLayout node_layout = NodeLayout::contiguous;  ///< how pipeline ranks map to global ranks (below)
};

// The grid's rank layout. Replica j of a d-rank pipeline holds the d consecutive global ranks
// j*d .. j*d+d-1 (replica-major), and a node holds gpus_per_node = G consecutive global ranks.
//
// Contiguous (the default): pipeline rank r of replica j is global rank g = j*d + r. With d
// even, the offload schedule's PCIe pairs (r, r^1) are the global pairs (g, g^1), the two GPUs
// behind one PCIe switch on a node of G (even) GPUs; a pipeline's neighbours r, r+1 are
// adjacent global ranks, on one node when d <= G (a node then holds G/d whole replicas when d
// divides G), so the P2P of the passes stays inside a node and only the all-reduce crosses
// nodes.
//
// Balanced (the paper's appendix): the early pipeline ranks hold the most offloaded
// activations, so a pipeline that spans K = d/G > 1 nodes (d a multiple of G, G even) is cut
// into 2K blocks of G/2 consecutive pipeline ranks, and node k of the pipeline holds block k
// (in its first G/2 slots) and block 2K-1-k (in the others): with d = 16, G = 8, node 0 holds
// pipeline ranks 0-3 and 12-15, node 1 holds 4-11. The host memory per node evens out; the
// pairs (r, r^1) stay behind one switch when G/2 is even; the P2P of one pipeline crosses
// nodes 2(K-1) times instead of K-1. With d <= G it is the contiguous layout.

/// Whether `layout` is defined for d-rank pipelines on nodes of G GPUs: contiguous always;
/// balanced when d <= G (where it is contiguous) or d is a multiple of an even G.
constexpr bool node_layout_fits(NodeLayout layout, int d, int G) {
  return layout == NodeLayout::contiguous || d <= G || (G % 2 == 0 && d % G == 0);
}

/// Pipeline rank r's place among its replica's d consecutive global ranks (rank layout above;
/// node_layout_fits(layout, d, G) must hold).
constexpr int pipeline_slot(NodeLayout layout, int d, int G, int r) {
  if (layout == NodeLayout::contiguous || d <= G) return r;
  const int K = d / G, half = G / 2, block = r / half;
  return block < K ? block * G + r % half : (2 * K - 1 - block) * G + half + r % half;
}

/// Global rank of pipeline rank `rank` of replica `replica` (rank layout above).
constexpr int global_rank(NodeLayout layout, int d, int G, int replica, int rank) {
  return replica * d + pipeline_slot(layout, d, G, rank);
}

/// Node of pipeline rank `rank` of replica `replica`: nodes hold G consecutive global ranks.
constexpr int node_of(NodeLayout layout, int d, int G, int replica, int rank) {
  return global_rank(layout, d, G, replica, rank) / G;
}

/// A place in the grid: pipeline rank `rank` of replica `replica`.
struct GridRank {
  int replica = 0;  ///< the replica, 0 .. dp-1
  int rank = 0;     ///< the pipeline rank within it, 0 .. d-1
  /// Field-by-field equality.
  friend constexpr bool operator==(const GridRank&, const GridRank&) = default;
};

/// The inverse of global_rank: which replica and pipeline rank global rank g is.
constexpr GridRank grid_rank(NodeLayout layout, int d, int G, int g) {
  const int replica = g / d, slot = g % d;
  if (layout == NodeLayout::contiguous || d <= G) return {replica, slot};
  const int K = d / G, half = G / 2, k = slot / G, at = slot % G;
  return {replica, (at < half ? k : 2 * K - 1 - k) * half + at % half};
}

namespace detail {

/// A real number for a message (constexpr): "12.5", "-3", "nan", "inf", three decimals at
/// most; from 1e9 up and below 1e-3 with a power of ten ("1e+18", "2.5e-05": three decimals
/// of the mantissa).
constexpr std::string fmt_real(double x) {
  if (x != x) return "nan";
  if (x < 0) return "-" + fmt_real(-x);
  if (x > 1.7976931348623157e308) return "inf";
  if (x != 0 && (x >= 1e9 || x < 1e-3)) {
    int e = 0;
    while (x >= 10) {
      x /= 10;
      ++e;
    }
    while (x < 1) {
      x *= 10;
      --e;
    }
    if (x >= 9.9995) {  // rounds to 10 at three decimals
      x /= 10;
      ++e;
    }
    const std::string exp = num(e < 0 ? -e : e);
    return fmt_real(x) + (e < 0 ? "e-" : "e+") + (exp.size() < 2 ? "0" : "") + exp;
  }
  const auto whole = static_cast<long long>(x);
  const auto milli = static_cast<long long>((x - static_cast<double>(whole)) * 1000 + 0.5);
  if (milli == 0) return num(whole);
  if (milli == 1000) return num(whole + 1);
  std::string frac = num(milli);
  while (frac.size() < 3) frac = "0" + frac;
  while (frac.back() == '0') frac.pop_back();
  return num(whole) + "." + frac;
}

/// Throws shape_error naming `what`, the value and the range unless lo <= x <= hi (doubles;
/// NaN fails).
constexpr void require_real(const char* what, double x, double lo, double hi) {
  if (!(x >= lo && x <= hi))
    throw shape_error(std::string(what) + " = " + fmt_real(x) + " is outside the allowed range [" + fmt_real(lo) +
                      ", " + fmt_real(hi) + "]");
}

constexpr double sq(double x) { return x * x; }

}  // namespace detail

/// Throws shape_error with a sentence for a model the planner cannot describe.
constexpr void check_model(const TransformerSpec& m) {
  detail::require_range("model: layers", m.layers, 1, 4096);
  detail::require_range("model: hidden size", m.hidden, 1, 1 << 20);
  detail::require_range("model: attention heads", m.heads, 1, 1 << 16);
  detail::require_range("model: query groups", m.query_groups, 1, m.heads);
  detail::require_range("model: sequence length", m.seq, 1, 1 << 24);
  detail::require_range("model: microbatch size", m.micro_batch, 1, 1 << 16);
  detail::require_range("model: global batch", m.global_batch, 1, 1 << 24);
  detail::require_range("model: vocabulary", m.vocab, 1, 1 << 24);
  detail::require_range("model: MLP width (0 = 4h)", m.ffn_hidden, 0, 1 << 22);
  detail::require_range("model: dtype bytes", m.dtype_bytes, 1, 8);
  if (m.hidden % m.heads != 0)
    throw shape_error("model: hidden size " + detail::num(m.hidden) + " must be a multiple of the heads " +
                      detail::num(m.heads));
  if (m.heads % m.query_groups != 0)
    throw shape_error("model: heads " + detail::num(m.heads) + " must be a multiple of the query groups " +
                      detail::num(m.query_groups));
  if (m.global_batch % m.micro_batch != 0)
    throw shape_error("model: global batch " + detail::num(m.global_batch) +
                      " must be a multiple of the microbatch size " + detail::num(m.micro_batch));
  detail::require_range("model: microbatches per iteration (global batch / microbatch size)",
                        m.global_batch / m.micro_batch, 1, 1 << 16);
}

/// Throws shape_error with a sentence for a machine the planner cannot use.
constexpr void check_machine(const MachineSpec& x) {
  detail::require_range("machine: ranks", x.ranks, 1, 4096);
  detail::require_real("machine: device memory (bytes, > 0)", x.device_bytes, 1, 1e18);
  detail::require_real("machine: host memory per rank (bytes, >= 0)", x.host_bytes, 0, 1e18);
  detail::require_real("machine: achieved FLOP/s (> 0)", x.flops, 1, 1e22);
  if (!(x.pcie_bytes_per_s > 0))
    throw shape_error("machine: PCIe bandwidth must be > 0 bytes/s: k (copy time / compute time) needs a bandwidth");
  detail::require_real("machine: PCIe bandwidth (bytes/s)", x.pcie_bytes_per_s, 1, 1e18);
  detail::require_range("machine: copy streams (0 = try one and two)", x.copy_streams, 0, 2);
  detail::require_real("machine: duplex slowdown (a copy's time with the other direction busy / alone)",
                       x.duplex_slowdown, 1, 100);
}

/// b*s*h of a model (the unit the paper counts activation bytes in).
constexpr double bsh(const TransformerSpec& m) { return static_cast<double>(m.micro_batch) * m.seq * m.hidden; }

/// f, the MLP's inner width: TransformerSpec::ffn_hidden, or 4h when it is 0.
constexpr double ffn_width(const TransformerSpec& m) {
  return m.ffn_hidden > 0 ? static_cast<double>(m.ffn_hidden) : 4.0 * m.hidden;
}

/// Width of the MLP's first projection's output: f (GPT), or 2f (SwiGLU's gate and up).
constexpr double fc1_width(const TransformerSpec& m) { return (m.swiglu ? 2.0 : 1.0) * ffn_width(m); }

/// Width of the QKV projection's output: h + 2 G h/a.
constexpr double qkv_width(const TransformerSpec& m) {
  return m.hidden + 2.0 * static_cast<double>(m.hidden / m.heads) * m.query_groups;
}

/// Saved activation bytes of one transformer layer for one microbatch (header comment; a
/// SwiGLU layer keeps its gate and up outputs, 2f, instead of fc1's f, and has no dropout).
constexpr double activation_bytes_per_layer(const TransformerSpec& m) {
  const double T = static_cast<double>(m.micro_batch) * m.seq, h = m.hidden, e = m.dtype_bytes;
  const double kv = qkv_width(m) - h;                       // K and V elements per token
  const double kept = e * T * (4 * h + kv + fc1_width(m));  // norm 1 in, Q, attention out, norm 2 in; K, V; fc1 out
  const double dropped = e * T * (2 * h + ffn_width(m)) + (m.swiglu ? 0.0 : 2 * T * h);  // norm outs, fc2 in; masks
  return m.recompute ? kept : kept + dropped;
}

/// FLOPs of the linear layers of one transformer layer's forward for one microbatch (P above).
constexpr double layer_linear_flops(const TransformerSpec& m) {
  const double T = static_cast<double>(m.micro_batch) * m.seq, h = m.hidden;
  const double mlp = 2 * T * h * (fc1_width(m) + ffn_width(m));  // fc1 (or gate and up) and fc2 (down)
  return 2 * T * h * qkv_width(m) + 2 * T * h * h + mlp;
}

/// FLOPs of one transformer layer's F, B and W for one microbatch.
struct PassFlops {
  double f = 0,  ///< FLOPs of F
      b = 0,     ///< FLOPs of B (the activation gradient)
      w = 0;     ///< FLOPs of W (the weight gradient)
  /// FLOPs of F, B and W together.
  constexpr double total() const { return f + b + w; }
};

/// FLOPs of one transformer layer's F, B and W for one microbatch (the file comment's formulas).
constexpr PassFlops layer_flops(const TransformerSpec& m) {
  const double P = layer_linear_flops(m), core = 4.0 * m.micro_batch * detail::sq(m.seq) * m.hidden;
  return {P + core, P + 2 * core, P};
}

/// FLOPs of the LM head's F, B and W (a b*s x h by h x V multiply each).
constexpr PassFlops head_flops(const TransformerSpec& m) {
  const double x = 2.0 * bsh(m) * m.vocab;
  return {x, x, x};
}

/// k = round-trip copy time of one layer's activations / its F+B+W time (docs/design.md section 1).
constexpr double copy_ratio(const TransformerSpec& m, const MachineSpec& x) {
  return (2 * activation_bytes_per_layer(m) / x.pcie_bytes_per_s) / (layer_flops(m).total() / x.flops);
}

/// Parameters of one transformer layer: QKV, projection and the MLP's linears (with biases
/// and two LayerNorms of two vectors each for GPT; without biases and with two RMSNorms of one
/// vector for SwiGLU).
constexpr double layer_parameters(const TransformerSpec& m) {
  const double h = m.hidden, qkv = qkv_width(m), f = ffn_width(m);
  if (m.swiglu) return h * qkv + h * h + 3 * h * f + 2 * h;
  return h * qkv + qkv + h * h + h + h * f + f + f * h + h + 4 * h;
}

/// What stage s of S holds: its transformer layers and whether it carries the embedding or the
/// LM head.
struct StageContent {
  int layers = 0;          ///< transformer layers it holds
  bool embedding = false;  ///< does it hold the embedding (stage 0 with vocab_stages)?
  bool head = false;       ///< does it hold the LM head (stage S-1 with vocab_stages)?
};

/// Layer slots of a model: its layers, plus one each for the embedding and the LM head.
constexpr int layer_slots(const TransformerSpec& m) { return m.layers + (m.vocab_stages ? 2 : 0); }

/// Splits the model over S stages: layer_slots / S slots each, the remainder one more each on
/// the last stages (they hold the shortest-lived activations, on the ranks with the fewest in
/// flight); the embedding and LM head take one slot of the first and last stage. Throws
/// shape_error when S exceeds the slots (a stage with nothing to do).
constexpr std::vector<StageContent> stage_layout(const TransformerSpec& m, int S) {
  const int slots = layer_slots(m);
  if (S < 1 || S > slots)
    throw shape_error("stage layout: " + detail::num(S) + " stages for " + detail::num(m.layers) + " layers" +
                      (m.vocab_stages ? " plus embedding and LM head" : "") + "; at most " + detail::num(slots) +
                      " stages (one layer slot each)");
  std::vector<StageContent> out(static_cast<std::size_t>(S));
  const int base = slots / S, extra = slots % S;
  for (int s = 0; s < S; ++s) {
    StageContent& c = out[static_cast<std::size_t>(s)];
    c.layers = base + (s >= S - extra ? 1 : 0);
    if (m.vocab_stages) {
      c.embedding = s == 0;
      c.head = s == S - 1;
      c.layers -= (c.embedding ? 1 : 0) + (c.head ? 1 : 0);
    }
  }
  return out;
}

/// How the planner cuts the model into stages: `slots` (stage_layout: the embedding and the LM
/// head take a layer's place on the first and last stage, the paper's) or `even` (even_layout:
/// the layers as even as the stage count allows, the embedding and the head on top, the sample
/// models' default cut).
enum class StageCut : std::uint8_t { slots, even };

/// "slots" or "even".
constexpr const char* stage_cut_name(StageCut c) { return c == StageCut::slots ? "slots" : "even"; }

/// The layers as even as S stages allow (stage s holds layers floor(L s / S) .. floor(L (s+1) /
/// S) - 1: models/gpt's gpt_blocks_of_stage), the embedding on the first stage and the LM head on
/// the last besides. Throws shape_error when a stage would hold no layer (S > layers).
constexpr std::vector<StageContent> even_layout(const TransformerSpec& m, int S) {
  if (S < 1 || S > m.layers)
    throw shape_error("even stage layout: " + detail::num(S) + " stages for " + detail::num(m.layers) +
                      " layers; at most one stage a layer");
  std::vector<StageContent> out(static_cast<std::size_t>(S));
  const long long L = m.layers;
  for (int s = 0; s < S; ++s) {
    StageContent& c = out[static_cast<std::size_t>(s)];
    c.layers = static_cast<int>(L * (s + 1) / S - L * s / S);
    c.embedding = m.vocab_stages && s == 0;
    c.head = m.vocab_stages && s == S - 1;
  }
  return out;
}

/// The cut `c` of the model into S stages (stage_layout or even_layout).
constexpr std::vector<StageContent> cut_layout(const TransformerSpec& m, int S, StageCut c) {
  if (c == StageCut::even) return even_layout(m, S);  // not a ?: (GCC 12 frees its temporary twice in constexpr)
  return stage_layout(m, S);
}

/// Whether cut `c` gives S stages something else than the slot cut does (so the planner
/// searches it too): the even cut, with the vocabulary stages and a layer for every stage.
constexpr bool distinct_cut(const TransformerSpec& m, int S, StageCut c) {
  if (c == StageCut::slots) return true;
  if (!m.vocab_stages || S > m.layers) return false;
  const std::vector<StageContent> a = stage_layout(m, S), b = even_layout(m, S);
  for (std::size_t s = 0; s < a.size(); ++s)
    if (a[s].layers != b[s].layers) return true;
  return false;
}

/// Saved activation bytes of one stage for one microbatch: the unit the schedules count. Each
/// layer's tensors (activation_bytes_per_layer) and fp32 statistics, the head's input, norm
/// statistics (LayerNorm's two a token, RMSNorm's one) and logits' gradient (header comment):
/// gpt::CudaGptStage's saved buffer (models/gpt/cuda_layout.hpp gpt_stage_buffers) for a GPT
/// layer and llama::CudaLlamaStage's (models/llama/cuda_layout.hpp llama_cuda_buffers) for a
/// recomputing SwiGLU one, to the byte (tests/cuda/test_host_plans.cpp).
constexpr double stage_activation_bytes(const TransformerSpec& m, const StageContent& c) {
  const double T = static_cast<double>(m.micro_batch) * m.seq, e = m.dtype_bytes;
  const double stats = 4 * T * ((m.swiglu ? 2 : 4) + m.heads);  // the norms' and attention's, fp32
  double x = c.layers * (activation_bytes_per_layer(m) + stats);
  if (c.head) x += bsh(m) * e + 4 * T * (m.swiglu ? 1 : 2) + e * T * m.vocab;
  return x;
}

/// Bytes one B of a stage leaves for its W (alive from the B's start to the W's end; a fused
/// BW holds them while it runs), per microbatch: for each layer, the gradient of every linear
/// layer's output and of each norm's output (projection h, fc1 f or 2f, norm 2 h, fc2 h,
/// QKV h + 2G*hd, norm 1 h: 22bsh for GPT's MHA layer in bf16); the embedding's output gradient (bsh)
/// and the head LayerNorm's output gradient (bsh). gpt::CudaGptStage's stash (models/gpt/
/// cuda_layout.hpp) is this layout; tests/plan/test_plan.cpp holds the two together.
constexpr double stage_stash_bytes(const TransformerSpec& m, const StageContent& c) {
  const double T = static_cast<double>(m.micro_batch) * m.seq, h = m.hidden;
  const double per_layer = 4 * h + qkv_width(m) + fc1_width(m);
  return m.dtype_bytes * T * (c.layers * per_layer + (c.embedding ? h : 0.0) + (c.head ? h : 0.0));
}

/// Elements of one key (or value) row: G h/a.
constexpr double kv_width(const TransformerSpec& m) { return static_cast<double>(m.hidden / m.heads) * m.query_groups; }

/// train_gpt's CPU models in fp32, per microbatch of T = b*s tokens, 64-byte aligned blocks.
/// The GPT (gpt::GptStage, models/gpt/cpu.hpp's gpt_cpu_bytes) always recomputes LayerNorm,
/// GeLU and dropout, so a block saves 10 T*h values, its LayerNorm statistics and attention
/// log-sum-exps (4T + T*a), whatever `m.recompute` says; its head saves its input, the final
/// LayerNorm's statistics and the logits' gradient (T*(h + 2 + V)). The Llama (swiglu:
/// llama::LlamaStage, models/llama/cpu.hpp's cpu_bytes) saves x, q, the attention output and
/// x1 (h each), k and v (G h/a each), the gate and up projections (f each), two reciprocal RMS
/// and a log-sum-exp per head, a token; its head T*(h + 1 + V).
/// tests/runtime/test_plan_memory.cpp holds these to the models.
constexpr double cpu_stage_unit_bytes(const TransformerSpec& m, const StageContent& c) {
  const double T = static_cast<double>(m.micro_batch) * m.seq, h = m.hidden;
  const double block = m.swiglu ? T * (4 * h + 2 * kv_width(m) + 2 * ffn_width(m) + 2 + m.heads) * 4
                                : (T * h * 10 + 4 * T + T * m.heads) * 4;
  const double aligned = static_cast<double>((static_cast<std::uint64_t>(block) + 63) / 64 * 64);
  return c.layers * aligned + (c.head ? T * (h + (m.swiglu ? 1 : 2) + m.vocab) * 4 : 0.0);
}

/// The CPU models' stash (gpt_cpu_bytes::stash, llama::cpu_bytes::stash): the gradients of a
/// block's linear and norm outputs, 11 T*h fp32 values (the GPT) or T*(5h + 2f + 2 G h/a) (the
/// Llama), and T*h for the embedding and T*h for the head.
constexpr double cpu_stage_stash_bytes(const TransformerSpec& m, const StageContent& c) {
  const double T = static_cast<double>(m.micro_batch) * m.seq, h = m.hidden;
  const double block = m.swiglu ? 5 * h + 2 * ffn_width(m) + 2 * kv_width(m) : 11 * h;
  return 4 * T * (c.layers * block + (c.embedding ? h : 0) + (c.head ? h : 0));
}

/// Parameters of one stage: its layers; the word embedding (and GPT's position table) on the
/// first; the LM head (V x h, untied or Megatron's tied copy: the same bytes on that stage; and
/// GPT's bias, V) and the final norm on the last.
constexpr double stage_parameters(const TransformerSpec& m, const StageContent& c) {
  const double h = m.hidden, V = m.vocab;
  double p = c.layers * layer_parameters(m);
  if (c.embedding) p += V * h + (m.swiglu ? 0.0 : static_cast<double>(m.seq) * h);  // RoPE has no table
  if (c.head) p += V * h + (m.swiglu ? h : 2 * h + V);                              // GPT's head has a bias
  return p;
}

/// Where the LM head's weight (V x h values) lies in the parameters of a stage that holds the
/// head (`c.head`): last in the stage but for GPT's bias (V values), the layout of the sample
/// GPT (models/gpt/layout.hpp), whose tied head keeps it there as (V, h).
constexpr ParamRange head_weight_range(const TransformerSpec& m, const StageContent& c) {
  const auto P = static_cast<std::size_t>(stage_parameters(m, c));
  const std::size_t w = static_cast<std::size_t>(m.vocab) * static_cast<std::size_t>(m.hidden),
                    bias = m.swiglu ? 0 : static_cast<std::size_t>(m.vocab);
  return {P - w - bias, P - bias};
}

/// FLOPs of one stage's F, B and W for one microbatch. The embedding adds 1% of a layer's
/// forward to each pass (a memory-bound lookup and scatter-add), which also keeps every pass
/// of a stage that holds only the embedding longer than zero.
constexpr PassFlops stage_flops(const TransformerSpec& m, const StageContent& c) {
  const PassFlops l = layer_flops(m), hd = head_flops(m);
  PassFlops x{c.layers * l.f, c.layers * l.b, c.layers * l.w};
  if (c.head) x = {x.f + hd.f, x.b + hd.b, x.w + hd.w};
  if (c.embedding) {
    const double e = 0.01 * l.f;
    x = {x.f + e, x.b + e, x.w + e};
  }
  return x;
}

/// The costs a schedule of `m` cut into `stages` is built and simulated with: each stage's T_F,
/// T_B and T_W (stage_flops / `flops`: seconds on a device of `flops` FLOP/s), its unit and
/// stash bytes as `backend` holds them (cpu: the CPU GPT's fp32 layout), the parts its units
/// reload in (the sample models' saved_parts: the head's, then each layer's;
/// Costs::reload_shares; clear them for layers that declare none), and the copy ratio `k`.
/// The planner builds every candidate with these; a launcher that builds the plan's schedule
/// with the same arguments (train_gpt: --flops and --k) runs the program the planner timed and
/// lowered.
constexpr Costs stage_costs(const TransformerSpec& m, std::span<const StageContent> stages, double flops, double k,
                            PlanBackend backend) {
  const bool cpu = backend == PlanBackend::cpu;
  Costs out;
  out.k = k;
  for (const StageContent& c : stages) {
    const PassFlops fl = stage_flops(m, c);
    out.stage_f.push_back(fl.f / flops);
    out.stage_b.push_back(fl.b / flops);
    out.stage_w.push_back(fl.w / flops);
    out.unit_bytes.push_back(cpu ? cpu_stage_unit_bytes(m, c) : stage_activation_bytes(m, c));
    out.stash_bytes.push_back(cpu ? cpu_stage_stash_bytes(m, c) : stage_stash_bytes(m, c));
    // The unit's bytes per layer and the head's (what the rest of the stage's unit holds).
    const double unit = out.unit_bytes.back();
    const StageContent one{1, false, false};
    const double layer = c.layers > 0 ? (cpu ? cpu_stage_unit_bytes(m, one) : stage_activation_bytes(m, one)) : 0.0;
    out.reload_shares.push_back(stacked_reload_shares(c.layers, layer, c.head ? unit - c.layers * layer : 0.0));
  }
  return out;
}

/// Device bytes of backend::Cuda's gradient-norm buffer for one stage (cuda::norm_buffer_bytes
/// of its norm groups: a table of 3g + 1 int64, an fp64 partial per 4096 values of each group
/// and g fp64 sums), with the sample models' groups: the embedding, each layer, the head.
/// tests/cuda/test_host_plans.cpp holds it to cuda::norm_buffer_bytes.
constexpr double stage_norm_buffer_bytes(const TransformerSpec& m, const StageContent& c) {
  constexpr std::uint64_t chunk = 4096;  // cuda::norm_chunk
  const double h = m.hidden, V = m.vocab;
  const auto blocks = [](double n) { return static_cast<double>((static_cast<std::uint64_t>(n) + chunk - 1) / chunk); };
  double g = c.layers, partials = c.layers * blocks(layer_parameters(m));
  if (c.embedding) {
    g += 1;
    partials += blocks(V * h + (m.swiglu ? 0.0 : static_cast<double>(m.seq) * h));
  }
  if (c.head) {
    g += 1;
    partials += blocks(V * h + (m.swiglu ? h : 2 * h + V));
  }
  return 8 * ((3 * g + 1) + partials + g);
}

/// Device bytes of a stage's own scratch, allocated once for the run (no region of it lives
/// from one pass to the next), and on the head's stage one block of fp32 logits
/// (cuda::logits_rows(T, V) x V: the head runs its logits a block of rows at a time) and the
/// per-token losses (T) besides. gpt::CudaGptStage's gpt_workspace: three T x h tensors (a
/// norm output, a projection output, the stage's output or the gradient flowing down) and the
/// MLP's recomputed activation (T x f) with recompute. llama::CudaLlamaStage's
/// llama_cuda_workspace (swiglu): four T x h tensors (a normalized input, the attention's
/// gradient, the stage's output and the gradient flowing down), one T x max(h, f) (a
/// projection's output, silu(gate) * up and its gradient) and the tokens' int32 RoPE
/// positions. A rank holds one per stage. Packed (TransformerSpec::packed), a stage with
/// blocks also holds the documents' table (cuda::document_table_bytes(T)) and the GPT's
/// embedding stage the documents' int32 positions (T). Each region starts at a multiple of 256
/// bytes (cuda::region_alignment), so each counts rounded up to one.
constexpr double stage_scratch_bytes(const TransformerSpec& m, const StageContent& c) {
  const auto region = [](double bytes) {
    return static_cast<double>((static_cast<std::uint64_t>(bytes) + 255) / 256 * 256);
  };
  const double T = static_cast<double>(m.micro_batch) * m.seq, e = m.dtype_bytes, h = m.hidden;
  const auto tokens = static_cast<long long>(m.micro_batch) * m.seq;
  const double head =
      c.head ? region(4.0 * static_cast<double>(cuda::logits_rows(tokens, m.vocab)) * m.vocab) + region(4 * T) : 0.0;
  const double table = m.packed && c.layers > 0 ? region(static_cast<double>(cuda::document_table_bytes(tokens))) : 0.0;
  if (m.swiglu) return region(e * T * h) * 4 + region(e * T * std::max(h, ffn_width(m))) + region(4 * T) + table + head;
  const double positions = m.packed && c.embedding ? region(4 * T) : 0.0;
  return 3 * region(bsh(m) * e) + (m.recompute ? region(T * ffn_width(m) * e) : 0.0) + positions + table + head;
}

/// Which step inputs a stage reads (its layer's inputs()): the embedding's stage the token ids,
/// the head's the targets (int32, T a microbatch), and with packed rows the rows' document
/// offsets (int32, seq + 1 a row): every stage with blocks, and the GPT's embedding stage (its
/// learned positions restart at each document). A rank's runtime uploads each name once.
struct StageInputs {
  bool tokens = false;     ///< "tokens": the token ids
  bool targets = false;    ///< "targets": the next-token targets
  bool documents = false;  ///< po::document_offsets_input: the rows' document offsets
};
/// The StageInputs of stage content `c` of model `m`.
constexpr StageInputs stage_inputs(const TransformerSpec& m, const StageContent& c) {
  return {
      .tokens = c.embedding, .targets = c.head, .documents = m.packed && (c.layers > 0 || (c.embedding && !m.swiglu))};
}

/// Device bytes a stage holds for itself beyond its parameters and gradients: the GPT head's
/// fp32 copy of its bias (V values; gpt::gpt_state_bytes), the Llama's RoPE tables (fp32 cosine
/// and sine of every position and pair of a head's values: 2 s h/(2a); llama::
/// llama_cuda_state_bytes), every stage's.
constexpr double stage_own_state_bytes(const TransformerSpec& m, const StageContent& c) {
  if (m.swiglu) return 2.0 * m.seq * static_cast<double>(m.hidden / m.heads / 2) * 4;
  return c.head ? 4.0 * m.vocab : 0.0;
}

/// Bytes of pinned host memory one offloaded unit of `bytes` takes: the bins the runtime
/// allocates for it (offload::plan_bins: the smallest sum of at most three powers of two that
/// holds it, docs/design.md section 3), for the unit's size rounded up to a whole byte.
constexpr double host_bin_bytes(double bytes) {
  if (!(bytes > 0)) return 0;
  auto whole = static_cast<std::uint64_t>(bytes);
  if (static_cast<double>(whole) < bytes) ++whole;
  return static_cast<double>(offload::plan_bins(whole).total());
}

}  // namespace pipeoffload
