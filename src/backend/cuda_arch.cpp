// Which CUDA devices a build runs on (see cuda_arch.hpp).
#include "backend/cuda_arch.hpp"

#include <cctype>
#include <string>

#ifndef KVRET_CUDA_ARCHS
#define KVRET_CUDA_ARCHS ""
#endif

namespace kvret::cuda_arch {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())) != 0) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())) != 0) s.remove_suffix(1);
  return s;
}

bool parse_entry(std::string_view s, ArchEntry& e) {
  e = ArchEntry{};
  e.sass = e.ptx = true;
  constexpr std::string_view kReal = "-real", kVirtual = "-virtual";
  if (s.size() > kReal.size() && s.substr(s.size() - kReal.size()) == kReal) {
    e.ptx = false;
    s.remove_suffix(kReal.size());
  } else if (s.size() > kVirtual.size() && s.substr(s.size() - kVirtual.size()) == kVirtual) {
    e.sass = false;
    s.remove_suffix(kVirtual.size());
  }
  if (!s.empty() && (s.back() == 'a' || s.back() == 'f')) {
    e.variant = s.back();
    s.remove_suffix(1);
  }
  if (s.size() < 2 || s.size() > 3) return false;  // 2 or 3 digits: 75 .. 121
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
    e.arch = e.arch * 10 + (c - '0');
  }
  return e.arch >= 10;
}

bool sass_runs(const ArchEntry& e, int major, int minor) {
  if (major != e.arch / 10) return false;
  return e.variant == 'a' ? minor == e.arch % 10 : minor >= e.arch % 10;
}

bool ptx_runs(const ArchEntry& e, int major, int minor) {
  if (e.variant == 'a') return major == e.arch / 10 && minor == e.arch % 10;
  if (e.variant == 'f') return major == e.arch / 10 && minor >= e.arch % 10;
  return major * 10 + minor >= e.arch;
}

std::string arch_name(const ArchEntry& e) {
  std::string name = std::to_string(e.arch);
  if (e.variant != 0) name += e.variant;
  return name;
}

}  // namespace

bool parse_arch_list(std::string_view list, std::vector<ArchEntry>& out) {
  out.clear();
  while (!list.empty()) {
    const size_t end = list.find_first_of(";,");
    const std::string_view item = trim(list.substr(0, end));
    list = end == std::string_view::npos ? std::string_view{} : list.substr(end + 1);
    if (item.empty()) continue;
    ArchEntry e;
    if (!parse_entry(item, e)) return false;
    out.push_back(e);
  }
  return true;
}

DeviceFit device_fit(int major, int minor, const std::vector<ArchEntry>& entries) {
  DeviceFit fit = DeviceFit::kNone;
  for (const ArchEntry& e : entries) {
    if (e.sass && sass_runs(e, major, minor)) return DeviceFit::kSass;
    if (e.ptx && ptx_runs(e, major, minor)) fit = DeviceFit::kPtx;
  }
  return fit;
}

std::string describe(const std::vector<ArchEntry>& entries) {
  std::string sass, ptx;
  for (const ArchEntry& e : entries) {
    if (e.sass) sass += (sass.empty() ? "sm_" : ", sm_") + arch_name(e);
    if (e.ptx) ptx += (ptx.empty() ? "compute_" : ", compute_") + arch_name(e);
  }
  if (sass.empty()) return ptx.empty() ? std::string("no architecture") : "PTX for " + ptx;
  return ptx.empty() ? sass : sass + " and PTX for " + ptx;
}

const char* built_arch_list() noexcept { return KVRET_CUDA_ARCHS; }

std::string check_device(int major, int minor, std::string_view list, const std::string& device) {
  std::vector<ArchEntry> entries;
  if (!parse_arch_list(list, entries) || entries.empty()) return {};
  if (device_fit(major, minor, entries) != DeviceFit::kNone) return {};
  const std::string sm = std::to_string(major) + std::to_string(minor);
  return device + " is sm_" + sm + " (compute capability " + std::to_string(major) + "." + std::to_string(minor) +
         "); this build of kvret has code for " + describe(entries) +
         ", none of which runs on it (real code runs on its own major version with an equal or higher minor, PTX on "
         "its compute capability and newer): build kvret with CMAKE_CUDA_ARCHITECTURES including " +
         sm;
}

}  // namespace kvret::cuda_arch
