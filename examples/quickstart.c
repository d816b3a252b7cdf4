/*
 * quickstart.c — the smallest complete kvret program (C99, only <kvret.h>).
 *
 * One layer of a toy model (8 query heads, 2 KV heads, head_dim 64) gets 4096 prefill tokens of random keys and
 * values; then one decode step: append the new token, select the middle tokens that matter for the query, fetch the
 * working set (sink + selected + local tokens) and attend over it. Every call returns a kvret_status; on failure
 * kvret_last_error() says why.
 *
 * Build: cc quickstart.c $(pkg-config --cflags --libs kvret) -lm   (or the kvret-quickstart target of this repo)
 */
#include <kvret.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { LAYERS = 1, Q_HEADS = 8, KV_HEADS = 2, DIM = 64, PREFILL = 4096 };

/* Reports a failed call and jumps to the cleanup at the end of main. */
#define CHECK(call)                                                                                \
  do {                                                                                             \
    kvret_status st_ = (call);                                                                     \
    if (st_ != KVRET_OK) {                                                                         \
      fprintf(stderr, "%s failed: %s: %s\n", #call, kvret_status_string(st_), kvret_last_error()); \
      goto done;                                                                                   \
    }                                                                                              \
  } while (0)

/* A compact row-major f32 or i32 tensor descriptor over caller memory (the layout of DLPack's DLTensor). */
static kvret_tensor make_tensor(void* data, int is_int, int ndim, const int64_t* shape) {
  kvret_tensor t;
  t.data = data;
  t.device.device_type = KVRET_DEVICE_CPU;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype.code = (uint8_t)(is_int ? KVRET_DTYPE_INT : KVRET_DTYPE_FLOAT);
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = NULL; /* compact row-major */
  t.byte_offset = 0;
  return t;
}

/* Uniform in [-1, 1) from a small xorshift generator (deterministic). */
static float rnd(void) {
  static uint32_t s = 2463534242u;
  s ^= s << 13;
  s ^= s >> 17;
  s ^= s << 5;
  return (float)(s >> 8) / 8388608.0f - 1.0f;
}

int main(void) {
  int rc = 1;
  kvret_context* ctx = NULL;
  kvret_seq* seq = NULL;
  float *k = NULL, *v = NULL, *ws_k = NULL, *ws_v = NULL;
  int32_t *selected = NULL, *ws_pos = NULL;
  float q[Q_HEADS * DIM], k_new[KV_HEADS * DIM], v_new[KV_HEADS * DIM], out[Q_HEADS * DIM];
  size_t i;

  printf("kvret %s\n", kvret_version_string());

  /* 1. A context: the model geometry and the index. The defaults: f16 KV storage, 16 sink and 64 local tokens,
   *    a budget of 1/10 of the context, the PQ index (product quantization of the keys). */
  kvret_config cfg;
  CHECK(kvret_config_init(&cfg));
  cfg.n_layers = LAYERS;
  cfg.n_q_heads = Q_HEADS;
  cfg.n_kv_heads = KV_HEADS;
  cfg.head_dim = DIM;
  cfg.index_kind = KVRET_INDEX_PQ;
  CHECK(kvret_create(&cfg, &ctx));
  CHECK(kvret_seq_open(ctx, &seq)); /* one sequence = one request */

  /* 2. Prefill: keys and values of every prompt token, [tokens, kv_heads, head_dim]. The index build starts in
   *    the background; select waits for it. A "passage" of 256 tokens [1000, 1256) of KV head 0 gets keys along one
   *    direction, which the query below looks for. */
  k = malloc(sizeof(float) * PREFILL * KV_HEADS * DIM);
  v = malloc(sizeof(float) * PREFILL * KV_HEADS * DIM);
  if (!k || !v) goto done;
  for (i = 0; i < (size_t)PREFILL * KV_HEADS * DIM; ++i) {
    k[i] = rnd();
    v[i] = rnd();
  }
  for (i = 1000; i < 1256; ++i) {
    size_t d;
    for (d = 0; d < DIM; ++d) k[(i * KV_HEADS + 0) * DIM + d] += (d % 2) ? 1.5f : -1.5f;
  }
  {
    const int64_t shape[3] = {PREFILL, KV_HEADS, DIM};
    kvret_tensor kt = make_tensor(k, 0, 3, shape), vt = make_tensor(v, 0, 3, shape);
    CHECK(kvret_append_prefill(seq, 0, &kt, &vt));
  }

  /* 3. One decode step of layer 0: append the new token, then select with the step's query. */
  for (i = 0; i < KV_HEADS * DIM; ++i) {
    k_new[i] = rnd();
    v_new[i] = rnd();
  }
  for (i = 0; i < Q_HEADS * DIM; ++i) q[i] = rnd();
  for (i = 0; i < DIM; ++i) q[i] = (i % 2) ? 1.0f : -1.0f; /* query head 0 (KV group 0) looks for the passage */
  {
    const int64_t kv_shape[2] = {KV_HEADS, DIM};
    kvret_tensor kt = make_tensor(k_new, 0, 2, kv_shape), vt = make_tensor(v_new, 0, 2, kv_shape);
    CHECK(kvret_append_decode(seq, 0, &kt, &vt));
  }
  int32_t budget = 0, count = 0;
  CHECK(kvret_seq_budget(seq, 0, &budget)); /* 1/10 of the 4097 tokens */
  selected = malloc(sizeof(int32_t) * KV_HEADS * (size_t)budget);
  if (!selected) goto done;
  const int64_t q_shape[2] = {Q_HEADS, DIM}, sel_shape[2] = {KV_HEADS, budget};
  kvret_tensor qt = make_tensor(q, 0, 2, q_shape), sel = make_tensor(selected, 1, 2, sel_shape);
  CHECK(kvret_select(seq, 0, &qt, KVRET_BUDGET_DEFAULT, &sel, &count));
  printf("selected %d of the middle tokens per KV head; head 0 starts with", count);
  for (i = 0; i < 5 && (int32_t)i < count; ++i) printf(" %d", selected[i]);
  printf(" ...\n");
  {
    int found = 0;
    for (i = 0; i < (size_t)count; ++i) found += selected[i] >= 1000 && selected[i] < 1256;
    printf("%d of the 256 passage tokens the query looks for were selected for KV head 0\n", found);
  }

  /* 4. Fetch the working set: sink + selected + local rows of every KV head, in position order. */
  int64_t cap = 0, rows = 0;
  CHECK(kvret_working_set_capacity(seq, 0, KVRET_BUDGET_DEFAULT, &cap));
  ws_k = malloc(sizeof(float) * KV_HEADS * (size_t)cap * DIM);
  ws_v = malloc(sizeof(float) * KV_HEADS * (size_t)cap * DIM);
  ws_pos = malloc(sizeof(int32_t) * KV_HEADS * (size_t)cap);
  if (!ws_k || !ws_v || !ws_pos) goto done;
  const int64_t ws_shape[3] = {KV_HEADS, cap, DIM}, pos_shape[2] = {KV_HEADS, cap};
  kvret_working_set ws;
  ws.k = make_tensor(ws_k, 0, 3, ws_shape); /* f32 output: kvret converts from its f16 storage */
  ws.v = make_tensor(ws_v, 0, 3, ws_shape);
  ws.positions = make_tensor(ws_pos, 1, 2, pos_shape);
  CHECK(kvret_fetch_async(seq, 0, &sel, count, &ws, &rows, NULL)); /* complete on return on the CPU backend */
  printf("working set: %lld rows per KV head (first %d, last %d)\n", (long long)rows, ws_pos[0], ws_pos[rows - 1]);

  /* 5. Attention over the working set (kvret's reference kernel; an engine would use its own). */
  const int64_t out_shape[2] = {Q_HEADS, DIM};
  kvret_tensor ot = make_tensor(out, 0, 2, out_shape);
  CHECK(kvret_attend(ctx, &qt, &ws.k, &ws.v, rows, 0.0f, &ot, NULL));
  {
    double norm = 0;
    for (i = 0; i < DIM; ++i) norm += (double)out[i] * out[i];
    printf("attention output of query head 0: |o| = %.4f, o[0..3] = %.4f %.4f %.4f %.4f\n", sqrt(norm), out[0], out[1],
           out[2], out[3]);
  }

  /* 6. Statistics. */
  kvret_stats st;
  CHECK(kvret_stats_init(&st));
  CHECK(kvret_seq_stats(seq, &st));
  printf("stored %lld tokens, %lld host bytes, index %lld bytes built in %.1f ms\n", (long long)st.tokens_stored,
         (long long)st.host_bytes, (long long)st.index_bytes, st.index_build_ms);
  rc = 0;

done:
  kvret_seq_close(seq); /* NULL is a no-op */
  kvret_destroy(ctx);
  free(k);
  free(v);
  free(selected);
  free(ws_k);
  free(ws_v);
  free(ws_pos);
  return rc;
}
