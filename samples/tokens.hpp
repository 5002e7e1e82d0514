// samples/tokens.hpp: the token ids train_gpt trains on: the bytes of a text corpus (a
// byte-level tokenizer, vocab 256), or a token shard file, read whole into memory (so a file
// truncated while training cannot take the process down, as a mapping would with SIGBUS).
//
// A token shard is the layout of llm.c's .bin files (nanoGPT's prepared data plus a header):
//   header: 256 little-endian int32
//     [0] magic: 20240520 for uint16 ids, 20240801 for uint32 ids
//     [1] version: 1 with uint16 ids, 7 with uint32 ids (as llm.c writes them)
//     [2] number of tokens
//     [3] vocabulary size (pipeoffload's addition; llm.c leaves it 0, and --vocab must then say it)
//     the rest 0
//   then the token ids, little-endian, [2] of them, nothing after.
// scripts/make_shard.py writes one from a text file with the byte-level tokenizer.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cli.hpp"

namespace sample {

using cli::bad_argument;

inline constexpr std::int32_t shard_magic_u16 = 20240520, shard_magic_u32 = 20240801;
inline constexpr std::int32_t shard_version_u16 = 1, shard_version_u32 = 7;
inline constexpr std::size_t shard_header_bytes = 256 * sizeof(std::int32_t);
inline constexpr long long max_vocab = 1LL << 20;  ///< the largest vocabulary (--vocab's range)

/// The whole of the regular file `path`, whose role `what` names it in messages ("the token
/// shard", "--import"). Opened without blocking, so a FIFO or a device is refused instead of
/// waiting forever; throws bad_argument with one sentence naming the file.
inline std::string read_regular_file(const std::string& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw bad_argument("cannot read " + what + " '" + path + "': " + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const bool dir = S_ISDIR(st.st_mode);
    ::close(fd);
    throw bad_argument(what + " '" + path + "' is " +
                       (dir ? "a directory" : "not a regular file (a FIFO, socket or device)") + "; give a file");
  }
  std::string out;
  out.resize(static_cast<std::size_t>(st.st_size));
  std::size_t off = 0;
  for (;;) {  // to the end, whatever the size said (the file may change under us)
    if (off == out.size()) out.resize(out.size() + 65536);
    const ::ssize_t n = ::read(fd, out.data() + off, out.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw bad_argument("cannot read " + what + " '" + path + "': " + why);
    }
    if (n == 0) break;
    off += static_cast<std::size_t>(n);
  }
  ::close(fd);
  out.resize(off);
  return out;
}

/// Token ids by index, from a text's bytes or a mapped shard (cheap to copy: the storage is shared).
class Tokens {
 public:
  /// The bytes of `text` as ids (vocab 256).
  static Tokens from_text(std::string text) {
    Tokens t;
    auto owned = std::make_shared<std::string>(std::move(text));
    t.base_ = reinterpret_cast<const unsigned char*>(owned->data());
    t.size_ = owned->size();
    t.width_ = 1;
    t.vocab_ = 256;
    t.keep_ = owned;
    return t;
  }

  /// A token shard (see the file comment), read and checked: magic and version, a size that
  /// matches the header's count, a header vocabulary in [2, 1048576] (or `vocab`, when the
  /// header leaves it 0), and every id below the vocabulary. Throws bad_argument with one
  /// sentence naming the file.
  static Tokens from_shard(const std::string& path, long long vocab = 0) {
    auto owned = std::make_shared<std::string>(read_regular_file(path, "the token shard"));
    const std::size_t bytes = owned->size();
    if (bytes < shard_header_bytes)
      throw bad_argument("the token shard '" + path + "' is shorter than its " + std::to_string(shard_header_bytes) +
                         "-byte header (" + std::to_string(bytes) + " bytes)");
    const char* p = owned->data();
    std::int32_t h[4];
    std::memcpy(h, p, sizeof h);
    Tokens t;
    if (h[0] == shard_magic_u16 && h[1] == shard_version_u16)
      t.width_ = 2;
    else if (h[0] == shard_magic_u32 && h[1] == shard_version_u32)
      t.width_ = 4;
    else
      throw bad_argument("the token shard '" + path + "' has magic " + std::to_string(h[0]) + " and version " +
                         std::to_string(h[1]) + "; expected " + std::to_string(shard_magic_u16) + "/" +
                         std::to_string(shard_version_u16) + " (uint16 ids) or " + std::to_string(shard_magic_u32) +
                         "/" + std::to_string(shard_version_u32) + " (uint32 ids)");
    if (h[2] < 0)
      throw bad_argument("the token shard '" + path + "' has a negative token count " + std::to_string(h[2]));
    t.size_ = static_cast<std::size_t>(h[2]);
    if (bytes != shard_header_bytes + t.size_ * t.width_)
      throw bad_argument("the token shard '" + path + "' has " + std::to_string(bytes - shard_header_bytes) +
                         " bytes of ids; its header counts " + std::to_string(t.size_) + " ids of " +
                         std::to_string(t.width_) + " bytes (" + std::to_string(t.size_ * t.width_) + ")");
    if (h[3] < 0)
      throw bad_argument("the token shard '" + path + "' has a negative vocabulary " + std::to_string(h[3]));
    if (h[3] > 0 && vocab > 0 && vocab != h[3])
      throw bad_argument("--vocab " + std::to_string(vocab) + " but the token shard '" + path + "' says " +
                         std::to_string(h[3]));
    if (h[3] == 1 || h[3] > max_vocab)
      throw bad_argument("the token shard '" + path + "' has vocabulary " + std::to_string(h[3]) +
                         " in its header, outside [2, " + std::to_string(max_vocab) + "] (0: not given)");
    t.vocab_ = h[3] > 0 ? h[3] : vocab;
    if (t.vocab_ <= 0)
      throw bad_argument("the token shard '" + path +
                         "' does not give its vocabulary size (header word 3 is 0); pass --vocab V");
    t.base_ = reinterpret_cast<const unsigned char*>(p) + shard_header_bytes;
    t.keep_ = std::move(owned);
    for (std::size_t i = 0; i < t.size_; ++i)
      if (t[i] >= static_cast<std::uint64_t>(t.vocab_))
        throw bad_argument("the token shard '" + path + "' has token id " + std::to_string(t[i]) + " at position " +
                           std::to_string(i) + ", outside the vocabulary [0, " + std::to_string(t.vocab_) + ")");
    return t;
  }

  std::size_t size() const { return size_; }
  long long vocab() const { return vocab_; }
  /// Bytes per id in the source: 1 (text), 2 or 4 (shards).
  int width() const { return width_; }
  std::uint32_t operator[](std::size_t i) const {
    const unsigned char* q = base_ + i * static_cast<std::size_t>(width_);
    if (width_ == 1) return q[0];
    if (width_ == 2) return static_cast<std::uint32_t>(q[0] | (q[1] << 8));
    return static_cast<std::uint32_t>(q[0]) | (static_cast<std::uint32_t>(q[1]) << 8) |
           (static_cast<std::uint32_t>(q[2]) << 16) | (static_cast<std::uint32_t>(q[3]) << 24);
  }
  /// 64-bit FNV-1a of the ids as 32-bit values, so a text and its shard agree.
  std::uint64_t hash() const {
    std::uint64_t h = 0xcbf29ce484222325ULL;
    for (std::size_t i = 0; i < size_; ++i) {
      const std::uint32_t v = (*this)[i];
      for (int b = 0; b < 4; ++b) {
        h ^= (v >> (8 * b)) & 0xffu;
        h *= 0x100000001b3ULL;
      }
    }
    return h;
  }

 private:
  const unsigned char* base_ = nullptr;
  std::size_t size_ = 0;
  int width_ = 1;
  long long vocab_ = 256;
  std::shared_ptr<const void> keep_;  // the text or the shard's bytes
};

}  // namespace sample
