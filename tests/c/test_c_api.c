/* A plain C99 program that includes only kvret.h: prefill -> select -> fetch -> attend through the public ABI,
 * with the checks a C user relies on (versions, statuses, last error, defaults, stats). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvret.h"
#ifdef KVRET_TEST_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

#include "c_check.h"

/* KVRET_TEST_DEVICE=cuda runs the program against the CUDA backend: in a build on Thrust's OpenMP host system, where
 * device memory is host memory, or, built with KVRET_TEST_CUDA_RUNTIME (target test_c_api_managed), on a GPU with
 * every tensor in managed memory (run it there with CUDA_LAUNCH_BLOCKING=1) */
static int32_t test_device = KVRET_DEVICE_CPU;

static void* tensor_alloc(size_t bytes) {
#ifdef KVRET_TEST_CUDA_RUNTIME
  if (test_device == KVRET_DEVICE_CUDA) {
    void* p = NULL;
    return cudaMallocManaged(&p, bytes, cudaMemAttachGlobal) == cudaSuccess ? p : NULL;
  }
#endif
  return malloc(bytes);
}

static void tensor_free(void* p) {
#ifdef KVRET_TEST_CUDA_RUNTIME
  if (test_device == KVRET_DEVICE_CUDA) {
    (void)cudaFree(p);
    return;
  }
#endif
  free(p);
}

static kvret_tensor f32_tensor(float* data, int ndim, const int64_t* shape) {
  kvret_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = test_device;
  t.ndim = ndim;
  t.dtype.code = KVRET_DTYPE_FLOAT;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

static kvret_tensor i32_tensor(int32_t* data, int ndim, const int64_t* shape) {
  kvret_tensor t = f32_tensor(NULL, ndim, shape);
  t.data = data;
  t.dtype.code = KVRET_DTYPE_INT;
  return t;
}

static float frand(unsigned* state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)((*state >> 8) & 0xffff) / 65536.0f - 0.5f;
}

int main(void) {
  enum { LAYERS = 2, HQ = 8, HKV = 2, D = 64, T = 2000 };
  kvret_config config;
  kvret_context* ctx = NULL;
  kvret_seq* seq = NULL;
  unsigned rng = 7;
  int layer;

  if (getenv("KVRET_TEST_DEVICE") != NULL && strcmp(getenv("KVRET_TEST_DEVICE"), "cuda") == 0)
    test_device = KVRET_DEVICE_CUDA;
  CHECK(kvret_version_number() == KVRET_VERSION_NUMBER);
  CHECK(strcmp(kvret_version_string(), KVRET_VERSION_STRING) == 0);
  CHECK(strcmp(kvret_status_string(KVRET_ERR_SHAPE), "KVRET_ERR_SHAPE") == 0);

  CHECK_OK(kvret_config_init(&config));
  CHECK(config.struct_size == sizeof config);
  CHECK(config.n_sink == 16 && config.pq_m == 4 && config.pq_bits == 6 && config.index_kind == KVRET_INDEX_PQ);
  config.n_layers = LAYERS;
  config.n_q_heads = HQ;
  config.n_kv_heads = HKV;
  config.head_dim = D;
  config.n_threads = 2;
  config.device_type = test_device;
  CHECK_OK(kvret_create(&config, &ctx));
  CHECK_OK(kvret_seq_open(ctx, &seq));

  {
    const int64_t kv_shape[3] = {T, HKV, D};
    float* k = tensor_alloc(sizeof(float) * T * HKV * D);
    float* v = tensor_alloc(sizeof(float) * T * HKV * D);
    size_t i;
    kvret_tensor kt, vt;
    for (i = 0; i < (size_t)T * HKV * D; ++i) {
      k[i] = frand(&rng);
      v[i] = frand(&rng);
    }
    kt = f32_tensor(k, 3, kv_shape);
    vt = f32_tensor(v, 3, kv_shape);
    for (layer = 0; layer < LAYERS; ++layer) CHECK_OK(kvret_append_prefill(seq, layer, &kt, &vt));
    CHECK_OK(kvret_wait_index(seq, -1));
    tensor_free(k);
    tensor_free(v);
  }

  for (layer = 0; layer < LAYERS; ++layer) {
    const int64_t q_shape[2] = {HQ, D};
    const int64_t one_shape[2] = {HKV, D};
    float* q = tensor_alloc(sizeof(float) * HQ * D);
    float* k1 = tensor_alloc(sizeof(float) * HKV * D);
    float* v1 = tensor_alloc(sizeof(float) * HKV * D);
    float* out = tensor_alloc(sizeof(float) * HQ * D);
    int32_t budget = 0, count = 0;
    int64_t length = 0, cap = 0, rows = 0;
    int h;
    kvret_tensor qt = f32_tensor(q, 2, q_shape), k1t = f32_tensor(k1, 2, one_shape), v1t = f32_tensor(v1, 2, one_shape);
    for (h = 0; h < HQ * D; ++h) q[h] = frand(&rng);
    for (h = 0; h < HKV * D; ++h) {
      k1[h] = frand(&rng);
      v1[h] = frand(&rng);
    }
    CHECK_OK(kvret_append_decode(seq, layer, &k1t, &v1t));
    CHECK_OK(kvret_seq_length(seq, layer, &length));
    CHECK(length == T + 1);
    CHECK_OK(kvret_seq_budget(seq, layer, &budget));
    CHECK(budget == 200); /* 0.1 * 2001, rounded */
    {
      const int64_t sel_shape[2] = {HKV, budget};
      int32_t* sel = tensor_alloc(sizeof(int32_t) * (size_t)HKV * (size_t)budget);
      kvret_tensor st = i32_tensor(sel, 2, sel_shape);
      CHECK_OK(kvret_select(seq, layer, &qt, KVRET_BUDGET_DEFAULT, &st, &count));
      CHECK(count == budget);
      CHECK_OK(kvret_working_set_capacity(seq, layer, KVRET_BUDGET_DEFAULT, &cap));
      CHECK(cap == 16 + budget + 64);
      {
        const int64_t ws_shape[3] = {HKV, cap, D};
        const int64_t pos_shape[2] = {HKV, cap};
        float* wk = tensor_alloc(sizeof(float) * (size_t)(HKV * cap * D));
        float* wv = tensor_alloc(sizeof(float) * (size_t)(HKV * cap * D));
        int32_t* wp = tensor_alloc(sizeof(int32_t) * (size_t)(HKV * cap));
        kvret_working_set ws;
        int64_t r;
        ws.k = f32_tensor(wk, 3, ws_shape);
        ws.v = f32_tensor(wv, 3, ws_shape);
        ws.positions = i32_tensor(wp, 2, pos_shape);
        CHECK_OK(kvret_fetch_async(seq, layer, &st, count, &ws, &rows, NULL));
        CHECK(rows == cap);
        for (r = 1; r < rows; ++r) CHECK(wp[r] > wp[r - 1]); /* position order */
        CHECK(wp[0] == 0 && wp[rows - 1] == T);              /* first sink, newest local */
        /* the newest row is the decode token we appended (stored as f16, the default kv_dtype) */
        for (h = 0; h < D; ++h) CHECK(fabsf(wk[(rows - 1) * D + h] - k1[h]) <= 1e-3f);
        {
          kvret_tensor qa = qt, oa;
          const int64_t o_shape[2] = {HQ, D};
          oa = f32_tensor(out, 2, o_shape);
          CHECK_OK(kvret_attend(ctx, &qa, &ws.k, &ws.v, rows, 0.0f, &oa, NULL));
          for (h = 0; h < HQ * D; ++h) CHECK(isfinite(out[h]) && fabsf(out[h]) < 1.0f);
        }
        if (layer == 0) { /* the batched fetch of a batch of one: the same bytes; a bad count writes nothing */
          const int64_t batch_shape[3] = {1, HKV, budget};
          const size_t n_kd = (size_t)(HKV * cap * D);
          float* bk = tensor_alloc(sizeof(float) * n_kd);
          float* bv = tensor_alloc(sizeof(float) * n_kd);
          int32_t* bp = tensor_alloc(sizeof(int32_t) * (size_t)(HKV * cap));
          kvret_tensor bt = i32_tensor(sel, 3, batch_shape);
          kvret_working_set bws;
          int64_t brows = -1;
          int32_t bad_count = count + 100000;
          memset(bk, 0, sizeof(float) * n_kd);
          bws.k = f32_tensor(bk, 3, ws_shape);
          bws.v = f32_tensor(bv, 3, ws_shape);
          bws.positions = i32_tensor(bp, 2, pos_shape);
          CHECK(kvret_fetch_batch_async(ctx, 1, &seq, layer, &bt, &bad_count, &bws, &brows, NULL) == KVRET_ERR_BUDGET);
          CHECK(strstr(kvret_last_error(), "counts[0]") != NULL);
          CHECK(brows == -1 && bk[0] == 0.0f);
          CHECK_OK(kvret_fetch_batch_async(ctx, 1, &seq, layer, &bt, &count, &bws, &brows, NULL));
          CHECK(brows == rows);
          CHECK(memcmp(bk, wk, sizeof(float) * n_kd) == 0 && memcmp(bv, wv, sizeof(float) * n_kd) == 0);
          CHECK(memcmp(bp, wp, sizeof(int32_t) * (size_t)(HKV * cap)) == 0);
          tensor_free(bk);
          tensor_free(bv);
          tensor_free(bp);
        }
        tensor_free(wk);
        tensor_free(wv);
        tensor_free(wp);
      }
      /* bad input: a specific status and a message, nothing changed */
      CHECK(kvret_select(seq, layer, &qt, 0, &st, &count) == KVRET_ERR_BUDGET);
      CHECK(strlen(kvret_last_error()) > 0);
      CHECK(kvret_select(seq, LAYERS, &qt, 10, &st, &count) == KVRET_ERR_OUT_OF_RANGE);
      CHECK(kvret_select(NULL, layer, &qt, 10, &st, &count) == KVRET_ERR_INVALID_HANDLE);
      CHECK_OK(kvret_seq_length(seq, layer, &length));
      CHECK(length == T + 1);
      tensor_free(sel);
    }
    tensor_free(q);
    tensor_free(k1);
    tensor_free(v1);
    tensor_free(out);
  }

  {
    kvret_stats stats;
    CHECK_OK(kvret_stats_init(&stats));
    CHECK_OK(kvret_seq_stats(seq, &stats));
    CHECK(stats.tokens_stored == LAYERS * (T + 1));
    CHECK(stats.index_builds == LAYERS);
    CHECK(stats.selections == LAYERS);
    CHECK(stats.fetches == LAYERS + 1); /* one per layer, and layer 0's batched fetch */
    CHECK(stats.host_bytes > 0 && stats.index_bytes > 0);
    /* the CUDA backend's block cache holds the fetched layers' blocks in device memory */
    CHECK(test_device == KVRET_DEVICE_CPU ? stats.device_bytes == 0 : stats.device_bytes > 0);
    CHECK_OK(kvret_context_stats(ctx, &stats));
    CHECK(stats.sequences == 1);
  }

  { /* roll every layer back to its prefill, then below it */
    int64_t length = 0;
    int32_t layer;
    CHECK_OK(kvret_seq_truncate(seq, T));
    for (layer = 0; layer < LAYERS; ++layer) {
      CHECK_OK(kvret_seq_length(seq, layer, &length));
      CHECK(length == T);
    }
    CHECK_OK(kvret_seq_truncate(seq, T / 2));
    CHECK_OK(kvret_seq_length(seq, 0, &length));
    CHECK(length == T / 2);
    CHECK(kvret_seq_truncate(seq, -1) == KVRET_ERR_INVALID_ARGUMENT);
  }
  { /* sessions: save to the DRAM tier, open a copy, drop */
    kvret_seq* restored = NULL;
    int32_t tier = -1;
    int64_t length = 0;
    kvret_stats stats;
    const char* queue[1] = {"turn"};
    CHECK_OK(kvret_session_save(seq, "turn"));
    CHECK_OK(kvret_session_where(ctx, "turn", &tier));
    CHECK(tier == KVRET_TIER_DRAM);
    CHECK_OK(kvret_session_schedule(ctx, queue, 1));
    CHECK_OK(kvret_session_open(ctx, "turn", &restored));
    CHECK_OK(kvret_seq_length(restored, 0, &length));
    CHECK(length == T / 2);
    CHECK_OK(kvret_seq_close(restored));
    CHECK_OK(kvret_stats_init(&stats));
    CHECK_OK(kvret_context_stats(ctx, &stats));
    CHECK(stats.session_saves == 1 && stats.session_hits_dram == 1 && stats.session_dram_count == 1);
    CHECK(stats.session_dram_bytes > 0);
    CHECK_OK(kvret_session_drop(ctx, "turn"));
    CHECK(kvret_session_open(ctx, "turn", &restored) == KVRET_ERR_NOT_FOUND && restored == NULL);
    CHECK(kvret_session_drop(ctx, "turn") == KVRET_ERR_NOT_FOUND);
    CHECK(kvret_session_save(seq, "") == KVRET_ERR_INVALID_ARGUMENT);
    CHECK(kvret_session_schedule(ctx, NULL, 1) == KVRET_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(kvret_status_string(KVRET_ERR_NOT_FOUND), "KVRET_ERR_NOT_FOUND") == 0);
    CHECK_OK(kvret_session_flush(ctx));
  }
  { /* keys before RoPE: kvret rotates them at their index, and again at the new index after a drop */
    enum { N = 40, DROP = 10, KEEP = 4 };
    const int64_t kv_shape[3] = {N, HKV, D};
    kvret_config rc;
    kvret_context* rctx = NULL;
    kvret_seq* rseq = NULL;
    float* k = tensor_alloc(sizeof(float) * N * HKV * D);
    float* v = tensor_alloc(sizeof(float) * N * HKV * D);
    kvret_tensor kt, vt;
    int64_t length = 0, cap = 0, rows = 0, i, t;
    CHECK_OK(kvret_config_init(&rc));
    rc.n_layers = 1;
    rc.n_q_heads = HQ;
    rc.n_kv_heads = HKV;
    rc.head_dim = D;
    rc.kv_dtype = KVRET_KV_F32;
    rc.device_type = test_device;
    rc.rope_keys = 1;
    rc.rope_theta = 10000.0f;
    CHECK_OK(kvret_create(&rc, &rctx));
    CHECK_OK(kvret_seq_open(rctx, &rseq));
    for (i = 0; i < (int64_t)N * HKV * D; ++i) {
      k[i] = frand(&rng);
      v[i] = frand(&rng);
    }
    kt = f32_tensor(k, 3, kv_shape);
    vt = f32_tensor(v, 3, kv_shape);
    CHECK_OK(kvret_append_prefill(rseq, 0, &kt, &vt));
    CHECK(kvret_seq_drop_front(rseq, -1, DROP) == KVRET_ERR_INVALID_ARGUMENT);
    CHECK(kvret_seq_drop_front(rseq, KEEP, -1) == KVRET_ERR_INVALID_ARGUMENT);
    CHECK_OK(kvret_seq_drop_front(rseq, KEEP, DROP));
    CHECK_OK(kvret_seq_length(rseq, 0, &length));
    CHECK(length == N - DROP);
    CHECK_OK(kvret_working_set_capacity(rseq, 0, 0, &cap));
    CHECK(cap == N - DROP); /* no middle: every token is a sink or local one */
    {
      const int64_t ws_shape[3] = {HKV, cap, D};
      const int64_t pos_shape[2] = {HKV, cap};
      float* wk = tensor_alloc(sizeof(float) * (size_t)(HKV * cap * D));
      float* wv = tensor_alloc(sizeof(float) * (size_t)(HKV * cap * D));
      int32_t* wp = tensor_alloc(sizeof(int32_t) * (size_t)(HKV * cap));
      kvret_working_set ws;
      ws.k = f32_tensor(wk, 3, ws_shape);
      ws.v = f32_tensor(wv, 3, ws_shape);
      ws.positions = i32_tensor(wp, 2, pos_shape);
      CHECK_OK(kvret_fetch_async(rseq, 0, NULL, 0, &ws, &rows, NULL));
      CHECK(rows == N - DROP);
      for (t = 0; t < rows; ++t) { /* head 0: token t is the appended token `from`, rotated at t (NeoX pairs) */
        const int64_t from = t < KEEP ? t : t + DROP;
        const float* x = k + from * HKV * D;
        const float* got = wk + t * D;
        int j, bad = 0;
        for (j = 0; j < D / 2; ++j) {
          const double angle = (double)t * pow(10000.0, -2.0 * j / D);
          const double a = (double)x[j] * cos(angle) - (double)x[j + D / 2] * sin(angle);
          const double b = (double)x[j] * sin(angle) + (double)x[j + D / 2] * cos(angle);
          if (fabs(got[j] - a) > 1e-6 || fabs(got[j + D / 2] - b) > 1e-6) bad = 1;
        }
        if (t == 0) bad |= memcmp(got, x, sizeof(float) * D) != 0; /* position 0: unrotated, bit for bit */
        CHECK(!bad && wp[t] == t);
      }
      tensor_free(wk);
      tensor_free(wv);
      tensor_free(wp);
    }
    tensor_free(k);
    tensor_free(v);
    CHECK_OK(kvret_seq_close(rseq));
    CHECK_OK(kvret_destroy(rctx));
  }
  CHECK_OK(kvret_seq_close(seq));
  CHECK_OK(kvret_destroy(ctx));
  CHECK(kvret_destroy(NULL) == KVRET_OK);

  printf("%d passed, %d failed\n", checks - failures, failures);
  return failures == 0 ? 0 : 1;
}
