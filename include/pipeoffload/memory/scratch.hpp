// pipeoffload/memory/scratch.hpp: sizes in a CUDA stage's scratch that the planner counts as
// the stages lay them out: the LM head's block of fp32 logits and a packed microbatch's
// document table (with the document count its attention graph is built for). The CUDA GPT and Llama stages (models/*/cuda_layout.hpp), the kernels' host
// wrappers and po::stage_scratch_bytes (plan/model.hpp) all size them here, so the plan is what
// the stages take; plain arithmetic, no CUDA (tests/cuda/test_host.cpp checks them).
/// @file
#pragma once

#include <algorithm>
#include <cstddef>

#include "../error.hpp"

namespace pipeoffload::cuda {

/// Bytes of fp32 logits a head computes at once: its forward runs the logits GEMM and the
/// cross-entropy a block of logits_rows rows at a time, so the stage's scratch holds one block,
/// not the microbatch's T x V.
inline constexpr std::size_t logits_block_bytes = std::size_t{256} << 20;
/// Rows a head's logits block holds for microbatches of `tokens` tokens over `vocab` entries:
/// as many multiples of 64 rows as logits_block_bytes holds (at least 64: a narrower GEMM
/// wastes the tensor cores), at most `tokens`.
constexpr long long logits_rows(long long tokens, long long vocab) {
  if (tokens < 1 || vocab < 1)
    throw shape_error("cuda::logits_rows: tokens = " + pipeoffload::detail::num(tokens) +
                      " and vocab = " + pipeoffload::detail::num(vocab) + " must both be >= 1");
  const long long fit = static_cast<long long>(logits_block_bytes / (4 * static_cast<std::size_t>(vocab))) / 64 * 64;
  return std::min(tokens, std::max(64LL, fit));
}

/// Where a packed microbatch's document table (ops::document_table) lies in its memory, for
/// microbatches of up to `tokens` tokens (at most one document a token): int32 lengths, then
/// four int64 offset arrays of tokens + 1 (q, k and v, the output, the statistics), each at a
/// multiple of 16 bytes: cuDNN's frontend declares every tensor, ragged offsets included,
/// 16-byte aligned.
struct DocumentTableLayout {
  std::size_t offsets[4] = {};  ///< byte offset of each int64 array (the lengths start at 0)
  std::size_t bytes = 0;        ///< the table's bytes
};
/// The DocumentTableLayout of a table for microbatches of up to `tokens` tokens.
constexpr DocumentTableLayout document_table_layout(long long tokens) {
  const std::size_t T = tokens > 0 ? static_cast<std::size_t>(tokens) : 0;
  const auto align16 = [](std::size_t n) { return (n + 15) / 16 * 16; };
  DocumentTableLayout l;
  std::size_t at = align16(T * 4);
  for (std::size_t& o : l.offsets) {
    o = at;
    at += align16((T + 1) * 8);
  }
  l.bytes = at;
  return l;
}
/// document_table_layout(tokens).bytes.
constexpr std::size_t document_table_bytes(long long tokens) { return document_table_layout(tokens).bytes; }

/// The document count a packed call's attention graphs are built for when its microbatch of
/// `tokens` tokens holds `count` documents: `count` itself up to 8, then rounded up to a
/// quarter of its power of two (9 -> 10, 17 -> 20, 33 -> 40: at most 25 % more), at most
/// `tokens`. The table's entries past `count` are empty documents at the end (ops::document_table),
/// so a run builds a graph per bucket (about 4 a doubling), not one per count a batch brings.
constexpr int document_slots(long long count, long long tokens) {
  if (tokens < 1 || count < 1 || count > tokens)
    throw shape_error("cuda::document_slots: count = " + pipeoffload::detail::num(count) +
                      " documents is outside the allowed range [1, tokens = " + pipeoffload::detail::num(tokens) + "]");
  if (count <= 8) return static_cast<int>(count);
  long long power = 8;
  while (power * 2 <= count) power *= 2;
  const long long step = power / 4;
  return static_cast<int>(std::min(tokens, (count + step - 1) / step * step));
}

}  // namespace pipeoffload::cuda
