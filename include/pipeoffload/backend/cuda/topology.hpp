// pipeoffload/backend/cuda/topology.hpp: which GPUs share a PCIe switch, as a pure function.
//
// docs/design.md section 3: two GPUs under one PCIe switch share its uplink to the host, so their
// offload copies are staggered (the schedule's Costs::stagger_pairs gives ranks r and r^1
// opposite copy-slot parities). Whether a machine has such pairs is decided here from each
// GPU's PCI path (sysfs: /sys/bus/pci/devices/<bus id> resolves to
// /sys/devices/pci0000:00/<root port>/<switch upstream>/<switch downstream>/<gpu>), so a CPU
// test can check the decision with fabricated paths. backend/cuda/device.hpp reads the real
// paths (cudaDeviceGetPCIBusId + realpath).
/// @file
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace pipeoffload::cuda {

/// Components of a sysfs PCI path below /sys/devices: {"pci0000:00", "0000:00:01.0", ...}.
inline std::vector<std::string> pci_components(std::string_view path) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i < path.size()) {
    const std::size_t j = std::min(path.find('/', i), path.size());
    if (j > i) out.emplace_back(path.substr(i, j - i));
    i = j + 1;
  }
  // Keep from the root complex ("pciDDDD:BB") on; what is above it (/sys/devices) says nothing.
  const auto root = std::find_if(out.begin(), out.end(), [](const std::string& c) { return c.rfind("pci", 0) == 0; });
  out.erase(out.begin(), root);
  return out;
}

/// The switch a GPU hangs off: its path without the GPU and the switch's downstream port, if
/// what remains still lies below a root port (root complex + root port + upstream port, at
/// least 3 components). A GPU directly under a root port has no switch: "".
inline std::string switch_of(std::string_view path) {
  const std::vector<std::string> c = pci_components(path);
  if (c.size() < 5) return "";
  std::string key;
  for (std::size_t i = 0; i + 2 < c.size(); ++i) key += "/" + c[i];
  return key;
}

/// How ranks are placed on GPUs so that PCIe pairs are ranks (r, r^1).
struct Pairing {
  std::vector<int> device_of_rank;   ///< rank r runs on this CUDA device
  std::vector<int> partner_of_rank;  ///< r^1 when both share a switch, else -1
  bool stagger_pairs = false;        ///< every rank has a partner (Costs::stagger_pairs)
  int pairs = 0;                     ///< PCIe pairs formed
};

/// Pairs GPUs that share a switch, in device order within each switch; places each pair on
/// ranks (2p, 2p+1), then the unpaired devices in device order. `paths[i]` is device i's PCI
/// path. A machine with no shared switch gets the identity placement and no partners, and
/// runs unpaired. Staggering is on only when every rank has its partner: the schedule core
/// staggers all pairs (r, r^1) or none.
inline Pairing pair_devices(const std::vector<std::string>& paths) {
  const int n = static_cast<int>(paths.size());
  std::map<std::string, std::vector<int>> by_switch;  // ordered: deterministic placement
  for (int i = 0; i < n; ++i) {
    const std::string s = switch_of(paths[static_cast<std::size_t>(i)]);
    if (!s.empty()) by_switch[s].push_back(i);
  }
  std::vector<std::pair<int, int>> pairs;
  std::vector<bool> used(static_cast<std::size_t>(n), false);
  for (const auto& [sw, devs] : by_switch)
    for (std::size_t k = 0; k + 1 < devs.size(); k += 2) {
      pairs.emplace_back(devs[k], devs[k + 1]);
      used[static_cast<std::size_t>(devs[k])] = used[static_cast<std::size_t>(devs[k + 1])] = true;
    }
  std::sort(pairs.begin(), pairs.end());
  Pairing p;
  p.pairs = static_cast<int>(pairs.size());
  for (const auto& [a, b] : pairs) {
    const int r = static_cast<int>(p.device_of_rank.size());
    p.device_of_rank.push_back(a);
    p.device_of_rank.push_back(b);
    p.partner_of_rank.push_back(r + 1);
    p.partner_of_rank.push_back(r);
  }
  for (int i = 0; i < n; ++i)
    if (!used[static_cast<std::size_t>(i)]) {
      p.device_of_rank.push_back(i);
      p.partner_of_rank.push_back(-1);
    }
  p.stagger_pairs = n > 0 && 2 * p.pairs == n;
  return p;
}

}  // namespace pipeoffload::cuda
