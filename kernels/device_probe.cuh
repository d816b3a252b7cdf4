#pragma once

namespace kvret::cuda {
/// Number of CUDA devices visible to this process; 0 when there is none or no driver.
int device_count() noexcept;
}  // namespace kvret::cuda
