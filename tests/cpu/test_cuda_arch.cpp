// kvret_create's device check on a CUDA context (backend/cuda_arch.hpp): which compute capabilities a list of
// CMAKE_CUDA_ARCHITECTURES runs on, and the message that refuses the others. Pure host logic: no GPU needed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda_arch.hpp"

using namespace kvret::cuda_arch;

namespace {

constexpr const char* kDefault = "80-real,89-real,90-real,100";  // CMakeLists.txt's default, as passed to the code

std::vector<ArchEntry> parse(const std::string& list) {
  std::vector<ArchEntry> entries;
  EXPECT_TRUE(parse_arch_list(list, entries)) << list;
  return entries;
}

DeviceFit fit(const std::string& list, int major, int minor) { return device_fit(major, minor, parse(list)); }

TEST(CudaArch, ParsesCMakeEntries) {
  const auto e = parse("80-real;89-real, 90a-real;100;120-virtual,100f");
  ASSERT_EQ(e.size(), 6u);
  EXPECT_EQ(e[0].arch, 80);
  EXPECT_TRUE(e[0].sass);
  EXPECT_FALSE(e[0].ptx);
  EXPECT_EQ(e[1].arch, 89);
  EXPECT_EQ(e[2].arch, 90);
  EXPECT_EQ(e[2].variant, 'a');
  EXPECT_EQ(e[3].arch, 100);
  EXPECT_TRUE(e[3].sass);
  EXPECT_TRUE(e[3].ptx);
  EXPECT_EQ(e[3].variant, 0);
  EXPECT_EQ(e[4].arch, 120);
  EXPECT_FALSE(e[4].sass);
  EXPECT_TRUE(e[4].ptx);
  EXPECT_EQ(e[5].variant, 'f');
  std::vector<ArchEntry> none;
  EXPECT_TRUE(parse_arch_list("", none));
  EXPECT_TRUE(none.empty());
}

TEST(CudaArch, RefusesWhatIsNotAnArchitecture) {
  std::vector<ArchEntry> e;
  for (const char* bad : {"native", "all", "sm_90", "9", "1000", "90-reall", "90b", "90-", "-real", "90;x"}) {
    EXPECT_FALSE(parse_arch_list(bad, e)) << bad;
  }
}

TEST(CudaArch, DefaultBuildRunsFromAmpereOn) {
  EXPECT_EQ(fit(kDefault, 7, 5), DeviceFit::kNone);  // T4: older than every entry
  EXPECT_EQ(fit(kDefault, 7, 0), DeviceFit::kNone);
  EXPECT_EQ(fit(kDefault, 8, 0), DeviceFit::kSass);   // A100
  EXPECT_EQ(fit(kDefault, 8, 6), DeviceFit::kSass);   // A10, RTX 30: sm_80's code
  EXPECT_EQ(fit(kDefault, 8, 7), DeviceFit::kSass);   // Orin
  EXPECT_EQ(fit(kDefault, 8, 9), DeviceFit::kSass);   // L4, L40
  EXPECT_EQ(fit(kDefault, 9, 0), DeviceFit::kSass);   // H100, H200
  EXPECT_EQ(fit(kDefault, 10, 0), DeviceFit::kSass);  // B200
  EXPECT_EQ(fit(kDefault, 10, 3), DeviceFit::kSass);  // B300: sm_100's code
  EXPECT_EQ(fit(kDefault, 11, 0), DeviceFit::kPtx);   // newer: compute_100's PTX
  EXPECT_EQ(fit(kDefault, 12, 0), DeviceFit::kPtx);
  EXPECT_EQ(fit(kDefault, 12, 1), DeviceFit::kPtx);
}

TEST(CudaArch, RealCodeRunsOnlyWithinItsMajorVersion) {
  EXPECT_EQ(fit("80-real;90-real", 8, 6), DeviceFit::kSass);
  EXPECT_EQ(fit("86-real", 8, 0), DeviceFit::kNone);  // an older minor cannot run it
  EXPECT_EQ(fit("80-real;90-real", 10, 0), DeviceFit::kNone);
  EXPECT_EQ(fit("80-real;90-real", 12, 0), DeviceFit::kNone);  // no PTX: nothing for a newer major
  EXPECT_EQ(fit("90", 12, 0), DeviceFit::kPtx);                // compute_90's PTX is compiled for it
  EXPECT_EQ(fit("90", 8, 9), DeviceFit::kNone);                // PTX never runs on an older device
  EXPECT_EQ(fit("80-virtual", 8, 0), DeviceFit::kPtx);
  EXPECT_EQ(fit("80-virtual", 7, 5), DeviceFit::kNone);
}

TEST(CudaArch, ArchAndFamilySpecificCode) {
  EXPECT_EQ(fit("90a-real", 9, 0), DeviceFit::kSass);
  EXPECT_EQ(fit("90a", 10, 0), DeviceFit::kNone);  // sm_90a's PTX is not compiled for other devices
  EXPECT_EQ(fit("100a-real", 10, 3), DeviceFit::kNone);
  EXPECT_EQ(fit("100f-real", 10, 3), DeviceFit::kSass);
  EXPECT_EQ(fit("100f", 11, 0), DeviceFit::kNone);
  EXPECT_EQ(fit("100f-virtual", 10, 3), DeviceFit::kPtx);
}

TEST(CudaArch, DescribesTheBuild) {
  EXPECT_EQ(describe(parse(kDefault)), "sm_80, sm_89, sm_90, sm_100 and PTX for compute_100");
  EXPECT_EQ(describe(parse("90a-real")), "sm_90a");
  EXPECT_EQ(describe(parse("80-virtual;90-virtual")), "PTX for compute_80, compute_90");
}

TEST(CudaArch, RefusalNamesTheDeviceAndTheBuild) {
  const std::string why = check_device(7, 5, kDefault, "config.device_id 1 (Tesla T4)");
  EXPECT_NE(why.find("config.device_id 1 (Tesla T4) is sm_75 (compute capability 7.5)"), std::string::npos) << why;
  EXPECT_NE(why.find("sm_80, sm_89, sm_90, sm_100 and PTX for compute_100"), std::string::npos) << why;
  EXPECT_NE(why.find("CMAKE_CUDA_ARCHITECTURES including 75"), std::string::npos) << why;
  const std::string blackwell = check_device(12, 0, "80-real;90-real", "config.device_id 0 (RTX 5090)");
  EXPECT_NE(blackwell.find("is sm_120 (compute capability 12.0)"), std::string::npos) << blackwell;
  EXPECT_EQ(check_device(8, 6, kDefault, "d"), "");
  EXPECT_EQ(check_device(9, 0, kDefault, "d"), "");
  EXPECT_EQ(check_device(12, 0, kDefault, "d"), "");
}

TEST(CudaArch, UnknownListAcceptsEveryDevice) {
  EXPECT_EQ(check_device(7, 5, "", "d"), "");  // CMAKE_CUDA_ARCHITECTURES=OFF: nvcc's own default
  EXPECT_EQ(check_device(7, 5, "native", "d"), "");
}

TEST(CudaArch, TheBuiltListParses) {
  std::vector<ArchEntry> built;
  EXPECT_TRUE(parse_arch_list(built_arch_list(), built)) << built_arch_list();
#if !KVRET_WITH_CUDA
  EXPECT_STREQ(built_arch_list(), "");
#endif
}

}  // namespace
