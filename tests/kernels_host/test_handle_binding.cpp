// The cuBLAS handle binding of launch_kmeans (kernels/math/handle_binding.h) with a fake library: the caller's
// stream and pointer mode come back on every exit path.
#include <gtest/gtest.h>

#include "math/handle_binding.h"

namespace {

struct FakeHandle {
  int stream = 7;  // the caller's settings
  int mode = 1;
  int fail_at = -1;  // the call number that fails (0-based), -1: none
  int calls = 0;
};

struct FakeApi {
  using Handle = FakeHandle*;
  using Stream = int;
  using Mode = int;
  using Status = int;
  static constexpr Status kSuccess = 0;
  static Status step(Handle h) { return h->calls++ == h->fail_at ? 13 : 0; }
  static Status get_stream(Handle h, Stream* s) {
    if (step(h) != 0) return 13;
    *s = h->stream;
    return 0;
  }
  static Status set_stream(Handle h, Stream s) {
    if (step(h) != 0) return 13;
    h->stream = s;
    return 0;
  }
  static Status get_mode(Handle h, Mode* m) {
    if (step(h) != 0) return 13;
    *m = h->mode;
    return 0;
  }
  static Status set_mode(Handle h, Mode m) {
    if (step(h) != 0) return 13;
    h->mode = m;
    return 0;
  }
};

using Binding = kvret::cuda::math::ScopedHandleBinding<FakeApi>;

/// A launcher shaped like launch_kmeans: binds, then leaves early (a failed launch) or runs to the end.
int launcher(FakeHandle* h, bool fail_midway, bool* was_bound) {
  Binding binding(h);
  const int s = binding.bind(42, 0);
  if (s != 0) return s;
  *was_bound = h->stream == 42 && h->mode == 0;
  if (fail_midway) return 99;  // an early return: the destructor restores
  return binding.restore();
}

TEST(HandleBinding, RestoresOnEveryExitPath) {
  for (bool fail : {false, true}) {
    FakeHandle h;
    bool bound = false;
    EXPECT_EQ(launcher(&h, fail, &bound), fail ? 99 : 0);
    EXPECT_TRUE(bound);
    EXPECT_EQ(h.stream, 7);
    EXPECT_EQ(h.mode, 1);
  }
}

TEST(HandleBinding, FailedBindLeavesTheHandleAsItWas) {
  // calls: 0 get_stream, 1 get_mode, 2 set_stream, 3 set_mode
  for (int fail_at = 0; fail_at < 4; ++fail_at) {
    FakeHandle h;
    h.fail_at = fail_at;
    bool bound = false;
    EXPECT_EQ(launcher(&h, false, &bound), 13) << fail_at;
    EXPECT_FALSE(bound);
    EXPECT_EQ(h.stream, 7) << fail_at;
    EXPECT_EQ(h.mode, 1) << fail_at;
  }
}

TEST(HandleBinding, RestoreReportsItsOwnFailure) {
  FakeHandle h;
  Binding binding(&h);
  ASSERT_EQ(binding.bind(42, 0), 0);
  h.fail_at = h.calls;  // the first restore call (set_mode) fails; the stream is still given back
  EXPECT_EQ(binding.restore(), 13);
  EXPECT_EQ(h.stream, 7);
  EXPECT_EQ(binding.restore(), 0);  // nothing left to restore
}

}  // namespace
