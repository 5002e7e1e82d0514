// pipeoffload/memory/state.hpp: the model state a rank holds beside its activations, computed
// without a device: which gradient path runs, how a chunk's gradients are cut into reduction
// buckets and data-parallel shards, and the bytes the runtime and the optimizers take for them.
//
// po::Runtime and po::AdamW / po::Sgd allocate through these functions, and a launcher that
// sizes device memory ahead (train_gpt's CUDA arena) and the planner (plan/plan.hpp) call the
// same ones, so what is planned is what is taken; plain arithmetic on sizes, below every layer
// that allocates; tests/runtime/test_custom.cpp and test_memory.cpp hold them to the CPU
// backend's counters to the byte. The layers' own buffers (working parameters, fp32 main
// gradients) are the layer's, not the arena's; state_bytes counts them too, for the
// bytes-per-parameter figure.
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace pipeoffload {

/// Pinned staging an upload may use without a wait, by default (backend::Cuda's and
/// backend::Cpu's Options::upload_staging_bytes; Cpu counts its waits as Cuda would).
inline constexpr std::size_t default_upload_staging = std::size_t{8} << 20;
/// Most groups one sum_squares call takes, by default (backend::Cuda::Options::max_norm_groups).
inline constexpr std::size_t default_max_norm_groups = 4096;

/// Pinned host bytes backend::Cuda stages through, taken at its construction: the gradient
/// norm's part (a table of 3 int64 a group and one more, then a double a group, for
/// `max_norm_groups` groups: (4g + 1) x 8 bytes, rounded up to 256 so that the uploads' part
/// starts aligned) and the uploads' `upload_staging` bytes. Each CUDA rank's host bytes count it (the planner,
/// train_gpt's cuda_rank_bytes: docs/memory.md).
constexpr std::size_t cuda_staging_bytes(std::size_t max_norm_groups = default_max_norm_groups,
                                         std::size_t upload_staging = default_upload_staging) {
  return ((4 * max_norm_groups + 1) * sizeof(long long) + 255) / 256 * 256 + upload_staging;
}

/// Bytes of one exact gradient sum (backend/exact.hpp's 128-bit exact::Fixed; runtime.hpp asserts they agree).
inline constexpr std::size_t exact_sum_bytes = 16;

/// How a Runtime sums gradients (docs/gradients.md).
enum class Gradients {
  /// The default: each W adds its microbatch's gradients to the stage's fp32 gradients() in
  /// place; with replicas they are reduce-scattered in fp32 (replica order, deterministic).
  standard,
  /// Opt-in check: 128-bit fixed-point sums (backend/exact.hpp), so that every schedule, rank
  /// count, replica count and accumulation split gives the same bits. 16 more bytes a parameter.
  exact,
};

/// The option's name ("standard", "exact").
constexpr const char* gradients_name(Gradients g) { return g == Gradients::exact ? "exact" : "standard"; }

/// A half-open run [begin, end) of a chunk's parameters.
struct ParamRange {
  std::size_t begin = 0;  ///< first parameter
  std::size_t end = 0;    ///< one past the last
  /// Parameters in the run.
  constexpr std::size_t size() const { return end - begin; }
  /// Field-by-field equality.
  friend constexpr bool operator==(const ParamRange&, const ParamRange&) = default;
};

/// How a chunk's gradients are reduced across dp replicas and who owns what: `buckets`
/// reduction buckets of `len` values each (a multiple of dp, padding after the last parameter),
/// each cut into dp slices of len / dp; replica j owns slice j of every bucket. The owner of a
/// parameter receives its reduced gradient and, with a sharded optimizer, holds its state.
struct GradientLayout {
  std::size_t values = 0;   ///< the chunk's parameters
  int dp = 1;               ///< replicas
  std::size_t buckets = 1;  ///< reduction buckets
  std::size_t len = 1;      ///< values per bucket, a multiple of dp
  /// Values per replica in one bucket, len / dp.
  constexpr std::size_t slice() const { return len / static_cast<std::size_t>(dp); }
  /// Buckets times len: the parameters with the padding.
  constexpr std::size_t padded() const { return buckets * len; }
  /// Replica j's part of bucket b, clipped to the parameters (empty past the last one).
  constexpr ParamRange shard(std::size_t b, int j) const {
    const std::size_t lo = std::min(values, b * len + static_cast<std::size_t>(j) * slice());
    return {lo, std::min(values, lo + slice())};
  }
  /// The parameters replica j owns, bucket by bucket (empty runs left out).
  std::vector<ParamRange> shards(int j) const {
    std::vector<ParamRange> out;
    for (std::size_t b = 0; b < buckets; ++b)
      if (const ParamRange r = shard(b, j); r.size() > 0) out.push_back(r);
    return out;
  }
  /// How many parameters replica j owns.
  constexpr std::size_t owned(int j) const {
    std::size_t n = 0;
    for (std::size_t b = 0; b < buckets; ++b) n += shard(b, j).size();
    return n;
  }
};

/// The layout of a chunk of `parameters` values, for `dp` replicas and buckets of at most
/// `reduce_bucket` values (RuntimeOptions::reduce_bucket).
constexpr GradientLayout gradient_layout(std::size_t parameters, int dp, std::size_t reduce_bucket) {
  const std::size_t r = static_cast<std::size_t>(dp < 1 ? 1 : dp);
  const std::size_t cap = std::max<std::size_t>(reduce_bucket, r);
  GradientLayout l;
  l.values = parameters;
  l.dp = static_cast<int>(r);
  l.buckets = std::max<std::size_t>(1, (parameters + cap - 1) / cap);
  const std::size_t per = (parameters + l.buckets - 1) / l.buckets;
  l.len = std::max<std::size_t>(r, (per + r - 1) / r * r);
  return l;
}
static_assert(gradient_layout(10, 3, 4).buckets == 3 && gradient_layout(10, 3, 4).len == 6 &&
              gradient_layout(10, 3, 4).shard(1, 2) == ParamRange{10, 10} && gradient_layout(10, 3, 4).owned(0) == 4 &&
              gradient_layout(10, 3, 4).owned(1) == 4 && gradient_layout(10, 3, 4).owned(2) == 2);

/// `ranges` (in order, disjoint) without the parameters in `holes` (any order): the runs left.
constexpr std::vector<ParamRange> without(const std::vector<ParamRange>& ranges, const std::vector<ParamRange>& holes) {
  std::vector<ParamRange> out;
  for (const ParamRange& r : ranges) {
    std::vector<ParamRange> left{r};
    for (const ParamRange& h : holes) {
      std::vector<ParamRange> next;
      for (const ParamRange& x : left) {
        if (h.end <= x.begin || h.begin >= x.end) {
          next.push_back(x);
          continue;
        }
        if (x.begin < h.begin) next.push_back({x.begin, h.begin});
        if (h.end < x.end) next.push_back({h.end, x.end});
      }
      left = next;
    }
    for (const ParamRange& x : left)
      if (x.size() > 0) out.push_back(x);
  }
  return out;
}
static_assert(without({{0, 10}, {12, 20}}, {{5, 14}}) == std::vector<ParamRange>{{0, 5}, {14, 20}});

/// Values per message and per add of a shared parameter of `count` values (SharedParam): a
/// whole tensor up to RuntimeOptions::reduce_bucket values, else buckets of that many.
constexpr std::size_t tie_bucket(std::size_t count, std::size_t reduce_bucket) {
  return std::max<std::size_t>(1, std::min(count, reduce_bucket));
}
/// Device bytes of the staging a rank holding the primary of shared parameters (SharedParam)
/// takes, for its largest such tensor of `count` values: its own bucket and the other
/// holder's, side by side (fp32 gradients, or 128-bit sums on the exact path).
constexpr std::size_t tie_staging_bytes(std::size_t count, std::size_t reduce_bucket, Gradients g) {
  if (count == 0) return 0;
  return 2 * tie_bucket(count, reduce_bucket) * (g == Gradients::exact ? exact_sum_bytes : sizeof(float));
}

/// Device bytes of the replicas' staging (dp > 1) for buckets of at most `len` values, in the
/// order the runtime allocates them. Standard: a bucket sent or gathered (len fp32), the
/// replicas' parts of this replica's slice (len fp32), the slice summed (len / dp fp32).
/// Exact: the parts (len 128-bit sums), the slice summed (len / dp sums), the slice rounded
/// (len / dp fp32), the bucket gathered (len fp32). The optimizers' parameter gather reuses the
/// fp32 slice and bucket buffers.
constexpr std::vector<std::size_t> reduction_staging_bytes(std::size_t len, int dp, Gradients g) {
  const std::size_t r = static_cast<std::size_t>(dp < 1 ? 1 : dp), f = sizeof(float), x = exact_sum_bytes;
  if (g == Gradients::standard) return {len * f, len * f, len / r * f};
  return {len * x, len / r * x, len / r * f, len * f};
}

/// What sizes a rank's model state: the gradient path, replicas, optimizer sharding (ZeRO
/// stage), optimizer state buffers per parameter (AdamW 2, SGD with momentum 1, plain SGD 0)
/// and the reduction's bucket size.
struct StateOptions {
  Gradients gradients = Gradients::standard;         ///< RuntimeOptions::gradients
  int dp = 1;                                        ///< data-parallel replicas
  int replica = 0;                                   ///< this rank's replica, 0 .. dp-1
  int zero = 0;                                      ///< 1: the optimizer state is sharded over the replicas
  int optimizer_states = 2;                          ///< fp32 state buffers per parameter
  std::size_t reduce_bucket = std::size_t{1} << 20;  ///< RuntimeOptions::reduce_bucket
  /// Bytes of a working parameter (the layer's): 4 (fp32), or 2 (bfloat16: the optimizer keeps
  /// an fp32 master copy of what it owns).
  std::size_t parameter_bytes = sizeof(float);
  std::size_t gradient_bytes = sizeof(float);  ///< bytes of one main gradient (the layer's)
  /// Bytes of a gradient in the standard path's reduce-scatter: 4, or 2 with
  /// RuntimeOptions::reduce_dtype = bfloat16.
  std::size_t reduce_bytes = sizeof(float);
};

/// A rank's model state in bytes, by owner: the layers' own buffers, and what the runtime and
/// the optimizer take from the backend (arena()).
struct StateBytes {
  std::size_t parameters = 0;  ///< the layers' working parameters
  std::size_t gradients = 0;   ///< the layers' main gradients
  std::size_t sums = 0;        ///< the runtime's exact sums (exact path only)
  std::size_t staging = 0;     ///< the runtime's reduction staging (dp > 1)
  std::size_t optimizer = 0;   ///< the optimizer's state (its shard with ZeRO-1)
  std::size_t master = 0;      ///< the optimizer's fp32 master copy of bfloat16 working parameters (its shard)
  std::size_t ties = 0;        ///< the runtime's staging for shared parameters' gradients (tie_staging_bytes)
  /// Every buffer the runtime and the optimizer allocate on the backend, in bytes, in their
  /// order (a launcher rounds each to its arena's size classes).
  std::vector<std::size_t> blocks;
  /// What the runtime and optimizer allocate on the backend: sums + staging + ties + optimizer + master.
  constexpr std::size_t arena() const { return sums + staging + ties + optimizer + master; }
  /// Everything.
  constexpr std::size_t total() const { return parameters + gradients + arena(); }
};

/// What shared parameters (SharedParam) change in a rank's model state: per chunk, the runs
/// that are copies of another holder's tensor (Runtime::tied_copies: no optimizer state, no
/// master copy), and the values of the largest tensor whose primary the rank holds (0: none).
struct TiedState {
  std::vector<std::vector<ParamRange>> copies;  ///< per chunk (empty: none)
  std::size_t primary_values = 0;               ///< tie_staging_bytes' count
};

/// How many of a chunk's `n` parameters replica `o.replica` updates and holds optimizer state
/// for: its shards with ZeRO-1 (GradientLayout::owned), otherwise all of them, less the copies
/// of shared parameters among them (`copies`, TiedState).
constexpr std::size_t updated_parameters(std::size_t n, const StateOptions& o, const std::vector<ParamRange>& copies) {
  const GradientLayout l = gradient_layout(n, o.dp, o.reduce_bucket);
  const bool sharded = o.zero == 1 && o.dp > 1;
  std::size_t updated = sharded ? l.owned(o.replica) : n;
  for (const ParamRange& h : copies)
    for (std::size_t k = 0; k < (sharded ? l.buckets : 1); ++k) {
      const ParamRange r = sharded ? l.shard(k, o.replica) : ParamRange{0, n};
      const std::size_t lo = std::max(r.begin, h.begin), hi = std::min(r.end, h.end);
      if (hi > lo) updated -= hi - lo;
    }
  return updated;
}

/// The model state of a rank whose chunks have `parameters` values each, as po::Runtime and
/// the optimizers allocate it (tests/runtime/test_custom.cpp holds the two together; the
/// planner counts a rank's model state with it). `ties`: what shared parameters change.
constexpr StateBytes state_bytes(std::span<const std::size_t> parameters, const StateOptions& o,
                                 const TiedState& ties = {}) {
  StateBytes b;
  std::size_t most = 0;
  for (const std::size_t n : parameters) {
    const GradientLayout l = gradient_layout(n, o.dp, o.reduce_bucket);
    b.parameters += n * o.parameter_bytes;
    b.gradients += n * o.gradient_bytes;
    if (o.gradients == Gradients::exact) {
      b.sums += l.padded() * exact_sum_bytes;
      b.blocks.push_back(l.padded() * exact_sum_bytes);
    }
    most = std::max(most, l.len);
  }
  if (o.dp > 1)
    for (const std::size_t s : reduction_staging_bytes(most, o.dp, o.gradients)) {
      b.staging += s;
      b.blocks.push_back(s);
    }
  if (const std::size_t t = tie_staging_bytes(ties.primary_values, o.reduce_bucket, o.gradients); t > 0) {
    b.ties = t;
    b.blocks.push_back(t);
  }
  for (std::size_t c = 0; c < parameters.size(); ++c) {
    const std::vector<ParamRange> none;
    const std::size_t state =
        updated_parameters(parameters[c], o, c < ties.copies.size() ? ties.copies[c] : none) * sizeof(float);
    for (int k = 0; k < o.optimizer_states; ++k) b.blocks.push_back(state);
    b.optimizer += static_cast<std::size_t>(o.optimizer_states) * state;
    if (o.parameter_bytes != sizeof(float)) {
      b.blocks.push_back(state);
      b.master += state;
    }
  }
  return b;
}

/// Bytes replica `o.replica` sends in one step's data-parallel collectives for chunks of
/// `parameters` values each (0 with one replica), as po::Runtime and the optimizers run them:
/// per reduction bucket, the reduce-scatter sends all but its own slice (fp32 on the standard
/// path, 128-bit sums on the exact one); the gradients' all-gather sends its slice to each other
/// replica (the exact path always; the standard one unless a ZeRO-1 optimizer keeps shards);
/// with ZeRO-1 the updated parameters' all-gather does too, in the working parameters' bytes.
/// Per parameter that is 8 (dp-1)/dp on the standard path (6 with bfloat16 working parameters
/// and ZeRO-1; 2 less with a bfloat16 reduce-scatter) plus the last bucket's padding;
/// tests/runtime/test_custom.cpp counts it on the communicators.
constexpr std::size_t traffic_bytes(std::span<const std::size_t> parameters, const StateOptions& o) {
  if (o.dp <= 1) return 0;
  const bool exact = o.gradients == Gradients::exact, sharded = o.zero == 1;
  const std::size_t others = static_cast<std::size_t>(o.dp - 1);
  std::size_t bytes = 0;
  for (const std::size_t n : parameters) {
    const GradientLayout l = gradient_layout(n, o.dp, o.reduce_bucket);
    const std::size_t sent = (n + l.len - 1) / l.len * others * l.slice();  // values, per collective
    bytes += sent * (exact ? exact_sum_bytes : o.reduce_bytes);
    if (exact || !sharded) bytes += sent * sizeof(float);
    if (sharded) bytes += sent * o.parameter_bytes;
  }
  return bytes;
}

}  // namespace pipeoffload
