// The CUDA backend's kvret_attend (through the C API) against the CPU backend's reference attention, on a GPU:
// contiguous, 16-byte aligned K/V of a supported head_dim take the tuned decode-attention kernel; strided or
// misaligned ones take the reference passes. Both must give the CPU's output within float rounding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gpu_test_util.h"
#include "kvret.h"

namespace kvret::cuda::testing {
namespace {

struct AttendCase {
  int32_t q_heads, kv_heads, head_dim;
  int64_t rows, capacity;  // rows attended; rows stored per head (capacity >= rows)
  int64_t pad;             // extra elements between heads (0: contiguous; > 0: a strided k/v)
  size_t misalign;         // bytes k and v are moved off 16-byte alignment (0 or a multiple of the element size)
};

kvret_context* make_context(int32_t device_type, const AttendCase& c) {
  kvret_config config;
  EXPECT_EQ(kvret_config_init(&config), KVRET_OK);
  config.n_layers = 1;
  config.n_q_heads = c.q_heads;
  config.n_kv_heads = c.kv_heads;
  config.head_dim = c.head_dim;
  config.device_type = device_type;
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&config, &ctx), KVRET_OK) << kvret_last_error();
  return ctx;
}

template <typename T>
kvret_dtype dtype_of() {
  if constexpr (std::is_same_v<T, __half>) return {KVRET_DTYPE_FLOAT, 16, 1};
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return {KVRET_DTYPE_BFLOAT, 16, 1};
  return {KVRET_DTYPE_FLOAT, 32, 1};
}

/// out of kvret_attend on a context of `device_type`, with q, k, v and out in that backend's memory.
template <typename T>
std::vector<float> attend(int32_t device_type, const AttendCase& c, const std::vector<float>& q,
                          const std::vector<T>& kv_k, const std::vector<T>& kv_v) {
  kvret_context* ctx = make_context(device_type, c);
  if (ctx == nullptr) return {};
  const bool gpu = device_type == KVRET_DEVICE_CUDA;
  const kvret_device where = gpu ? kvret_device{KVRET_DEVICE_CUDA, 0} : kvret_device{KVRET_DEVICE_CPU, 0};
  const size_t kv_bytes = kv_k.size() * sizeof(T) + 16;
  std::vector<std::byte> host_k(kv_bytes), host_v(kv_bytes);
  DeviceBuffer<std::byte> dev_k(kv_bytes), dev_v(kv_bytes);
  DeviceBuffer<float> dev_q(q.size()), dev_out(q.size());
  std::byte* k_base = (gpu ? dev_k.get() : host_k.data()) + c.misalign;
  std::byte* v_base = (gpu ? dev_v.get() : host_v.data()) + c.misalign;
  if (gpu) {
    KVRET_CUDA_CHECK(cudaMemcpy(k_base, kv_k.data(), kv_k.size() * sizeof(T), cudaMemcpyHostToDevice));
    KVRET_CUDA_CHECK(cudaMemcpy(v_base, kv_v.data(), kv_v.size() * sizeof(T), cudaMemcpyHostToDevice));
    dev_q.upload(q);
  } else {
    std::memcpy(k_base, kv_k.data(), kv_k.size() * sizeof(T));
    std::memcpy(v_base, kv_v.data(), kv_v.size() * sizeof(T));
  }
  std::vector<float> host_out(q.size(), -1.0f);
  const int64_t q_shape[2] = {c.q_heads, c.head_dim};
  const int64_t kv_shape[3] = {c.kv_heads, c.capacity, c.head_dim};
  const int64_t kv_strides[3] = {c.capacity * c.head_dim + c.pad, c.head_dim, 1};
  const kvret_tensor tq{gpu ? static_cast<void*>(dev_q.get()) : const_cast<float*>(q.data()),
                        where,
                        2,
                        {KVRET_DTYPE_FLOAT, 32, 1},
                        q_shape,
                        nullptr,
                        0};
  const kvret_tensor tk{k_base, where, 3, dtype_of<T>(), kv_shape, kv_strides, 0};
  const kvret_tensor tv{v_base, where, 3, dtype_of<T>(), kv_shape, kv_strides, 0};
  const kvret_tensor tout{gpu ? static_cast<void*>(dev_out.get()) : host_out.data(),
                          where,
                          2,
                          {KVRET_DTYPE_FLOAT, 32, 1},
                          q_shape,
                          nullptr,
                          0};
  EXPECT_EQ(kvret_attend(ctx, &tq, &tk, &tv, c.rows, 0.0f, &tout, nullptr), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(kvret_synchronize(ctx, nullptr), KVRET_OK) << kvret_last_error();
  if (gpu) host_out = dev_out.download();
  EXPECT_EQ(kvret_destroy(ctx), KVRET_OK);
  return host_out;
}

template <typename T>
void check_case(const AttendCase& c, uint64_t seed) {
  const size_t kv_elems = static_cast<size_t>(c.kv_heads) * static_cast<size_t>(c.capacity * c.head_dim + c.pad);
  const std::vector<float> q = random_normal<float>(static_cast<size_t>(c.q_heads) * c.head_dim, seed);
  const std::vector<T> k = random_normal<T>(kv_elems, seed + 1);
  const std::vector<T> v = random_normal<T>(kv_elems, seed + 2);
  const std::vector<float> want = attend<T>(KVRET_DEVICE_CPU, c, q, k, v);
  const std::vector<float> got = attend<T>(KVRET_DEVICE_CUDA, c, q, k, v);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_TRUE(close(got[i], want[i], 1e-5, 1e-4)) << "element " << i << ": " << got[i] << " vs " << want[i];
}

class BackendAttention : public GpuTest {};

TEST_F(BackendAttention, TunedKernelMatchesTheCpuBackend) {
  uint64_t seed = 11;
  for (const int32_t d : {64, 128, 256})
    for (const int32_t group : {1, 4, 8}) {
      const AttendCase c{2 * group, 2, d, 1000, 1024, 0, 0};
      check_case<float>(c, seed++);
      check_case<__half>(c, seed++);
      check_case<__nv_bfloat16>(c, seed++);
    }
  check_case<__half>({8, 2, 128, 1, 32, 0, 0}, seed++);         // one row
  check_case<__half>({8, 2, 128, 70000, 70000, 0, 0}, seed++);  // many chunks
}

TEST_F(BackendAttention, StridedAndMisalignedInputsTakeTheReferencePasses) {
  uint64_t seed = 101;
  check_case<__half>({8, 2, 128, 500, 512, 8, 0}, seed++);  // a gap between heads
  check_case<__half>({8, 2, 128, 500, 512, 0, 2}, seed++);  // k and v off 16-byte alignment
  check_case<float>({8, 2, 128, 500, 512, 0, 4}, seed++);
  check_case<float>({34, 2, 64, 300, 300, 0, 0}, seed++);  // a group of 17: more than the kernel takes
}

}  // namespace
}  // namespace kvret::cuda::testing
