// pipeoffload/backend/cpu/context.hpp: what a pass on backend::Cpu is given.
/// @file
#pragma once

namespace pipeoffload::backend {

class Cpu;

/// Context of one pass on the CPU backend: the pass runs on its stream's worker thread, so it
/// simply computes; `rank` and `stream` are there for logging and for layers that keep
/// per-stream scratch.
struct CpuContext {
  Cpu* device = nullptr;  ///< the backend the pass runs on
  int rank = 0;           ///< the backend's rank (Cpu::Options::rank)
  int stream = 0;         ///< the backend's id of the stream the pass runs on
};

}  // namespace pipeoffload::backend
