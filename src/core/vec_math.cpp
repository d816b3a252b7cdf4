#include "core/vec_math.hpp"

#include <omp.h>

namespace kvret {

int resolve_threads(int32_t n_threads) noexcept { return n_threads > 0 ? n_threads : omp_get_max_threads(); }

}  // namespace kvret
