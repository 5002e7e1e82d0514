// pipeoffload/runtime/checkpoint.hpp: saving and resuming a pipeline's training state: one
// file per stage (parameters, optimizer state, named tensors, checksum), written atomically,
// a `latest` that only names complete checkpoints, resumable on another schedule, rank count,
// replica count or cut. The directory's layout and guarantees: docs/checkpoints.md.
/// @file
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../comm/communicator.hpp"
#include "../error.hpp"
#include "../fnv1a.hpp"
#include "../layer.hpp"
#include "../memory/state.hpp"
#include "../schedule/program.hpp"

namespace pipeoffload {

/// What a checkpoint records beside the tensors.
struct CheckpointInfo {
  std::uint64_t config_hash = 0;   ///< the run's configuration; resuming under another is refused
  std::uint64_t rng_seed = 0;      ///< counter-based RNG: with the step, the whole RNG state
  std::int64_t data_position = 0;  ///< index of the next batch the data reader draws
  /// The configuration as words `key=value` separated by spaces or '|' (optional, at most
  /// 4096 bytes): when the checkpoint and the resuming run both give it, a refusal names the
  /// first word that differs.
  std::string config{};
};

namespace checkpoint {

/// The first 8 bytes of every checkpoint file.
inline constexpr char magic[8] = {'P', 'O', 'C', 'K', 'P', 'T', '0', '1'};

/// The directory name of step `step`'s checkpoint: "step-" and 8 digits.
inline std::string step_name(int step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08d", step);
  return buf;
}

/// The file of stage `stage` in step `step`'s checkpoint under `dir`.
inline std::filesystem::path stage_file(const std::filesystem::path& dir, int step, int stage) {
  return dir / step_name(step) / ("stage-" + std::to_string(stage) + ".bin");
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename,
/// fsync of the directory (so the rename itself survives a power loss).
inline void write_atomic(const std::filesystem::path& path, const std::vector<std::byte>& bytes) {
  const std::filesystem::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw checkpoint_error("checkpoint: cannot create " + tmp.string() + ": " + std::strerror(errno));
  std::size_t off = 0;
  while (off < bytes.size()) {
    const ::ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      throw checkpoint_error("checkpoint: cannot write " + tmp.string() + ": " + why);
    }
    off += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw checkpoint_error("checkpoint: cannot flush " + tmp.string() + ": " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw checkpoint_error("checkpoint: cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
  const int dfd =
      ::open(path.parent_path().empty() ? "." : path.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

/// The whole regular file at `path`; throws checkpoint_error naming the path when it is
/// missing, unreadable or not a regular file (a directory, a FIFO: opened without blocking).
inline std::vector<std::byte> read_all(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw checkpoint_error("checkpoint: cannot read " + path.string() + ": " + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw checkpoint_error("checkpoint: " + path.string() + " is " +
                           (S_ISDIR(st.st_mode) ? "a directory" : "not a regular file") +
                           "; a checkpoint file was expected");
  }
  std::vector<std::byte> out(static_cast<std::size_t>(st.st_size));
  std::size_t off = 0;
  while (off < out.size()) {
    const ::ssize_t n = ::read(fd, out.data() + off, out.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n == 0 ? "it shrank while being read" : std::strerror(errno);
      ::close(fd);
      throw checkpoint_error("checkpoint: cannot read " + path.string() + ": " + why);
    }
    off += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return out;
}

/// `text` as a message shows it: at most 32 bytes, anything but printable ASCII as '?', and the
/// size when it is longer.
inline std::string shown(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < 32; ++i) out += text[i] >= 0x20 && text[i] < 0x7f ? text[i] : '?';
  return "'" + out + (text.size() > 32 ? "...' (" + std::to_string(text.size()) + " bytes)" : "'");
}

/// The step dir/latest names ("step-" and 8 digits, then a newline); throws checkpoint_error
/// naming the file and showing what it holds otherwise.
inline int latest_step(const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / "latest";
  const std::vector<std::byte> raw = read_all(file);
  std::string name(reinterpret_cast<const char*>(raw.data()), raw.size());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  bool ok = name.size() == 13 && name.rfind("step-", 0) == 0;
  for (std::size_t i = 5; ok && i < name.size(); ++i) ok = name[i] >= '0' && name[i] <= '9';
  if (!ok)
    throw checkpoint_error("checkpoint: " + file.string() +
                           " does not name a step directory ('step-' and 8 digits); it holds " + shown(name));
  return std::atoi(name.c_str() + 5);
}

/// The first word (`key=value`, split at spaces and '|') in which configuration `ours` differs
/// from `theirs`, as "key=THEIRS where this run has key=OURS"; empty when none differs.
inline std::string config_difference(std::string_view theirs, std::string_view ours) {
  const auto words = [](std::string_view t) {
    std::vector<std::string_view> out;
    std::size_t at = 0;
    while (at < t.size()) {
      const std::size_t end = std::min(t.find_first_of(" |", at), t.size());
      if (end > at) out.push_back(t.substr(at, end - at));
      at = end + 1;
    }
    return out;
  };
  const auto key = [](std::string_view w) { return w.substr(0, w.find('=')); };
  const std::vector<std::string_view> a = words(theirs), b = words(ours);
  for (std::string_view w : b) {
    const auto same_key = std::find_if(a.begin(), a.end(), [&](std::string_view x) { return key(x) == key(w); });
    if (same_key == a.end()) return "no " + std::string(key(w)) + " where this run has " + std::string(w);
    if (*same_key != w) return std::string(*same_key) + " where this run has " + std::string(w);
  }
  for (std::string_view w : a)
    if (std::none_of(b.begin(), b.end(), [&](std::string_view x) { return key(x) == key(w); }))
      return std::string(w) + " where this run has no " + std::string(key(w));
  return theirs == ours ? std::string() : "another configuration text";
}

/// One stage's state as it is on disk.
struct StageState {
  int stage = 0;                          ///< the stage, 0 .. S-1
  int stages = 0;                         ///< S of the run that wrote it (0: format 2 or 3, which do not say)
  int step = 0;                           ///< optimizer steps taken
  CheckpointInfo info{};                  ///< what the run recorded beside the tensors
  std::string optimizer;                  ///< the optimizer's name ("adamw", "sgd")
  std::vector<ParamInfo> tensors;         ///< the stage's parameter_info() (format 4; empty before)
  std::vector<float> params;              ///< the stage's parameters, in parameters() order
  std::vector<std::vector<float>> state;  ///< the optimizer's buffers, each the size of params
};

/// What a stage file stores of `tensors` (parameter_info()): every tensor but the copies of
/// shared parameters (Runtime::tied_copies, which load from their primary), at its offset in
/// parameters() (`packed` false) or at its place in the file, one stored tensor after another
/// in offset order (`packed` true). Without copies the two are the same when the tensors cover
/// the parameters once, in order.
inline std::vector<ParamInfo> stored_tensors(std::vector<ParamInfo> tensors, const std::vector<ParamRange>& copies,
                                             bool packed) {
  std::erase_if(tensors, [&](const ParamInfo& t) {
    return std::any_of(copies.begin(), copies.end(),
                       [&](const ParamRange& r) { return t.offset < r.end && r.begin < t.offset + t.count(); });
  });
  if (!packed) return tensors;
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return tensors[a].offset < tensors[b].offset; });
  std::size_t at = 0;
  for (const std::size_t i : order) {
    tensors[i].offset = at;
    at += tensors[i].count();
  }
  return tensors;
}

/// The file format's version (written after the magic); formats 2 (no configuration text) and
/// 3 (no tensor names) are still read.
inline constexpr std::uint32_t format = 4;

/// Most tensors a stage file may name (decode() holds a file to it).
inline constexpr std::uint32_t max_tensors = 1u << 20;
/// Most bytes of a tensor's name in a stage file.
inline constexpr std::uint32_t max_name = 1024;
/// Most dimensions of a tensor in a stage file.
inline constexpr std::uint32_t max_dims = 8;

// File: magic, then u32 format (4), i32 stage, i32 step, u64 config_hash, u64 rng_seed,
// i64 data_position, u64 n, u32 optimizer name length, the name, u32 configuration text
// length, the text (formats 3 and 4), then (format 4) i32 stages S and u32 tensor count t,
// and t times: u32 name length, the name, u64 offset, u32 dimensions r, r i64 extents; then u32
// state buffers k, n floats of parameters and n floats of each state buffer, then u64 FNV-1a of
// every byte before it. Native byte order (the machines that resume are the machines that
// wrote).
/// The file's bytes for `s`, in the layout above.
inline std::vector<std::byte> encode(const StageState& s) {
  std::vector<std::byte> b;
  const auto put = [&](const void* p, std::size_t n) {
    if (n == 0) return;  // p may be an empty vector's null data()
    const auto* c = static_cast<const std::byte*>(p);
    b.insert(b.end(), c, c + n);
  };
  const std::int32_t stage = s.stage, step = s.step;
  const std::uint64_t n = s.params.size();
  const auto name_len = static_cast<std::uint32_t>(s.optimizer.size());
  const auto k = static_cast<std::uint32_t>(s.state.size());
  put(magic, sizeof magic);
  put(&format, 4);
  put(&stage, 4);
  put(&step, 4);
  put(&s.info.config_hash, 8);
  put(&s.info.rng_seed, 8);
  put(&s.info.data_position, 8);
  put(&n, 8);
  put(&name_len, 4);
  put(s.optimizer.data(), name_len);
  const auto config_len = static_cast<std::uint32_t>(s.info.config.size());
  put(&config_len, 4);
  put(s.info.config.data(), config_len);
  const std::int32_t stages = s.stages;
  const auto t = static_cast<std::uint32_t>(s.tensors.size());
  put(&stages, 4);
  put(&t, 4);
  for (const ParamInfo& x : s.tensors) {
    const auto len = static_cast<std::uint32_t>(x.name.size()), dims = static_cast<std::uint32_t>(x.shape.size());
    const std::uint64_t offset = x.offset;
    put(&len, 4);
    put(x.name.data(), len);
    put(&offset, 8);
    put(&dims, 4);
    put(x.shape.data(), dims * sizeof(long long));
  }
  put(&k, 4);
  put(s.params.data(), n * sizeof(float));
  for (const auto& buf : s.state) put(buf.data(), n * sizeof(float));
  const std::uint64_t sum = fnv1a(b);
  put(&sum, 8);
  return b;
}

/// The state encode() wrote; throws checkpoint_error, naming the file `name`, when the bytes
/// are truncated, not a checkpoint, of another format or corrupt.
inline StageState decode(const std::vector<std::byte>& b, const std::string& name) {
  std::size_t off = sizeof magic;
  const auto truncated = [&] {
    return checkpoint_error("checkpoint: " + name + " is truncated (" + std::to_string(b.size()) + " bytes)");
  };
  const auto get = [&](void* p, std::size_t n) {
    if (n > b.size() || off > b.size() - n) throw truncated();
    if (n == 0) return;  // p may be an empty vector's null data()
    std::memcpy(p, b.data() + off, n);
    off += n;
  };
  if (b.size() < sizeof magic + 4 + 8) throw truncated();
  if (std::memcmp(b.data(), magic, sizeof magic) != 0)
    throw checkpoint_error("checkpoint: " + name + " is not a pipeoffload checkpoint (bad magic)");
  std::uint64_t sum = 0;
  std::memcpy(&sum, b.data() + b.size() - 8, 8);
  if (fnv1a(std::span(b).first(b.size() - 8)) != sum)
    throw checkpoint_error("checkpoint: " + name + " is corrupt (checksum mismatch)");
  std::uint32_t fmt = 0, name_len = 0, k = 0;
  std::int32_t stage = 0, step = 0;
  std::uint64_t n = 0;
  StageState s;
  get(&fmt, 4);
  if (fmt < 2 || fmt > format)
    throw checkpoint_error("checkpoint: " + name + " has format " + std::to_string(fmt) +
                           "; this build reads formats 2 to " + std::to_string(format));
  get(&stage, 4);
  get(&step, 4);
  get(&s.info.config_hash, 8);
  get(&s.info.rng_seed, 8);
  get(&s.info.data_position, 8);
  get(&n, 8);
  get(&name_len, 4);
  if (name_len > 64)
    throw checkpoint_error("checkpoint: " + name + " names an optimizer of " + std::to_string(name_len) +
                           " bytes (at most 64)");
  s.optimizer.resize(name_len);
  get(s.optimizer.data(), name_len);
  if (fmt >= 3) {
    std::uint32_t config_len = 0;
    get(&config_len, 4);
    if (config_len > 4096)
      throw checkpoint_error("checkpoint: " + name + " has a configuration text of " + std::to_string(config_len) +
                             " bytes (at most 4096)");
    s.info.config.resize(config_len);
    get(s.info.config.data(), config_len);
  }
  if (fmt >= 4) {
    std::int32_t stages = 0;
    std::uint32_t t = 0;
    get(&stages, 4);
    get(&t, 4);
    const auto bad = [&](const std::string& what) {
      return checkpoint_error("checkpoint: " + name + " is corrupt (" + what + ")");
    };
    if (stages < 1 || stage < 0 || stage >= stages)
      throw bad("stage " + std::to_string(stage) + " of " + std::to_string(stages) + " stages");
    if (t > max_tensors) throw bad(std::to_string(t) + " tensors, at most " + std::to_string(max_tensors));
    s.stages = stages;
    for (std::uint32_t i = 0; i < t; ++i) {
      ParamInfo x;
      std::uint32_t len = 0, dims = 0;
      std::uint64_t offset = 0;
      get(&len, 4);
      if (len > max_name) throw bad("a tensor name of " + std::to_string(len) + " bytes");
      x.name.resize(len);
      get(x.name.data(), len);
      get(&offset, 8);
      get(&dims, 4);
      if (dims > max_dims) throw bad("tensor '" + shown(x.name) + "' of " + std::to_string(dims) + " dimensions");
      x.shape.resize(dims);
      get(x.shape.data(), dims * sizeof(long long));
      std::uint64_t count = 1;  // the extents' product, capped at n + 1
      for (long long e : x.shape) {
        if (e < 0) throw bad("tensor '" + shown(x.name) + "' has an extent " + std::to_string(e));
        const auto u = static_cast<std::uint64_t>(e);
        count = u == 0 ? 0 : count > (n + 1) / u ? n + 1 : count * u;
      }
      x.offset = static_cast<std::size_t>(offset);
      if (offset > n || count > n - offset)
        throw bad("tensor '" + shown(x.name) + "' lies outside the stage's " + std::to_string(n) + " parameters");
      s.tensors.push_back(std::move(x));
    }
  }
  get(&k, 4);
  const std::size_t rest = b.size() - 8 - off;
  if (k > 16 || n > rest / sizeof(float) || rest != (1 + static_cast<std::size_t>(k)) * n * sizeof(float))
    throw checkpoint_error("checkpoint: " + name + " is truncated or has trailing bytes (" + std::to_string(b.size()) +
                           " bytes for " + std::to_string(n) + " parameters and " + std::to_string(k) +
                           " state buffers)");
  s.stage = stage;
  s.step = step;
  s.params.resize(n);
  get(s.params.data(), n * sizeof(float));
  s.state.resize(k);
  for (auto& buf : s.state) {
    buf.resize(n);
    get(buf.data(), n * sizeof(float));
  }
  return s;
}

/// One rank's verdict as agree() gathers it: -1, or the failed rank and the start of its message.
struct Verdict {
  std::int32_t rank = -1;  ///< the failed rank, or -1
  char text[252] = {};     ///< the start of its message, NUL-terminated
};

/// Every rank's verdict on a collective checkpoint operation: throws on every rank of every
/// replica if any rank failed (its own message on that rank; on the others the failed rank's
/// number, replica and message, cut to 251 bytes). Both gathers run before anyone throws, so
/// no rank is left waiting, and a rank aborted meanwhile by a faster one's throw still names
/// the cause.
template <class Runtime>
void agree(Runtime& rt, const std::string& failure, const std::string& what) {
  Verdict mine;
  if (!failure.empty()) {
    mine.rank = rt.rank();
    const std::string_view t = std::string_view(failure).substr(failure.rfind("checkpoint: ", 0) == 0 ? 12 : 0);
    std::memcpy(mine.text, t.data(), std::min(t.size(), sizeof mine.text - 1));
  }
  std::vector<Verdict> all(static_cast<std::size_t>(rt.communicator().size()));
  rt.communicator().all_gather(std::span<const Verdict>(&mine, 1), std::span(all));
  Verdict first;  // this replica's first failed rank
  for (const Verdict& v : all)
    if (v.rank >= 0 && first.rank < 0) first = v;
  std::vector<Verdict> replicas(1, first);
  if (rt.replica_comm() != nullptr && rt.replicas() > 1) {
    replicas.resize(static_cast<std::size_t>(rt.replicas()));
    rt.replica_comm()->all_gather(std::span<const Verdict>(&first, 1), std::span(replicas));
  }
  for (std::size_t j = 0; j < replicas.size(); ++j) {
    const Verdict& v = replicas[j];
    if (v.rank < 0) continue;
    if (v.rank == rt.rank() && static_cast<int>(j) == rt.replica() && !failure.empty()) throw checkpoint_error(failure);
    throw checkpoint_error("checkpoint: rank " + std::to_string(v.rank) +
                           (replicas.size() > 1 ? " of replica " + std::to_string(j) : std::string()) + " could not " +
                           what + " (" + v.text + ")");
  }
}

/// The names of dir's step directories ("step-" and 8 characters), unsorted; empty when dir
/// cannot be read. POSIX calls, not std::filesystem's iterators, whose libstdc++ versions end
/// the process when an allocation fails inside them.
inline std::vector<std::string> step_dirs(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  try {
    while (const dirent* e = ::readdir(d)) {
      const std::string_view n = e->d_name;
      if (n.size() == 13 && n.substr(0, 5) == "step-") out.emplace_back(n);
    }
  } catch (...) {
    ::closedir(d);
    throw;
  }
  ::closedir(d);
  return out;
}

/// Removes the step directory `path` and the files in it (best effort: what cannot be
/// removed stays). A step directory holds only files.
inline void remove_step_dir(const std::filesystem::path& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return;
  const int fd = ::dirfd(d);
  while (const dirent* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) ::unlinkat(fd, e->d_name, 0);
  ::closedir(d);
  ::rmdir(path.c_str());
}

/// Removes dir/step-N after a failed save of step N, unless dir/latest names it (best effort:
/// what cannot be removed stays, and the next save of N overwrites it file by file).
inline void remove_partial(const std::filesystem::path& dir, int step) noexcept {
  try {
    bool named = false;
    try {
      named = latest_step(dir) == step;
    } catch (const checkpoint_error&) {  // no (readable) latest: nothing names the partial directory
    }
    if (!named) remove_step_dir(dir / step_name(step));
  } catch (...) {  // out of memory: the partial directory stays
  }
}

}  // namespace checkpoint

/// Collective: every rank writes its stages' parameters and `opt`'s state after
/// opt.steps_taken() steps into dir/step-N/, then rank 0 points dir/latest at it and removes
/// all but the two newest step directories; it returns on every rank once `latest` names the
/// new checkpoint. Throws on every rank if any rank failed to write (naming that rank). `rt` is a po::Runtime, `opt` its optimizer (po::AdamW, po::Sgd);
/// `info` is the caller's (config hash, seed, data position).
/// @code
///   if ((step + 1) % every == 0) po::save_checkpoint(dir, rt, opt, {config_hash, seed, step + 1});
/// @endcode
template <class Runtime, class Optimizer>
void save_checkpoint(const std::filesystem::path& dir, Runtime& rt, Optimizer& opt, const CheckpointInfo& info) {
  const int step = opt.steps_taken();
  const Shape& sh = rt.program().shape;
  // Every replica takes part in gathering sharded state (collectives, before any file work
  // that could fail on one of them); replica 0 writes.
  std::vector<checkpoint::StageState> states;
  rt.guard("save_checkpoint", [&] {
    for (int c = 0; c < sh.v; ++c) {
      checkpoint::StageState& s = states.emplace_back();
      s.stage = sh.stage_of(rt.rank(), c);
      s.stages = sh.stages();
      const std::vector<ParamInfo> all = rt.stages()[static_cast<std::size_t>(c)].parameter_info();
      const std::vector<ParamRange> copies = rt.tied_copies(c);
      s.step = step;
      s.info = info;
      s.optimizer = opt.name();
      s.params = opt.full_master(c);  // fp32: the working parameters, or a mixed-precision stage's master
      for (int k = 0; k < opt.state_count(); ++k) s.state.push_back(opt.full_state(c, k));
      s.tensors = all;
      if (!copies.empty()) {  // a shared parameter is stored once, by its primary's stage
        const std::vector<ParamInfo> keep = checkpoint::stored_tensors(all, copies, false);
        s.tensors = checkpoint::stored_tensors(all, copies, true);
        const auto pack = [&](const std::vector<float>& full) {
          std::vector<float> out;
          for (std::size_t i = 0; i < keep.size(); ++i) {
            out.resize(std::max(out.size(), s.tensors[i].offset + keep[i].count()));
            std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(keep[i].offset), keep[i].count(),
                        out.begin() + static_cast<std::ptrdiff_t>(s.tensors[i].offset));
          }
          return out;
        };
        s.params = pack(s.params);
        for (std::vector<float>& b : s.state) b = pack(b);
      }
    }
    return 0;
  });
  std::string failure;
  try {
    if (info.config.size() > 4096)
      throw checkpoint_error("checkpoint: CheckpointInfo::config has " + std::to_string(info.config.size()) +
                             " bytes; at most 4096 are stored");
    if (rt.replica() == 0) {
      std::filesystem::create_directories(dir / checkpoint::step_name(step));
      for (const checkpoint::StageState& s : states)
        checkpoint::write_atomic(checkpoint::stage_file(dir, step, s.stage), checkpoint::encode(s));
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Barrier and verdict in one: `latest` may move only when every stage is on disk. When a
  // rank failed (a full disk), every write has ended: rank 0 removes the partial step
  // directory, so the next save starts clean and `latest` still names the last whole one.
  try {
    checkpoint::agree(rt, failure, "write its stages of step " + std::to_string(step));
  } catch (const checkpoint_error&) {
    if (rt.rank() == 0 && rt.replica() == 0) checkpoint::remove_partial(dir, step);
    throw;
  }
  // Rank 0 points `latest` at the new step; every rank returns only once it has (or throws
  // rank 0's reason), so a load that follows on any rank finds it.
  const bool lead = rt.rank() == 0 && rt.replica() == 0;
  const std::string name = checkpoint::step_name(step);
  std::string moved;
  if (lead) try {
      std::vector<std::byte> text(name.size() + 1);
      std::memcpy(text.data(), name.data(), name.size());
      text.back() = std::byte{'\n'};
      checkpoint::write_atomic(dir / "latest", text);
    } catch (const std::exception& e) {
      moved = e.what();
    }
  checkpoint::agree(rt, moved, "point " + (dir / "latest").string() + " at " + name);
  if (!lead) return;
  // Keep this checkpoint and the one before: older ones are no longer needed (best effort: a
  // stale directory wastes space, nothing more).
  try {
    std::vector<std::string> older = checkpoint::step_dirs(dir);
    std::erase_if(older, [&](const std::string& n) { return !(n < name); });
    std::sort(older.begin(), older.end());
    for (std::size_t i = 0; i + 1 < older.size(); ++i) checkpoint::remove_step_dir(dir / older[i]);
  } catch (const std::exception&) {
  }
}

/// The run whose checkpoints `dir` holds (the CheckpointInfo of stage 0 of the step
/// dir/latest names), or nothing when there is no dir/latest. Throws checkpoint_error naming
/// the file when `latest` or that stage file cannot be read or is not a checkpoint.
inline std::optional<CheckpointInfo> checkpoint_owner(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir / "latest", ec)) return std::nullopt;
  const std::filesystem::path file = checkpoint::stage_file(dir, checkpoint::latest_step(dir), 0);
  return checkpoint::decode(checkpoint::read_all(file), file.string()).info;
}

namespace checkpoint {

/// "[256, 32]": a tensor's shape as messages show it.
inline std::string shape_text(const std::vector<long long>& shape) {
  std::string t = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) t += (i ? ", " : "") + std::to_string(shape[i]);
  return t + "]";
}

/// Whether `a` and `b` name the same tensors at the same offsets with the same shapes.
inline bool same_tensors(const std::vector<ParamInfo>& a, const std::vector<ParamInfo>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const ParamInfo& x, const ParamInfo& y) {
    return x.name == y.name && x.offset == y.offset && x.shape == y.shape;
  });
}

}  // namespace checkpoint

/// Collective: loads this rank's stages from the checkpoint dir/latest names into `rt` (their
/// parameters) and `opt` (its state and step count) and returns the checkpoint's info. A stage
/// whose file (same stage number) holds the same tensors (names, offsets, shapes) loads from it;
/// otherwise (the checkpoint has another cut of the model) each of its tensors comes by name
/// from the file that holds it, with the optimizer's state for it. Throws checkpoint_error on
/// every rank when any rank's file is missing, corrupt, of another step, optimizer or
/// configuration (the message names the file on the rank that read it; with `config`, the
/// configuration text of CheckpointInfo, the first word that differs), or when a tensor is
/// missing, held twice or of another shape (the message names the tensor).
template <class Runtime, class Optimizer>
CheckpointInfo load_checkpoint(const std::filesystem::path& dir, Runtime& rt, Optimizer& opt, std::uint64_t config_hash,
                               std::string_view config = {}) {
  const Shape& sh = rt.program().shape;
  CheckpointInfo info{};
  std::vector<checkpoint::StageState> states(static_cast<std::size_t>(sh.v));  // per chunk, this run's layout
  int step = -1;
  std::string failure;
  try {
    step = checkpoint::latest_step(dir);
    // Every file read is held to the step, the configuration and the optimizer.
    const auto read = [&](int stage) {
      const std::filesystem::path file = checkpoint::stage_file(dir, step, stage);
      checkpoint::StageState s = checkpoint::decode(checkpoint::read_all(file), file.string());
      if (s.stage != stage || s.step != step)
        throw checkpoint_error("checkpoint: " + file.string() + " holds stage " + std::to_string(s.stage) +
                               " of step " + std::to_string(s.step) + ", not stage " + std::to_string(stage) +
                               " of step " + std::to_string(step));
      if (s.info.config_hash != config_hash) {
        const std::string differs = s.info.config.empty() || config.empty()
                                        ? std::string()
                                        : checkpoint::config_difference(s.info.config, config);
        throw checkpoint_error("checkpoint: " + file.string() + " was written by a run with another configuration (" +
                               (differs.empty() ? "model, stages, batch, optimizer, steps, seed or data" : differs) +
                               ")");
      }
      if (s.optimizer != opt.name() || static_cast<int>(s.state.size()) != opt.state_count())
        throw checkpoint_error("checkpoint: " + file.string() + " holds the state of optimizer '" + s.optimizer +
                               "' (" + std::to_string(s.state.size()) + " buffers); this run's is '" + opt.name() +
                               "' (" + std::to_string(opt.state_count()) + ")");
      info = s.info;
      return s;
    };
    // The file of each stage's own number, where it holds that stage as this run cuts it.
    std::vector<std::vector<ParamInfo>> wanted(states.size());
    std::vector<int> by_name;                         // the chunks whose tensors come by name
    int files = 0;                                    // the checkpoint's stage count, from its files (format 4)
    std::vector<std::size_t> tied(states.size(), 0);  // per chunk: values that are copies of shared parameters
    for (int c = 0; c < sh.v; ++c) {
      const int stage = sh.stage_of(rt.rank(), c);
      const auto u = static_cast<std::size_t>(c);
      // A copy of a shared parameter is not stored: it comes from its primary (share_tied below).
      const std::vector<ParamRange> copies = rt.tied_copies(c);
      for (const ParamRange& r : copies) tied[u] += r.size();
      wanted[u] = checkpoint::stored_tensors(rt.stages()[u].parameter_info(), copies, false);
      const std::size_t n = rt.stages()[u].parameter_count();
      std::error_code ec;
      if (std::filesystem::exists(checkpoint::stage_file(dir, step, stage), ec)) {
        checkpoint::StageState s = read(stage);
        files = s.stages;
        const bool legacy = s.stages == 0;  // formats 2 and 3: no tensors named, the same cut assumed
        const std::vector<ParamInfo> packed = checkpoint::stored_tensors(rt.stages()[u].parameter_info(), copies, true);
        if (legacy || (s.stages == sh.stages() && checkpoint::same_tensors(s.tensors, packed))) {
          const std::size_t stored = legacy ? n : n - tied[u];
          if (s.params.size() != stored)
            throw checkpoint_error("checkpoint: " + checkpoint::stage_file(dir, step, stage).string() + " has " +
                                   std::to_string(s.params.size()) + " parameters; stage " + std::to_string(stage) +
                                   " stores " + std::to_string(stored));
          if (!legacy && !copies.empty()) {  // each stored tensor back at its place in parameters()
            const auto unpack = [&](const std::vector<float>& file) {
              std::vector<float> full(n, 0.0f);
              for (std::size_t i = 0; i < packed.size(); ++i)
                std::copy_n(file.begin() + static_cast<std::ptrdiff_t>(packed[i].offset), packed[i].count(),
                            full.begin() + static_cast<std::ptrdiff_t>(wanted[u][i].offset));
              return full;
            };
            s.params = unpack(s.params);
            for (std::vector<float>& b : s.state) b = unpack(b);
          }
          states[u] = std::move(s);
          continue;
        }
      }
      by_name.push_back(c);
      states[u].params.assign(n, 0.0f);
      states[u].state.assign(static_cast<std::size_t>(opt.state_count()), std::vector<float>(n, 0.0f));
    }
    if (!by_name.empty()) {
      if (files == 0) files = read(0).stages;
      if (files == 0)
        throw checkpoint_error("checkpoint: " + (dir / checkpoint::step_name(step)).string() +
                               " was written before checkpoints named their tensors (format 3 or older): it "
                               "resumes only with the cut it was written with");
      // Every tensor of those chunks, by name from the file that holds it, each file read once.
      std::vector<std::vector<int>> from(states.size());  // per chunk and tensor: the stage file it came from
      for (const int c : by_name)
        from[static_cast<std::size_t>(c)].assign(wanted[static_cast<std::size_t>(c)].size(), -1);
      for (int f = 0; f < files; ++f) {
        const checkpoint::StageState s = read(f);
        const std::string file = checkpoint::stage_file(dir, step, f).string();
        for (const int c : by_name) {
          const auto u = static_cast<std::size_t>(c);
          for (std::size_t i = 0; i < wanted[u].size(); ++i) {
            const ParamInfo& t = wanted[u][i];
            const auto it =
                std::find_if(s.tensors.begin(), s.tensors.end(), [&](const ParamInfo& x) { return x.name == t.name; });
            if (it == s.tensors.end()) continue;
            if (from[u][i] >= 0)
              throw checkpoint_error("checkpoint: tensor '" + t.name + "' is in both " +
                                     checkpoint::stage_file(dir, step, from[u][i]).string() + " and " + file +
                                     " (names must be unique in the model: parameter_info())");
            if (it->shape != t.shape)
              throw checkpoint_error("checkpoint: tensor '" + t.name + "' has shape " +
                                     checkpoint::shape_text(it->shape) + " in " + file + "; stage " +
                                     std::to_string(sh.stage_of(rt.rank(), c)) + " of this run has " +
                                     checkpoint::shape_text(t.shape));
            from[u][i] = f;
            const auto at = static_cast<std::ptrdiff_t>(it->offset), to = static_cast<std::ptrdiff_t>(t.offset),
                       count = static_cast<std::ptrdiff_t>(t.count());
            std::copy(s.params.begin() + at, s.params.begin() + at + count, states[u].params.begin() + to);
            for (std::size_t k = 0; k < s.state.size(); ++k)
              std::copy(s.state[k].begin() + at, s.state[k].begin() + at + count, states[u].state[k].begin() + to);
          }
        }
      }
      for (const int c : by_name) {
        const auto u = static_cast<std::size_t>(c);
        for (std::size_t i = 0; i < wanted[u].size(); ++i)
          if (from[u][i] < 0)
            throw checkpoint_error("checkpoint: " + (dir / checkpoint::step_name(step)).string() + " (" +
                                   std::to_string(files) + " stages) has no tensor '" + wanted[u][i].name +
                                   "' (stage " + std::to_string(sh.stage_of(rt.rank(), c)) + " of this run)");
        // The named tensors must be the whole stage, or some of its parameters would keep their
        // initial values.
        std::size_t covered = tied[u];
        for (const ParamInfo& t : wanted[u]) covered += t.count();
        if (covered != states[u].params.size())
          throw checkpoint_error("checkpoint: stage " + std::to_string(sh.stage_of(rt.rank(), c)) + "'s " +
                                 std::to_string(wanted[u].size()) + " named tensors hold " + std::to_string(covered) +
                                 " of its " + std::to_string(states[u].params.size()) +
                                 " parameters; another cut loads by tensor names, which must cover the stage");
      }
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  checkpoint::agree(rt, failure, "read its stages of " + dir.string());
  rt.guard("load_checkpoint", [&] {
    for (int c = 0; c < sh.v; ++c) {
      const checkpoint::StageState& s = states[static_cast<std::size_t>(c)];
      opt.set_full_master(c, s.params);
      for (int k = 0; k < opt.state_count(); ++k) opt.set_full_state(c, k, s.state[static_cast<std::size_t>(k)]);
    }
    opt.set_steps_taken(step);
    return 0;
  });
  rt.share_tied();  // every copy of a shared parameter from its primary
  return info;
}

}  // namespace pipeoffload
