// pipeoffload/version.hpp
#pragma once

#define PIPEOFFLOAD_VERSION_MAJOR 0
#define PIPEOFFLOAD_VERSION_MINOR 1
#define PIPEOFFLOAD_VERSION_PATCH 0

namespace pipeoffload {
inline constexpr const char* version = "0.1.0";
}
