// expect: po::Batch::add: a batch does not own its data; pass a range that outlives the call, not a temporary.
// A batch holds views of the caller's tensors; a temporary would dangle before the step reads it.
#include <pipeoffload/runtime.hpp>

#include <vector>

int main() {
  po::Batch batch;
  batch.add("features", std::vector<float>(12, 0.0f), {4, 3});
  return static_cast<int>(batch.tensors().size());
}
