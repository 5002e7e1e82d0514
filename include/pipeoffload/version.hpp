// pipeoffload/version.hpp
/// @file
#pragma once

/// The library's major version.
#define PIPEOFFLOAD_VERSION_MAJOR 0
/// The library's minor version.
#define PIPEOFFLOAD_VERSION_MINOR 1
/// The library's patch version.
#define PIPEOFFLOAD_VERSION_PATCH 0

namespace pipeoffload {
/// The library's version, "major.minor.patch".
inline constexpr const char* version = "0.1.0";
}  // namespace pipeoffload
