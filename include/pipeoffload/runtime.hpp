// pipeoffload/runtime.hpp: the CPU training umbrella (threads, no CUDA).
//
// Everything pipeoffload.hpp has, plus the runtime, its optimizers, the CPU backend, the
// thread-rank communicator and the host-side offload layout. `po::` as in pipeoffload.hpp.
// Checkpoints (file I/O) are in runtime/checkpoint.hpp.
/// @file
#pragma once

#include "backend/backend.hpp"
#include "backend/cpu/cpu.hpp"
#include "comm/communicator.hpp"
#include "comm/threads.hpp"
#include "layer.hpp"
#include "packing.hpp"
#include "pipeoffload.hpp"
#include "policy/host_bins.hpp"
#include "runtime/batch.hpp"
#include "runtime/optimizer.hpp"
#include "runtime/runtime.hpp"
#include "runtime/stage.hpp"
#include "runtime/thread_ranks.hpp"
#include "tensor.hpp"
