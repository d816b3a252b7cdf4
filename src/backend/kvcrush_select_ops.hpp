#pragma once
// KVCrush's representatives on the CUDA backend's device (docs/kvcrush.md, docs/cuda_backend.md), as per-element
// functors for Thrust passes: compiled for the device by nvcc and for the host on Thrust's OpenMP system. The
// decisions are kernels/math/kvcrush_math.h's, the functions KvCrushLayer (src/engine/kvcrush_layer.cpp) calls, so
// the device's row equals add_representatives' bit for bit.
//
// After the important part of a select is in the caller's tensors (n_important ascending positions per head, and
// their scores), over the m middle tokens [mid_begin, mid_end), n_kv_heads heads, `buckets` buckets:
//   CrushOrderKeys     per middle token its (distance to the alternating anchor, position) key, from the device copy
//                      of the signatures
//   (sort of the keys: the middle in the grouping's order, the same for every head)
//   CrushMarkImportant per (head, row entry): the important flag and score of its middle offset
//   CrushBuckets       per (head, bucket): the first entry of the bucket whose token is not important, or none
//   CrushMissing       per head: the buckets without one
//   CrushFree          per (head, order entry): free after the buckets' pass (neither important nor chosen)
//   (exclusive scan per head: the free entries before each one)
//   CrushChoose        per (head, order entry): a representative (its bucket's, or a fill of a missing bucket's
//                      place), flagged at its middle offset
//   (exclusive scans per head over the middle offsets: the important tokens and the representatives below each)
//   CrushWrite         per (head, middle offset): its merged slot and score into the caller's tensors
#include <cstddef>
#include <cstdint>

#include "backend/device_math.hpp"
#include "math/kvcrush_math.h"

namespace kvret::device_math {

namespace km = kvret::cuda::math;

struct CrushOrderKeys {
  const uint64_t* bits;  ///< the signatures, [tokens, words]
  uint64_t* keys;        ///< [m]
  int64_t mid_begin;
  int32_t words, heads;
  KVRET_BACKEND_HD void operator()(int64_t k) const {
    const int64_t t = mid_begin + k;
    keys[k] = km::kvcrush_order_key(km::kvcrush_alternating_distance(bits + t * words, words, heads), t);
  }
};

/// Zeroes the per-(head, offset) arrays.
struct CrushClear {
  int64_t* important;  ///< [heads, m]
  int64_t* chosen;     ///< [heads, m] (by order entry)
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    important[i] = 0;
    chosen[i] = 0;
  }
};

struct CrushMarkImportant {
  DeviceTensor out;     ///< i32 [n_kv_heads, >= n_important]: the important rows
  DeviceTensor scores;  ///< f32, base null: none
  int64_t* important;   ///< [heads, m] by middle offset
  float* score;         ///< [heads, m] by middle offset
  int64_t n_important, m, mid_begin;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / n_important, j = i % n_important;
    const int64_t off = *reinterpret_cast<const int32_t*>(out.at(h, j)) - mid_begin;
    important[h * m + off] = 1;
    if (scores.base != nullptr) score[h * m + off] = *reinterpret_cast<const float*>(scores.at(h, j));
  }
};

struct CrushBuckets {
  const uint64_t* keys;      ///< [m], sorted
  const int64_t* important;  ///< [heads, m] by middle offset
  int64_t* chosen;           ///< [heads, m] by order entry
  int64_t* none;             ///< [heads, buckets]
  int64_t m, buckets, mid_begin;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / buckets, b = i % buckets;
    const int64_t lo = km::kvcrush_bucket_begin(b, m, buckets), hi = km::kvcrush_bucket_begin(b + 1, m, buckets);
    const int64_t* imp = important + h * m;
    const int64_t e = km::kvcrush_take_first(
        lo, hi, [&](int64_t k) { return imp[km::kvcrush_key_position(keys[k]) - mid_begin] == 0; });
    if (e < hi) chosen[h * m + e] = 1;
    none[i] = e < hi ? 0 : 1;
  }
};

struct CrushMissing {
  const int64_t* none;  ///< [heads, buckets]
  int64_t* missing;     ///< [heads]
  int64_t buckets;
  KVRET_BACKEND_HD void operator()(int64_t h) const {
    int64_t n = 0;
    for (int64_t b = 0; b < buckets; ++b) n += none[h * buckets + b];
    missing[h] = n;
  }
};

struct CrushFree {
  const uint64_t* keys;
  const int64_t* important;  ///< by middle offset
  const int64_t* chosen;     ///< by order entry
  int64_t* is_free;          ///< [heads, m] by order entry
  int64_t m, mid_begin;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / m, k = i % m;
    is_free[i] = important[h * m + km::kvcrush_key_position(keys[k]) - mid_begin] == 0 && chosen[i] == 0 ? 1 : 0;
  }
};

struct CrushChoose {
  const uint64_t* keys;
  const int64_t* chosen;       ///< by order entry
  const int64_t* is_free;      ///< by order entry
  const int64_t* free_before;  ///< exclusive scan of free per head
  const int64_t* missing;      ///< [heads]
  int64_t* rep;                ///< [heads, m] by middle offset
  int64_t m, mid_begin;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t h = i / m, k = i % m;
    const bool r = chosen[i] != 0 || (is_free[i] != 0 && km::kvcrush_fill_takes(free_before[i], missing[h]));
    rep[h * m + km::kvcrush_key_position(keys[k]) - mid_begin] = r ? 1 : 0;
  }
};

struct CrushWrite {
  const int64_t* important;        ///< by middle offset
  const int64_t* rep;              ///< by middle offset
  const int64_t* important_below;  ///< exclusive scan of important per head
  const int64_t* rep_below;        ///< exclusive scan of rep per head
  const float* score;              ///< the important tokens' scores by middle offset
  DeviceTensor out;                ///< i32 [n_kv_heads, >= count]
  DeviceTensor scores;             ///< f32 (base null: none)
  int64_t m, mid_begin;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const bool imp = important[i] != 0, r = rep[i] != 0;
    if (!imp && !r) return;
    const int64_t h = i / m, off = i % m;
    const int64_t slot = imp ? km::kvcrush_merge_slot(important_below[i], rep_below[i])
                             : km::kvcrush_merge_slot(rep_below[i], important_below[i]);
    *reinterpret_cast<int32_t*>(out.at(h, slot)) = static_cast<int32_t>(mid_begin + off);
    if (scores.base != nullptr)
      *reinterpret_cast<float*>(scores.at(h, slot)) = km::kvcrush_merged_score(r, imp ? score[i] : 0.0f);
  }
};

}  // namespace kvret::device_math
