// expect: po::Runtime: Layer must model po::layer_for<Layer, Backend::Context>: it needs input_boundary(shape), output_boundary(shape), saved_bytes(shape)
// A stage type without backward_weight (W) cannot run a split-backward schedule: the runtime
// must say which members a layer needs, not fail deep inside its template.
#include <pipeoffload/runtime.hpp>

struct NoWeightGradient {
  float p = 0, g = 0;
  po::Boundary input_boundary(po::MicrobatchShape) const { return {1}; }
  po::Boundary output_boundary(po::MicrobatchShape) const { return {1}; }
  std::size_t saved_bytes(po::MicrobatchShape) const { return 4; }
  std::size_t stash_bytes(po::MicrobatchShape) const { return 4; }
  void forward(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*) {}
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, po::ConstTensor, po::Tensor, std::byte*,
                      std::byte*) {}
  std::span<float> parameters() { return {&p, 1}; }
  std::span<float> gradients() { return {&g, 1}; }
};

using Bad = po::Runtime<po::PO_F, NoWeightGradient, po::backend::Cpu, po::comm::Threads>;
static_assert(sizeof(Bad) > 0);
int main() {}
