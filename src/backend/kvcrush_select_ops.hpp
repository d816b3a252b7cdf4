#pragma once
// KVCrush's representatives on the CUDA backend's device (docs/kvcrush.md, docs/cuda_backend.md), as per-element
// functors for Thrust passes: compiled for the device by nvcc and for the host on Thrust's OpenMP system. The
// decisions are kernels/math/kvcrush_math.h's, the functions KvCrushLayer (src/engine/kvcrush_layer.cpp) calls, so
// the device's row equals add_representatives' bit for bit.
//
// After the important part of each select is in the caller's tensors (n_important ascending positions per head, and
// their scores), for a batch of jobs (CrushJob: each its own middle of m tokens [mid_begin, mid_begin + m) and
// buckets), n_kv_heads heads per job, each job's rows padded to the batch's widest middle W and most buckets B:
//   CrushOrderKeys     per (job, middle entry) its (distance to the alternating anchor, position) key, from the
//                      device copy of the signatures; a padded entry's key is the largest, so it sorts last
//   (sort of the keys with their entry index, then a stable sort by the index's job: each job's middle in the
//   grouping's order, the same for every head, its padding after it)
//   CrushClear         per (job, head, offset): the flags zeroed
//   CrushMarkImportant per (job, head, row entry): the important flag and score of its middle offset
//   CrushBuckets       per (job, head, bucket): the first entry of the bucket whose token is not important, or none
//   CrushMissing       per (job, head): the buckets without one
//   CrushFree          per (job, head, order entry): free after the buckets' pass (neither important nor chosen)
//   (exclusive scan per (job, head): the free entries before each one)
//   CrushChoose        per (job, head, order entry): a representative (its bucket's, or a fill of a missing
//                      bucket's place), flagged at its middle offset
//   (exclusive scans per (job, head) over the middle offsets: the important tokens and the representatives below)
//   CrushWrite         per (job, head, middle offset): its merged slot and score into the job's tensors
// A job whose buckets are 0 (no representative, or no candidate: n_important >= m) is left as it is; padded
// entries (offsets past a job's m, buckets past its own) take part in nothing.
#include <cstddef>
#include <cstdint>

#include "backend/device_math.hpp"
#include "math/kvcrush_math.h"

namespace kvret::device_math {

namespace km = kvret::cuda::math;

/// One select of a fused KVCrush pass.
struct CrushJob {
  const uint64_t* bits;  ///< the device copy of the layer's signatures, [tokens, words]
  DeviceTensor out;      ///< i32 [n_kv_heads, >= the merged count]: the important rows, then the merged rows
  DeviceTensor scores;   ///< f32 (base null: none)
  int64_t m, mid_begin;  ///< the middle
  int64_t buckets;       ///< kvcrush_bucket_count; 0: the job adds nothing
  int32_t words, heads;  ///< the signatures' words per token and bits
};

/// The addressing of a fused pass: `heads` KV heads per job, rows of `width` offsets, `buckets` buckets per row.
struct CrushShape {
  int64_t heads, width, buckets;
  KVRET_BACKEND_HD int64_t job_of_row(int64_t row) const { return row / heads; }
};

struct CrushOrderKeys {
  const CrushJob* jobs;
  uint64_t* keys;  ///< [jobs, width]
  int64_t* index;  ///< [jobs, width]: the entry's own index (carried through the sort)
  int64_t width;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const CrushJob& c = jobs[i / width];
    const int64_t k = i % width, t = c.mid_begin + k;
    keys[i] = k < c.m
                  ? km::kvcrush_order_key(km::kvcrush_alternating_distance(c.bits + t * c.words, c.words, c.heads), t)
                  : ~uint64_t{0};
    index[i] = i;
  }
};

/// Zeroes the per-(job, head, offset) flags.
struct CrushClear {
  int64_t* important;  ///< [jobs * heads, width] by middle offset
  int64_t* chosen;     ///< [jobs * heads, width] by order entry
  int64_t* rep;        ///< [jobs * heads, width] by middle offset
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    important[i] = 0;
    chosen[i] = 0;
    rep[i] = 0;
  }
};

struct CrushMarkImportant {
  const CrushJob* jobs;
  int64_t* important;  ///< [jobs * heads, width] by middle offset
  float* score;        ///< [jobs * heads, width] by middle offset
  CrushShape shape;
  int64_t n_important;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / n_important, j = i % n_important;
    const CrushJob& c = jobs[shape.job_of_row(row)];
    if (c.buckets == 0) return;
    const int64_t h = row % shape.heads;
    const int64_t off = *reinterpret_cast<const int32_t*>(c.out.at(h, j)) - c.mid_begin;
    important[row * shape.width + off] = 1;
    if (c.scores.base != nullptr) score[row * shape.width + off] = *reinterpret_cast<const float*>(c.scores.at(h, j));
  }
};

struct CrushBuckets {
  const CrushJob* jobs;
  const uint64_t* keys;      ///< [jobs, width], each job's sorted
  const int64_t* important;  ///< by middle offset
  int64_t* chosen;           ///< by order entry
  int64_t* none;             ///< [jobs * heads, buckets]
  CrushShape shape;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / shape.buckets, b = i % shape.buckets, job = shape.job_of_row(row);
    const CrushJob& c = jobs[job];
    none[i] = 0;
    if (b >= c.buckets) return;
    const int64_t lo = km::kvcrush_bucket_begin(b, c.m, c.buckets),
                  hi = km::kvcrush_bucket_begin(b + 1, c.m, c.buckets);
    const int64_t* imp = important + row * shape.width;
    const uint64_t* order = keys + job * shape.width;
    const int64_t e = km::kvcrush_take_first(
        lo, hi, [&](int64_t k) { return imp[km::kvcrush_key_position(order[k]) - c.mid_begin] == 0; });
    if (e < hi) chosen[row * shape.width + e] = 1;
    none[i] = e < hi ? 0 : 1;
  }
};

struct CrushMissing {
  const int64_t* none;  ///< [jobs * heads, buckets]
  int64_t* missing;     ///< [jobs * heads]
  int64_t buckets;
  KVRET_BACKEND_HD void operator()(int64_t row) const {
    int64_t n = 0;
    for (int64_t b = 0; b < buckets; ++b) n += none[row * buckets + b];
    missing[row] = n;
  }
};

struct CrushFree {
  const CrushJob* jobs;
  const uint64_t* keys;
  const int64_t* important;  ///< by middle offset
  const int64_t* chosen;     ///< by order entry
  int64_t* is_free;          ///< [jobs * heads, width] by order entry
  CrushShape shape;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / shape.width, k = i % shape.width, job = shape.job_of_row(row);
    const CrushJob& c = jobs[job];
    is_free[i] =
        c.buckets > 0 && k < c.m &&
                important[row * shape.width + km::kvcrush_key_position(keys[job * shape.width + k]) - c.mid_begin] ==
                    0 &&
                chosen[i] == 0
            ? 1
            : 0;
  }
};

struct CrushChoose {
  const CrushJob* jobs;
  const uint64_t* keys;
  const int64_t* chosen;       ///< by order entry
  const int64_t* is_free;      ///< by order entry
  const int64_t* free_before;  ///< exclusive scan of free per (job, head)
  const int64_t* missing;      ///< [jobs * heads]
  int64_t* rep;                ///< [jobs * heads, width] by middle offset
  CrushShape shape;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const int64_t row = i / shape.width, k = i % shape.width, job = shape.job_of_row(row);
    const CrushJob& c = jobs[job];
    if (c.buckets == 0 || k >= c.m) return;
    const bool r = chosen[i] != 0 || (is_free[i] != 0 && km::kvcrush_fill_takes(free_before[i], missing[row]));
    rep[row * shape.width + km::kvcrush_key_position(keys[job * shape.width + k]) - c.mid_begin] = r ? 1 : 0;
  }
};

struct CrushWrite {
  const CrushJob* jobs;
  const int64_t* important;        ///< by middle offset
  const int64_t* rep;              ///< by middle offset
  const int64_t* important_below;  ///< exclusive scan of important per (job, head)
  const int64_t* rep_below;        ///< exclusive scan of rep per (job, head)
  const float* score;              ///< the important tokens' scores by middle offset
  CrushShape shape;
  KVRET_BACKEND_HD void operator()(int64_t i) const {
    const bool imp = important[i] != 0, r = rep[i] != 0;
    if (!imp && !r) return;  // a padded offset, or a job left as it is, is neither
    const int64_t row = i / shape.width, off = i % shape.width, h = row % shape.heads;
    const CrushJob& c = jobs[shape.job_of_row(row)];
    const int64_t slot = imp ? km::kvcrush_merge_slot(important_below[i], rep_below[i])
                             : km::kvcrush_merge_slot(rep_below[i], important_below[i]);
    *reinterpret_cast<int32_t*>(c.out.at(h, slot)) = static_cast<int32_t>(c.mid_begin + off);
    if (c.scores.base != nullptr)
      *reinterpret_cast<float*>(c.scores.at(h, slot)) = km::kvcrush_merged_score(r, imp ? score[i] : 0.0f);
  }
};

}  // namespace kvret::device_math
