// expect: every template argument must be a policy
#include <pipeoffload/pipeoffload.hpp>
struct NotAPolicy {};
using Bad = po::Schedule<po::UniformRepeat, NotAPolicy>;
constexpr auto spec = Bad::spec;
int main() {}
