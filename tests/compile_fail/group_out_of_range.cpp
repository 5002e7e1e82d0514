// expect: GIS(g): group size g (legal: ceil(d/2) <= g <= d)
// A shape error in a constant expression is a compile error that shows the sentence.
#include <pipeoffload/pipeoffload.hpp>
static_assert(po::validate(po::GIS_G<2>::build({8, 2, 16})));
int main() {}
