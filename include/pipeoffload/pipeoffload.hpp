// pipeoffload/pipeoffload.hpp: the CPU-safe umbrella header.
//
// Schedule types, validation and simulation; no threads, no I/O, all constexpr.
// `po` is the short name the documentation and tests use: po::PO_F::build({8, 4, 32}).
/// @file
#pragma once

#include "error.hpp"
#include "policy/policy.hpp"
#include "schedule/schedule.hpp"
#include "schedule/torch_csv.hpp"
#include "schedule/validate.hpp"
#include "sim/measure.hpp"
#include "sim/simulate.hpp"
#include "version.hpp"

namespace po = pipeoffload;
