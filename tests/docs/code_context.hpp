// tests/docs/code_context.hpp: the names the @code examples of include/ use without declaring
// them, each declared here once, with its type (tests/docs/check_code_blocks.py compiles every
// example after this file). An example reads like a fragment of a program, so `rt` is "your
// runtime" and `step` "the step you are on"; what an example means by a name, this file says.
// Only declarations: the examples are compiled (-fsyntax-only), never linked or run.
//
// One namespace per kind of example (check_code_blocks.py's kinds): cpu, and where the build
// has them, cuda (PIPEOFFLOAD_WITH_CUDA), mpi (PIPEOFFLOAD_EXAMPLES_MPI, defined by the
// script) and mpi_cuda (both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <vector>

#include <pipeoffload/runtime.hpp>
#include <pipeoffload/runtime/checkpoint.hpp>

namespace pipeoffload_examples {

/// Stands for a user's layer type (pipeoffload/layer.hpp has a whole one): its members are
/// declared, never defined.
struct StandInLayer {
  po::Boundary input_boundary(po::MicrobatchShape) const;
  po::Boundary output_boundary(po::MicrobatchShape) const;
  std::size_t saved_bytes(po::MicrobatchShape) const;
  std::size_t stash_bytes(po::MicrobatchShape) const;
  void forward(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*);
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*,
                      std::byte*);
  void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte*, std::byte*);
  std::span<float> parameters();
  std::span<float> gradients();
};
static_assert(po::layer_for<StandInLayer, po::backend::CpuContext>);

namespace cpu {

// A rank of a pipeline of thread ranks on the CPU backend, as runtime/runtime.hpp's example
// makes it.
using Runtime = po::Runtime<po::backend::Cpu, po::comm::Threads>;
extern int d, v, m;                   // the shape: ranks, chunks per rank, microbatches
extern int r;                         // this rank
extern const po::Program& program;    // a program of that shape
extern po::backend::Cpu& dev;         // this rank's device
extern po::backend::CpuContext& ctx;  // the context of one of its streams
extern po::comm::Threads& comm;       // this rank's pipeline
extern po::comm::Threads& c;          // any group of ranks (collectives)
extern po::comm::Threads& reps;       // this rank's data-parallel group
extern Runtime& rt;
extern po::AdamW<Runtime>& opt;
std::vector<po::StageRef<po::backend::CpuContext>> my_stages(int rank);  // a rank's v stages
struct Embedding : StandInLayer {};                                      // three kinds of stage
struct Block : StandInLayer {};
struct Head : StandInLayer {};

// The training loop: step `step` of `steps`, a checkpoint every `every` steps into `dir`.
extern int step, steps, every;
po::Batch batch(int step);  // a step's inputs
float lr(int step);         // a learning-rate schedule
extern po::ParamGroup no_decay;
extern std::filesystem::path dir;
extern std::uint64_t config_hash, seed;

// Data: `rows` rows of features per microbatch, and what a pipeline counts.
extern std::vector<float> features, targets;
extern int rows;
extern std::vector<float> x, y;  // a boundary tensor sent, one received
extern std::uint64_t samples, tokens;
extern po::ScheduleSpec spec;
extern po::Shape shape;

// Device memory of a data-parallel group of `dp` ranks: blocks of `block` bytes.
extern std::size_t dp, block;
extern std::byte *in, *out, *mine, *all;

}  // namespace cpu

#ifdef PIPEOFFLOAD_EXAMPLES_MPI
namespace mpi {

extern int argc;
extern char** argv;
extern int d, v, m;  // the shape
extern int g;        // this process's rank in a job of dp replicas of d ranks
extern po::backend::Cpu& dev;
struct MyLayer : StandInLayer {};
extern std::vector<MyLayer> mine;  // this rank's v stages, in chunk order

}  // namespace mpi
#endif

#ifdef PIPEOFFLOAD_WITH_CUDA
namespace cuda {

extern int d, dp;   // ranks per pipeline, replicas
extern int g;       // this process's rank in the job: replica * d + rank
extern int device;  // its GPU
extern po::backend::Cuda& dev;
extern po::comm::NcclIdBytes id;  // the job's NCCL id (comm/nccl/id_file.hpp, comm/mpi/nccl_id.hpp)

}  // namespace cuda
#endif

#if defined(PIPEOFFLOAD_EXAMPLES_MPI) && defined(PIPEOFFLOAD_WITH_CUDA)
namespace mpi_cuda {

extern po::comm::Mpi& mpi;  // the job's processes

}  // namespace mpi_cuda
#endif

}  // namespace pipeoffload_examples
