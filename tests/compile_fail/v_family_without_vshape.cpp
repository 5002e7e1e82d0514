// expect: ZB-V, V-Half, V-Min and DualPipeV run on the V placement (add VShape), and only they do.
#include <pipeoffload/pipeoffload.hpp>
using Bad = po::Schedule<po::ZeroBubble<po::Family::zb_v>>;
constexpr auto spec = Bad::spec;
int main() {}
