#pragma once
// Decode attention over a working set, on the CPU: the body of kvret_attend and of kvret_seq_attend.
//
// Each KV head's rows are cut into spans (attend_span_rows: a function of `rows` alone) and every (KV head, span)
// is one work item of an OpenMP loop, so that one KV head still keeps every thread busy. A work item reads each key
// and value row of its span once for all the query heads of the group, kAttendBlockRows rows at a time: the block's
// scores (f16/bf16 converted to f32 in registers), then an online softmax (running maximum, running sum, the
// accumulator rescaled when the maximum grows), then the weighted value rows. The spans' partial results are merged
// per query head in span order, in double. Every SIMD path (scalar, AVX2, AVX-512F; KVRET_MAX_CPU_ISA caps the
// choice) computes the same products and sums in the same order without FMA, and the spans do not depend on the
// thread count: the output's bits are the same on every path and for every n_threads. Nothing is allocated in
// proportion to the rows: a per-thread scratch of O(group * (head_dim + kAttendBlockRows)) floats and the partial
// results, at most kAttendMaxSpans per query head.
//
// Non-finite inputs: a row whose score is -inf gets weight 0; a head whose every score is -inf, or one of whose
// scores is NaN or +inf (a NaN or infinite element of q or of a key row, or a dot product that overflows), gets NaN
// for all its elements (a NaN or infinite key element does this to every head of its group). A NaN or infinite
// value element makes that element of the output of every head of its group NaN or infinite, whatever the row's
// weight.
#include <cstdint>

#include "core/tensor_view.hpp"
#include "kvret.h"
#include "math/attend_math.h"

namespace kvret {

/// The SIMD paths of attend, narrowest first.
enum class AttendIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

/// The widest path this CPU (AVX2 with F16C, AVX-512F) and KVRET_MAX_CPU_ISA allow.
AttendIsa attend_isa() noexcept;

/// Rows per block of a work item: the scores of one block for the whole group are kept in the scratch; the fewest
/// rows of a span, and the most spans of one KV head (kernels/math/attend_math.h, the arithmetic's single source).
constexpr int64_t kAttendBlockRows = cuda::math::kAttendBlockRows;
constexpr int64_t kAttendMinSpanRows = cuda::math::kAttendMinSpanRows;
constexpr int64_t kAttendMaxSpans = cuda::math::kAttendMaxSpans;

/// The rows of each span of a KV head for `rows` rows (the last span may be shorter): a multiple of
/// kAttendBlockRows, at least kAttendMinSpanRows, and large enough for at most kAttendMaxSpans spans.
int64_t attend_span_rows(int64_t rows) noexcept;

/// attend's argument checks alone (KVRET_ERR_SHAPE, KVRET_ERR_INVALID_ARGUMENT), for every backend's attention.
void check_attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v,
                  int64_t rows, float scale, const TensorView& out);
/// The softmax scale attend uses: `scale`, or 1/sqrt(head_dim) when scale <= 0.
float attend_scale(const kvret_config& config, float scale) noexcept;

/// out[h] = softmax(s * q[h] . k[g(h)]^T) v[g(h)] over the first `rows` rows, g(h) = h / (n_q_heads / n_kv_heads),
/// s = scale, or 1/sqrt(head_dim) when scale <= 0. q: [n_q_heads, head_dim]; k, v: [n_kv_heads, >= rows,
/// head_dim] (each f16, bf16 or f32); out: [n_q_heads, head_dim], f32, or f16 / bf16 (the f32 result rounded to
/// nearest even). Checks every shape against `config` first (KVRET_ERR_SHAPE, KVRET_ERR_INVALID_ARGUMENT for
/// rows < 1 or a non-finite scale); writes only out. Runs on up to n_threads threads (<= 0: OpenMP's default) on
/// the widest path attend_isa() allows.
void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
            float scale, const TensorView& out, int n_threads);
/// attend on the path `isa` (narrowed to attend_isa()): the same bits as every other path.
void attend(const kvret_config& config, const TensorView& q, const TensorView& k, const TensorView& v, int64_t rows,
            float scale, const TensorView& out, int n_threads, AttendIsa isa);

/// One KV head's attention over `rows` contiguous rows (k and v: row r at element r * head_dim, of dtype tk / tv)
/// for its `group` query heads q [group, d] (f32, scale as given), left unnormalised: attend's spans and merge on the
/// calling thread, for quantized attention's exact rows. Per query head j: max[j] the largest score (double; -inf
/// for rows = 0), total[j] the softmax's normaliser and sum [j * d, +d) the weighted values, both relative to
/// max[j], and nan[j] where attend writes NaN (a NaN score). attend's output is sum / total.
void attend_head(const float* q, int group, int d, float scale, const std::byte* k, DType tk, const std::byte* v,
                 DType tv, int64_t rows, AttendIsa isa, double* max, double* total, double* sum, bool* nan);

}  // namespace kvret
