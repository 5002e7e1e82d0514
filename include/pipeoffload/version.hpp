// pipeoffload/version.hpp
/// @file
// The version is the one in the top-level VERSION file, which meson.build and CMakeLists.txt
// read. This header is not generated from it, because the library is also used without a build
// system (`include/` on the include path, docs/using.md): it writes the three numbers once, below
// (pipeoffload::version is spelled from them), and tests/docs/check_version.py fails when they
// differ from VERSION. Change VERSION, then these three.
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
