// expect: po::StageRef: a stage must model po::layer_for<Stage, Context>: it needs input_boundary(shape)
// One stage type of a heterogeneous pipeline that still has the old single-boundary member
// (boundary_floats) must be refused where it is wrapped, with the list of members it needs.
#include <pipeoffload/runtime.hpp>

struct OldStyleHead {
  float p = 0, g = 0;
  std::size_t boundary_floats(po::MicrobatchShape) const { return 1; }
  std::size_t saved_bytes(po::MicrobatchShape) const { return 4; }
  std::size_t stash_bytes(po::MicrobatchShape) const { return 4; }
  void forward(po::backend::CpuContext&, const po::Microbatch&, const float*, float*, std::byte*) {}
  void backward_input(po::backend::CpuContext&, const po::Microbatch&, const float*, float*, std::byte*, std::byte*) {}
  void backward_weight(po::backend::CpuContext&, const po::Microbatch&, std::byte*, std::byte*) {}
  std::span<float> parameters() { return {&p, 1}; }
  std::span<float> gradients() { return {&g, 1}; }
};

int main() {
  OldStyleHead head;
  po::StageRef<po::backend::CpuContext> ref(head);
  return ref.parameters().size() == 1 ? 0 : 1;
}
