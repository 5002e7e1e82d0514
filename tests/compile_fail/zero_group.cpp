// expect: the group size G must be at least 1
#include <pipeoffload/pipeoffload.hpp>
using Bad = po::Schedule<po::InterleavePolicy<0>>;
constexpr auto spec = Bad::spec;
int main() {}
