#pragma once
// Which CUDA devices a build of kvret runs on: the architectures it was compiled for (CMAKE_CUDA_ARCHITECTURES, as
// the compile definition KVRET_CUDA_ARCHS) against a device's compute capability. Pure host code, in every build.
//
// The rule (docs/cuda_backend.md), for a device of compute capability M.m:
//  - real code (SASS) for sm_Xy runs when M == X and m >= y (sm_80 runs on 8.0, 8.6, 8.7, 8.9); arch-specific code
//    (sm_90a) only when M.m == X.y exactly; family code (sm_100f) when M == X and m >= y;
//  - PTX for compute_Xy is compiled by the driver for any M.m >= X.y (compute_90a: only 9.0; compute_100f: 10.y and
//    up within major 10).
#include <string>
#include <string_view>
#include <vector>

namespace kvret::cuda_arch {

/// One entry of a CMAKE_CUDA_ARCHITECTURES list: "<XY>[a|f][-real|-virtual]", e.g. "80", "90a-real", "100-virtual".
/// A plain entry embeds both real code and PTX.
struct ArchEntry {
  int arch = 0;       ///< 10 * major + minor: 80, 89, 100, 120
  char variant = 0;   ///< 0, 'a' (arch-specific) or 'f' (family-specific)
  bool sass = false;  ///< real code for sm_XY
  bool ptx = false;   ///< PTX for compute_XY
};

/// Parses a list separated by ';' or ','. False on an entry it cannot read (out is then unspecified).
bool parse_arch_list(std::string_view list, std::vector<ArchEntry>& out);

/// How a device of compute capability major.minor runs code built for `entries`.
enum class DeviceFit {
  kSass,  ///< real code for its architecture family is embedded
  kPtx,   ///< no real code, but PTX the driver compiles for it
  kNone,  ///< neither: no kernel can be loaded on it
};
DeviceFit device_fit(int major, int minor, const std::vector<ArchEntry>& entries);

/// The entries in words: "sm_80, sm_89, sm_90, sm_100 and PTX for compute_100".
std::string describe(const std::vector<ArchEntry>& entries);

/// The list the library was built with (KVRET_CUDA_ARCHS, entries separated by ','); "" when unknown (a build without
/// nvcc, or CMAKE_CUDA_ARCHITECTURES=OFF: the compiler's own default architectures).
const char* built_arch_list() noexcept;

/// Empty when a device of compute capability major.minor can run a build for `list`; otherwise the reason, naming
/// `device` (e.g. "config.device_id 0 (Tesla T4)"), its sm_XY and the architectures built. An empty list (unknown)
/// accepts every device, as does a list that does not parse.
std::string check_device(int major, int minor, std::string_view list, const std::string& device);

}  // namespace kvret::cuda_arch
