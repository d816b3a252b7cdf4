#pragma once
// OpenMP loops that an exception cannot take down. An exception leaving an OpenMP region makes the runtime call
// std::terminate (a failed allocation would abort the host process), so parallel_for catches each iteration's
// exception inside the region, skips the iterations not yet started, and rethrows the first one after the region:
// the caller sees std::bad_alloc, and the C layer returns KVRET_ERR_OUT_OF_MEMORY.
// Built without OpenMP (KVRET_OPENMP=OFF, the ThreadSanitizer build), every loop runs in order on the calling thread.
#ifdef _OPENMP
#include <omp.h>
#endif

#include <atomic>
#include <cstdint>
#include <exception>

namespace kvret {

enum class Schedule { kStatic, kDynamic };

/// OpenMP's default thread count (omp_get_max_threads); 1 in a build without OpenMP.
inline int default_threads() noexcept {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/// body(i) for i in [0, n), on up to n_threads OpenMP threads (<= 0: OpenMP's default) when `parallel` holds and
/// more than one thread and iteration are asked for, else in order on the calling thread, outside any region.
template <class Body>
void parallel_for(int64_t n, int n_threads, bool parallel, Schedule schedule, Body&& body) {
  const int threads = n_threads > 0 ? n_threads : default_threads();
  if (!parallel || threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
#ifdef _OPENMP
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto run = [&](int64_t i) noexcept {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
#pragma omp critical(kvret_parallel_for_error)
      {
        if (!error) error = std::current_exception();
      }
      failed.store(true, std::memory_order_relaxed);
    }
  };
  if (schedule == Schedule::kDynamic) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) run(i);
  } else {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) run(i);
  }
  if (error) std::rethrow_exception(error);
#else
  (void)schedule;
  for (int64_t i = 0; i < n; ++i) body(i);
#endif
}

}  // namespace kvret
