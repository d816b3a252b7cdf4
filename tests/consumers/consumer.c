/* A program that uses an installed kvret the way an engine would: built only from what the install provides
 * (pkg-config flags, or find_package(kvret)), it runs prefill -> select -> fetch -> attend and checks the results. */
#include <kvret.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { LAYERS = 1, Q_HEADS = 4, KV_HEADS = 2, HEAD_DIM = 64, TOKENS = 256, SINK = 4, LOCAL = 16, BUDGET = 24 };

#define CHECK(call)                                                                                    \
  do {                                                                                                 \
    kvret_status status_ = (call);                                                                     \
    if (status_ != KVRET_OK) {                                                                         \
      fprintf(stderr, "%s failed: %s: %s\n", #call, kvret_status_string(status_), kvret_last_error()); \
      return 1;                                                                                        \
    }                                                                                                  \
  } while (0)

static kvret_tensor tensor_f32(float* data, int32_t ndim, const int64_t* shape) {
  kvret_tensor t = {0};
  t.data = data;
  t.device.device_type = KVRET_DEVICE_CPU;
  t.ndim = ndim;
  t.dtype.code = KVRET_DTYPE_FLOAT;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

int main(void) {
  static float k[TOKENS * KV_HEADS * HEAD_DIM], v[TOKENS * KV_HEADS * HEAD_DIM], q[Q_HEADS * HEAD_DIM];
  static float ws_k[KV_HEADS * TOKENS * HEAD_DIM], ws_v[KV_HEADS * TOKENS * HEAD_DIM], out[Q_HEADS * HEAD_DIM];
  static int32_t positions[KV_HEADS * BUDGET], ws_positions[KV_HEADS * TOKENS];
  unsigned seed = 12345u;
  for (int i = 0; i < TOKENS * KV_HEADS * HEAD_DIM; ++i) {
    seed = seed * 1664525u + 1013904223u;
    k[i] = (float)(seed >> 8) / 16777216.0f - 0.5f;
    v[i] = (float)i / (float)(TOKENS * KV_HEADS * HEAD_DIM);
  }
  for (int i = 0; i < Q_HEADS * HEAD_DIM; ++i) q[i] = k[(100 * KV_HEADS) * HEAD_DIM + i % (KV_HEADS * HEAD_DIM)];

  if (kvret_version_number() / 100 != KVRET_VERSION_NUMBER / 100) {
    fprintf(stderr, "header %d and library %u differ\n", KVRET_VERSION_NUMBER, kvret_version_number());
    return 1;
  }
  kvret_config config;
  CHECK(kvret_config_init(&config));
  config.n_layers = LAYERS;
  config.n_q_heads = Q_HEADS;
  config.n_kv_heads = KV_HEADS;
  config.head_dim = HEAD_DIM;
  config.kv_dtype = KVRET_KV_F32;
  config.index_kind = KVRET_INDEX_EXACT;
  config.n_sink = SINK;
  config.n_local = LOCAL;
  config.budget = BUDGET;
  kvret_context* ctx = NULL;
  kvret_seq* seq = NULL;
  CHECK(kvret_create(&config, &ctx));
  CHECK(kvret_seq_open(ctx, &seq));

  const int64_t kv_shape[3] = {TOKENS, KV_HEADS, HEAD_DIM}, q_shape[2] = {Q_HEADS, HEAD_DIM};
  const int64_t positions_shape[2] = {KV_HEADS, BUDGET};
  kvret_tensor kt = tensor_f32(k, 3, kv_shape), vt = tensor_f32(v, 3, kv_shape), qt = tensor_f32(q, 2, q_shape);
  CHECK(kvret_append_prefill(seq, 0, &kt, &vt));

  kvret_tensor pt = tensor_f32(NULL, 2, positions_shape);
  pt.data = positions;
  pt.dtype.code = KVRET_DTYPE_INT;
  int32_t count = 0;
  CHECK(kvret_select(seq, 0, &qt, KVRET_BUDGET_DEFAULT, &pt, &count));

  int64_t capacity = 0, rows = 0;
  CHECK(kvret_working_set_capacity(seq, 0, count, &capacity));
  if (capacity > TOKENS) capacity = TOKENS;
  const int64_t ws_shape[3] = {KV_HEADS, capacity, HEAD_DIM}, ws_positions_shape[2] = {KV_HEADS, capacity};
  kvret_working_set ws;
  ws.k = tensor_f32(ws_k, 3, ws_shape);
  ws.v = tensor_f32(ws_v, 3, ws_shape);
  ws.positions = tensor_f32(NULL, 2, ws_positions_shape);
  ws.positions.data = ws_positions;
  ws.positions.dtype.code = KVRET_DTYPE_INT;
  CHECK(kvret_fetch_async(seq, 0, &pt, count, &ws, &rows, NULL));

  const int64_t out_shape[2] = {Q_HEADS, HEAD_DIM};
  kvret_tensor ot = tensor_f32(out, 2, out_shape);
  CHECK(kvret_attend(ctx, &qt, &ws.k, &ws.v, rows, 0.0f, &ot, NULL));

  /* Token 100 matches the query exactly: the exact index must select it, and rows must hold stored keys. */
  int found = 0;
  for (int i = 0; i < count; ++i) found |= positions[i] == 100;
  int stored = 1;
  for (int64_t r = 0; r < rows; ++r) {
    int32_t position = ws_positions[r];
    for (int d = 0; d < HEAD_DIM; ++d) stored &= ws_k[r * HEAD_DIM + d] == k[(position * KV_HEADS) * HEAD_DIM + d];
  }
  double norm = 0;
  for (int i = 0; i < Q_HEADS * HEAD_DIM; ++i) norm += (double)out[i] * out[i];

  /* A bad call reports a status and a message instead of failing silently. */
  kvret_status bad = kvret_select(seq, 0, &qt, 0, &pt, &count);
  int bad_ok = bad == KVRET_ERR_BUDGET && kvret_last_error()[0] != '\0';

  CHECK(kvret_seq_close(seq));
  CHECK(kvret_destroy(ctx));
  printf("kvret %s: selected %d per KV head, working set %lld rows, |out| = %.4f, token 100 %s\n",
         kvret_version_string(), (int)count, (long long)rows, sqrt(norm), found ? "retrieved" : "MISSED");
  if (!found || !stored || !bad_ok || rows != SINK + BUDGET + LOCAL) {
    fprintf(stderr, "consumer checks failed: found=%d stored=%d bad_status=%d rows=%lld\n", found, stored, bad_ok,
            (long long)rows);
    return 1;
  }
  return 0;
}
