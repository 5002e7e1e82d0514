// expect: two grouping policies were given
#include <pipeoffload/pipeoffload.hpp>
using Bad = po::Schedule<po::UniformRepeat, po::InterleavePolicy<4>>;
constexpr auto spec = Bad::spec;
int main() {}
