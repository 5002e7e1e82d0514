// pipeoffload/version.hpp: the library's version, as three macros and pipeoffload::version.
// The one source is the top-level VERSION file, which meson.build and CMakeLists.txt read; this
// header is checked in rather than generated, since the library is also used with no build
// system (`include/` on the include path, docs/using.md), so it writes the three numbers once,
// below, and tests/docs/check_version.py fails when they differ from VERSION.
/// @file
#pragma once

/// The library's major version.
#define PIPEOFFLOAD_VERSION_MAJOR 0
/// The library's minor version.
#define PIPEOFFLOAD_VERSION_MINOR 1
/// The library's patch version.
#define PIPEOFFLOAD_VERSION_PATCH 0

/// "major.minor.patch" as one string literal, from three macros (expanded before they are joined).
#define PIPEOFFLOAD_VERSION_JOIN(major, minor, patch) PIPEOFFLOAD_VERSION_JOIN_TOKENS(major, minor, patch)
/// "major.minor.patch" as one string literal, from three tokens as written.
#define PIPEOFFLOAD_VERSION_JOIN_TOKENS(major, minor, patch) #major "." #minor "." #patch

namespace pipeoffload {
/// The library's version, "major.minor.patch".
inline constexpr const char* version =
    PIPEOFFLOAD_VERSION_JOIN(PIPEOFFLOAD_VERSION_MAJOR, PIPEOFFLOAD_VERSION_MINOR, PIPEOFFLOAD_VERSION_PATCH);
}  // namespace pipeoffload
