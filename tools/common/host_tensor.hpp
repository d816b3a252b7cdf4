#pragma once
// A kvret_tensor over host memory, owning its shape: the tensor descriptor the benchmarks, the soak and the fuzzer
// pass to the C ABI.
#include <cstdint>
#include <utility>
#include <vector>

#include "kvret.h"

namespace kvret::tools {

struct HostTensor {
  std::vector<int64_t> shape;
  kvret_tensor t{};
  HostTensor(void* data, std::vector<int64_t> s, kvret_dtype dtype) : shape(std::move(s)) {
    t.data = data;
    t.device = {KVRET_DEVICE_CPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
  }
};

constexpr kvret_dtype kF32{KVRET_DTYPE_FLOAT, 32, 1};
constexpr kvret_dtype kF16{KVRET_DTYPE_FLOAT, 16, 1};
constexpr kvret_dtype kI32{KVRET_DTYPE_INT, 32, 1};

}  // namespace kvret::tools
