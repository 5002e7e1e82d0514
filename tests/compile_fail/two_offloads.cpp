// expect: two offload policies were given
#include <pipeoffload/pipeoffload.hpp>
using Bad = po::Schedule<po::OffloadPolicy<po::offload::half>, po::UniformRepeat, po::OffloadPolicy<po::offload::all>>;
constexpr auto spec = Bad::spec;
int main() {}
