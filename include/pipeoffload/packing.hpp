// pipeoffload/packing.hpp: packed sequences. A row of a microbatch (seq tokens) may hold
// several documents; a step input of per-row offsets (cu_seqlens-style) says where each
// starts, so a layer keeps attention within a document and restarts its positions there.
//
// Layout of the step input po::document_offsets_input ("cu_seqlens"): int32, seq + 1 values a
// row: 0 = o[0] <= o[1] <= ... <= o[seq] = seq, document i being tokens [o[i], o[i+1]) of the
// row; a row of k documents repeats seq after its k + 1 real offsets (empty documents are
// skipped). A fixed size per row keeps the input splittable into microbatches as po::Batch
// splits every tensor.
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "detail/host_device.hpp"
#include "error.hpp"
#include "layer.hpp"

namespace pipeoffload {

/// The step input's name in a po::Batch and in a layer's inputs().
inline constexpr const char* document_offsets_input = "cu_seqlens";

/// One document of a row: tokens [begin, begin + length) of row `row`.
struct Document {
  std::size_t row = 0;     ///< the row (sequence) of the microbatch
  std::size_t begin = 0;   ///< its first token within the row
  std::size_t length = 0;  ///< its tokens (never 0)
};

/// The offsets of rows of `seq` tokens each (tokens.size() / seq rows), a document starting at
/// the row's first token and at every token equal to `boundary` (an end-of-text id that opens
/// each document, as GPT-2-style shards put it between documents): int32 (rows, seq + 1).
inline std::vector<std::int32_t> document_offsets(std::span<const std::int32_t> tokens, int seq,
                                                  std::int32_t boundary) {
  if (seq < 1) throw shape_error("po::document_offsets: seq = " + std::to_string(seq) + " must be >= 1");
  const std::size_t S = static_cast<std::size_t>(seq);
  if (tokens.size() % S != 0)
    throw shape_error("po::document_offsets: " + std::to_string(tokens.size()) +
                      " tokens are not a whole number of rows of seq = " + std::to_string(seq));
  const std::size_t rows = tokens.size() / S;
  std::vector<std::int32_t> out(rows * (S + 1), seq);
  for (std::size_t r = 0; r < rows; ++r) {
    std::int32_t* o = out.data() + r * (S + 1);
    std::size_t k = 0;
    o[k++] = 0;
    for (std::size_t t = 1; t < S; ++t)
      if (tokens[r * S + t] == boundary) o[k++] = static_cast<std::int32_t>(t);
  }
  return out;
}

/// Appends the documents of rows [0, rows) of `offsets` (seq + 1 values a row) to `out`, in
/// row order, after checking every row: throws shape_error naming the row, the position and
/// the value when an offset is outside [0, seq], decreases, or the row does not start at 0 and
/// end at seq.
inline void append_documents(const std::int32_t* offsets, std::size_t rows, int seq, std::vector<Document>& out) {
  const std::size_t S = static_cast<std::size_t>(seq);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t* o = offsets + r * (S + 1);
    const auto bad = [&](std::size_t i, const std::string& why) {
      return shape_error(
          std::string(document_offsets_input) + " row " + std::to_string(r) + ": offset " + std::to_string(i) + " is " +
          std::to_string(o[i]) + "; " + why +
          " (a row's seq + 1 offsets start at 0, never decrease and end at seq = " + std::to_string(seq) + ")");
    };
    if (o[0] != 0) throw bad(0, "expected 0");
    if (o[S] != seq) throw bad(S, "expected " + std::to_string(seq));
    for (std::size_t i = 1; i <= S; ++i) {
      if (o[i] < o[i - 1] || o[i] > seq)
        throw bad(i, "outside [" + std::to_string(o[i - 1]) + ", " + std::to_string(seq) + "]");
      if (o[i] > o[i - 1])
        out.push_back({r, static_cast<std::size_t>(o[i - 1]), static_cast<std::size_t>(o[i] - o[i - 1])});
    }
  }
}

/// A microbatch's documents and every token's position in its document, what a packed layer
/// reads: one document a row when `offsets` is null, else the documents of its rows' offsets
/// (append_documents's checks); positions (rows * seq) restart at 0 in each document.
template <class Position>
void microbatch_documents(const std::int32_t* offsets, std::size_t rows, int seq, std::vector<Document>& docs,
                          std::vector<Position>& positions) {
  const std::size_t S = static_cast<std::size_t>(seq);
  docs.clear();
  if (offsets != nullptr)
    append_documents(offsets, rows, seq, docs);
  else
    for (std::size_t r = 0; r < rows; ++r) docs.push_back({r, 0, S});
  positions.resize(rows * S);
  for (const Document& doc : docs)
    for (std::size_t i = 0; i < doc.length; ++i) positions[doc.row * S + doc.begin + i] = static_cast<Position>(i);
}

/// The tokens of the longest of `docs` (0 when there are none).
inline int longest_document(const std::vector<Document>& docs) {
  std::size_t most = 0;
  for (const Document& d : docs) most = std::max(most, d.length);
  return static_cast<int>(most);
}

/// A packed microbatch's row offsets as a GPU layer reads them: both views of the step input
/// (mb.input, device memory, and mb.host_input) checked to hold rows * (seq + 1) int32 values,
/// the host's rows checked by append_documents and their documents put in `docs` (cleared
/// first: its size is the count a cuDNN graph is built for); returns the device view for the
/// kernels. Errors begin with `who`.
inline const std::int32_t* packed_rows(const Microbatch& mb, const std::string& who, std::vector<Document>& docs) {
  const int seq = mb.shape.seq;
  const std::size_t rows = static_cast<std::size_t>(mb.shape.batch), want = rows * static_cast<std::size_t>(seq + 1);
  const ConstTensor dev = mb.input(document_offsets_input), host = mb.host_input(document_offsets_input);
  if (dev.elements != want || host.elements != want || dev.dtype != DType::int32 || host.dtype != DType::int32)
    throw shape_error(who + ": the step input '" + document_offsets_input + "' holds " + std::to_string(dev.elements) +
                      " " + dtype_name(dev.dtype) + " values; " + std::to_string(rows) + " packed rows of " +
                      std::to_string(seq) + " tokens need rows * (seq + 1) = " + std::to_string(want) + " int32");
  docs.clear();
  append_documents(host.as<std::int32_t>(), rows, seq, docs);
  return dev.as<std::int32_t>();
}

// ---- The documents of checked rows, token by token: what a GPU computes from the offsets ----
// (append_documents checks the rows on the host first; these trust them.)

/// The documents in one row's offsets `o` (seq + 1 values): the i < seq with o[i + 1] > o[i].
PIPEOFFLOAD_HOST_DEVICE inline int row_documents(const std::int32_t* o, int seq) {
  int n = 0;
  for (int i = 0; i < seq; ++i) n += o[i + 1] > o[i] ? 1 : 0;
  return n;
}

/// The position of token j (in [0, seq)) of a row in its document: j - o[i] for the last i with
/// o[i] <= j (a binary search: the offsets never decrease and o[seq] = seq > j).
PIPEOFFLOAD_HOST_DEVICE inline std::int32_t document_position(const std::int32_t* o, int seq, int j) {
  int lo = 0, hi = seq;  // o[lo] <= j < o[hi]
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (o[mid] <= j)
      lo = mid;
    else
      hi = mid;
  }
  return j - o[lo];
}

/// The ragged table of a microbatch's documents (in append_documents's order), as cuDNN's
/// packed attention reads it: for document n, its length and, for four tensors of `widths`
/// elements a token (attention's q, its k and v, its output, its log-sum-exps), the element
/// offset of its first token; entry `count` of each offset array is the end of the last
/// document.
struct DocumentTableView {
  static constexpr int tensors = 4;             ///< offset arrays
  std::int32_t* lengths = nullptr;              ///< (count) tokens of each document
  std::int64_t* offsets[tensors] = {};          ///< (count + 1) each: first token * widths[x]
  std::int64_t widths[tensors] = {1, 1, 1, 1};  ///< elements a token of each tensor
};

/// Writes the table's entries of row `row` of rows of `seq` tokens (offsets `o`, seq + 1 values),
/// whose first document is entry `first`; each document also writes the next entry's offsets
/// (its end: the next document's start, which that one writes too, with the same values), so
/// the last row's last document writes the end.
PIPEOFFLOAD_HOST_DEVICE inline void row_document_table(const std::int32_t* o, int seq, long long row, long long first,
                                                       DocumentTableView t) {
  long long n = first;
  for (int i = 0; i < seq; ++i) {
    if (o[i + 1] <= o[i]) continue;
    const long long start = row * seq + o[i];
    t.lengths[n] = o[i + 1] - o[i];
    for (int x = 0; x < DocumentTableView::tensors; ++x) {
      t.offsets[x][n] = start * t.widths[x];
      t.offsets[x][n + 1] = (row * seq + o[i + 1]) * t.widths[x];
    }
    ++n;
  }
}

/// Writes entries [count, slots) of a table whose `count` documents fill `tokens` tokens: empty
/// documents at the end (length 0, every offset the end's, as the last document's end entry):
/// the padding up to the count a packed call's graph is built for (cuda::document_slots), which
/// attention reads as documents with nothing to attend.
PIPEOFFLOAD_HOST_DEVICE inline void pad_document_table(long long count, long long slots, long long tokens,
                                                       DocumentTableView t) {
  for (long long n = count; n < slots; ++n) {
    t.lengths[n] = 0;
    for (int x = 0; x < DocumentTableView::tensors; ++x) t.offsets[x][n + 1] = tokens * t.widths[x];
  }
}

}  // namespace pipeoffload
