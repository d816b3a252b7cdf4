/* A plain C99 program over the per-design parameter structs of kvret.h (kvret_pq_params, kvret_cluster_params,
 * kvret_quant_params, kvret_crush_params, kvret_session_params): their defaults, a grouped value reaching the
 * context, and the bad inputs (a value out of range, a struct_size no version has, a flat field set next to its
 * struct), each a specific status and message with no context made. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_check.h"
#include "kvret.h"

/* A small model, so that every context here is cheap. */
static void small_config(kvret_config* c) {
  kvret_config_init(c);
  c->n_layers = 2;
  c->n_q_heads = 4;
  c->n_kv_heads = 2;
  c->head_dim = 64;
  c->kv_dtype = KVRET_KV_F32;
}

/* kvret_create must fail with `status`, a last error starting with `prefix` and containing `part` (NULL: any), and
 * leave *out NULL. */
static void expect_refused(const kvret_config* c, kvret_status status, const char* prefix, const char* part, int line) {
  kvret_context* ctx = (kvret_context*)&ctx; /* not NULL: kvret_create must clear it */
  kvret_status s = kvret_create(c, &ctx);
  const char* message = kvret_last_error();
  ++checks;
  if (s != status || ctx != NULL || strncmp(message, prefix, strlen(prefix)) != 0 ||
      (part != NULL && strstr(message, part) == NULL)) {
    ++failures;
    fprintf(stderr, "%s:%d: expected %s \"%s...%s\", got %s \"%s\" (context %s)\n", __FILE__, line,
            kvret_status_string(status), prefix, part ? part : "", kvret_status_string(s), message,
            ctx == NULL ? "NULL" : "made");
  }
  if (s == KVRET_OK && ctx != NULL) kvret_destroy(ctx);
}
#define EXPECT_REFUSED(c, status, prefix, part) expect_refused(c, status, prefix, part, __LINE__)

static void test_defaults_match_the_flat_fields(void) {
  kvret_config c;
  kvret_pq_params pq;
  kvret_cluster_params cluster;
  kvret_quant_params quant;
  kvret_crush_params crush;
  kvret_session_params session;
  CHECK_OK(kvret_config_init(&c));
  memset(&pq, 0xab, sizeof pq);
  memset(&cluster, 0xab, sizeof cluster);
  memset(&quant, 0xab, sizeof quant);
  memset(&crush, 0xab, sizeof crush);
  memset(&session, 0xab, sizeof session);
  CHECK_OK(kvret_pq_params_init(&pq));
  CHECK_OK(kvret_cluster_params_init(&cluster));
  CHECK_OK(kvret_quant_params_init(&quant));
  CHECK_OK(kvret_crush_params_init(&crush));
  CHECK_OK(kvret_session_params_init(&session));
  CHECK(pq.struct_size == sizeof pq && cluster.struct_size == sizeof cluster && quant.struct_size == sizeof quant &&
        crush.struct_size == sizeof crush && session.struct_size == sizeof session);
  CHECK(pq.m == c.pq_m && pq.bits == c.pq_bits && pq.iters == c.pq_iters && pq.tol == c.pq_tol &&
        pq.train_sample == c.pq_train_sample && pq.exact_fraction == c.pq_exact_fraction);
  CHECK(pq.m == 4 && pq.bits == 6);
  CHECK(cluster.tokens == c.cluster_tokens && cluster.decode_interval == c.cluster_decode_interval &&
        cluster.decode_k == c.cluster_decode_k && cluster.segment_tokens == c.cluster_segment_tokens &&
        cluster.reuse_steps == c.cluster_reuse_steps && cluster.exact_fraction == c.cluster_exact_fraction);
  CHECK(quant.bits == c.quant_bits && quant.group_size == c.quant_group_size && quant.residual == c.quant_residual &&
        quant.rerank == c.quant_rerank && quant.attention == c.quant_attention);
  CHECK(crush.fraction == c.hamming_fraction && crush.buckets == c.hamming_buckets &&
        crush.importance == c.hamming_importance && crush.granularity == c.hamming_granularity);
  CHECK(session.dram_bytes == c.session_dram_bytes && session.disk_bytes == c.session_disk_bytes &&
        session.ttl_ms == c.session_ttl_ms && session.policy == c.session_policy);
  CHECK(c.pq == NULL && c.cluster == NULL && c.quant == NULL && c.crush == NULL && c.session == NULL);

  CHECK(kvret_pq_params_init(NULL) == KVRET_ERR_INVALID_ARGUMENT);
  CHECK(kvret_session_params_init(NULL) == KVRET_ERR_INVALID_ARGUMENT);
}

static void test_grouped_values_take_effect(void) {
  kvret_config c, got;
  kvret_pq_params pq;
  kvret_cluster_params cluster;
  kvret_quant_params quant;
  kvret_crush_params crush;
  kvret_session_params session;
  kvret_context* ctx = NULL;
  small_config(&c);
  kvret_pq_params_init(&pq);
  kvret_cluster_params_init(&cluster);
  kvret_quant_params_init(&quant);
  kvret_crush_params_init(&crush);
  kvret_session_params_init(&session);
  pq.m = 8;
  pq.bits = 4;
  pq.exact_fraction = 0.125f;
  cluster.tokens = 48;
  cluster.reuse_steps = 3;
  quant.bits = 1;
  quant.group_size = 32;
  crush.fraction = 0.25f;
  crush.importance = KVRET_IMPORTANCE_ACCUMULATED;
  session.ttl_ms = 1234;
  session.policy = KVRET_SESSION_FIFO;
  c.pq = &pq;
  c.cluster = &cluster;
  c.quant = &quant;
  c.crush = &crush;
  c.session = &session;
  CHECK_OK(kvret_create(&c, &ctx));
  CHECK(ctx != NULL);
  kvret_config_init(&got);
  CHECK_OK(kvret_get_config(ctx, &got));
  CHECK(got.pq_m == 8 && got.pq_bits == 4 && got.pq_exact_fraction == 0.125f && got.pq_iters == 0);
  CHECK(got.cluster_tokens == 48 && got.cluster_reuse_steps == 3 && got.cluster_decode_k == 4);
  CHECK(got.quant_bits == 1 && got.quant_group_size == 32 && got.quant_residual == 64);
  CHECK(got.hamming_fraction == 0.25f && got.hamming_importance == KVRET_IMPORTANCE_ACCUMULATED);
  CHECK(got.session_ttl_ms == 1234 && got.session_policy == KVRET_SESSION_FIFO && got.session_dram_bytes == 0);
  /* the effective config is reported in the flat fields; the caller's structs are not kept */
  CHECK(got.pq == NULL && got.cluster == NULL && got.quant == NULL && got.crush == NULL && got.session == NULL);
  CHECK(pq.m == 8 && pq.struct_size == sizeof pq);
  kvret_destroy(ctx);

  /* the flat fields, kept for one release, still work without a struct */
  small_config(&c);
  c.pq_m = 16;
  ctx = NULL;
  CHECK_OK(kvret_create(&c, &ctx));
  kvret_config_init(&got);
  CHECK_OK(kvret_get_config(ctx, &got));
  CHECK(got.pq_m == 16);
  kvret_destroy(ctx);

  /* a flat field left at its default next to its struct is no conflict */
  small_config(&c);
  kvret_pq_params_init(&pq);
  pq.m = 2;
  c.pq = &pq;
  c.pq_bits = 6; /* == the default */
  ctx = NULL;
  CHECK_OK(kvret_create(&c, &ctx));
  kvret_config_init(&got);
  CHECK_OK(kvret_get_config(ctx, &got));
  CHECK(got.pq_m == 2);
  kvret_destroy(ctx);
}

static void test_out_of_range_names_the_struct_field(void) {
  kvret_config c;
  kvret_pq_params pq;
  kvret_cluster_params cluster;
  kvret_quant_params quant;
  kvret_crush_params crush;
  kvret_session_params session;

  small_config(&c);
  kvret_pq_params_init(&pq);
  pq.m = 3; /* does not divide head_dim 64 */
  c.pq = &pq;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.pq.m: ", "does not divide head_dim 64");
  kvret_pq_params_init(&pq);
  pq.exact_fraction = 0.75f;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.pq.exact_fraction: ", "[0, 0.5]");

  small_config(&c);
  kvret_cluster_params_init(&cluster);
  cluster.reuse_steps = 2000;
  c.cluster = &cluster;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.cluster.reuse_steps: ", "0..1024");

  small_config(&c);
  kvret_quant_params_init(&quant);
  quant.bits = 3;
  c.quant = &quant;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.quant.bits: ", "1 or 2");

  small_config(&c);
  kvret_crush_params_init(&crush);
  crush.fraction = 1.0f;
  c.crush = &crush;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.crush.fraction: ", "[0, 1)");

  small_config(&c);
  kvret_session_params_init(&session);
  session.ttl_ms = -1;
  c.session = &session;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.session.ttl_ms: ", ">= 0");

  /* without the struct, the same value in the flat field is named as before */
  small_config(&c);
  c.pq_m = 3;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.pq_m: ", "does not divide");
}

static void test_struct_size(void) {
  kvret_config c, got;
  kvret_pq_params pq;
  kvret_context* ctx = NULL;
  struct {
    kvret_pq_params params;
    unsigned char later[8]; /* fields of a later version of the struct */
  } newer;

  small_config(&c);
  kvret_pq_params_init(&pq);
  c.pq = &pq;
  pq.struct_size = 0;
  EXPECT_REFUSED(&c, KVRET_ERR_VERSION, "config.pq->struct_size is 0", "kvret_pq_params_init");
  pq.struct_size = offsetof(kvret_pq_params, m) + 2; /* ends inside m */
  EXPECT_REFUSED(&c, KVRET_ERR_VERSION, "config.pq->struct_size is ", "kvret_pq_params_init");
  pq.struct_size = offsetof(kvret_pq_params, bits) + 1; /* ends inside bits */
  EXPECT_REFUSED(&c, KVRET_ERR_VERSION, "config.pq->struct_size is ", "ends inside a field");

  /* a larger struct is accepted while its unknown bytes are zero */
  memset(&newer, 0, sizeof newer);
  kvret_pq_params_init(&newer.params);
  newer.params.struct_size = sizeof newer;
  newer.params.m = 8;
  c.pq = &newer.params;
  CHECK_OK(kvret_create(&c, &ctx));
  kvret_destroy(ctx);
  newer.later[3] = 1;
  EXPECT_REFUSED(&c, KVRET_ERR_VERSION, "config.pq->struct_size is ", "does not know");

  /* an older, smaller struct: the fields past its end keep their defaults (bits here holds a value that would be
     refused if it were read) */
  kvret_pq_params_init(&pq);
  pq.struct_size = offsetof(kvret_pq_params, m) + sizeof pq.m;
  pq.m = 8;
  pq.bits = 99;
  c.pq = &pq;
  ctx = NULL;
  CHECK_OK(kvret_create(&c, &ctx));
  kvret_config_init(&got);
  CHECK_OK(kvret_get_config(ctx, &got));
  CHECK(got.pq_m == 8 && got.pq_bits == 6);
  kvret_destroy(ctx);

  /* a config from before the pointers: they are not read (this one points at a bad struct) */
  small_config(&c);
  kvret_pq_params_init(&pq);
  pq.m = 3;
  c.pq = &pq;
  c.struct_size = offsetof(kvret_config, pq);
  ctx = NULL;
  CHECK_OK(kvret_create(&c, &ctx));
  kvret_config_init(&got);
  CHECK_OK(kvret_get_config(ctx, &got));
  CHECK(got.pq_m == 4);
  kvret_destroy(ctx);
}

static void test_flat_and_grouped_conflict(void) {
  kvret_config c;
  kvret_pq_params pq;
  kvret_crush_params crush;
  kvret_session_params session;

  small_config(&c);
  kvret_pq_params_init(&pq);
  c.pq = &pq;
  c.pq_m = 8;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.pq_m is changed from its default and config.pq is given",
                 "set pq.m only");
  small_config(&c);
  c.pq = &pq;
  c.pq_exact_fraction = 0.0f;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.pq_exact_fraction is changed", "pq.exact_fraction");

  small_config(&c);
  kvret_crush_params_init(&crush);
  c.crush = &crush;
  c.hamming_granularity = 8;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.hamming_granularity is changed", "crush.granularity");

  small_config(&c);
  kvret_session_params_init(&session);
  c.session = &session;
  c.session_policy = KVRET_SESSION_LRU;
  EXPECT_REFUSED(&c, KVRET_ERR_INVALID_ARGUMENT, "config.session_policy is changed", "session.policy");
}

int main(void) {
  test_defaults_match_the_flat_fields();
  test_grouped_values_take_effect();
  test_out_of_range_names_the_struct_field();
  test_struct_size();
  test_flat_and_grouped_conflict();
  if (failures != 0) {
    fprintf(stderr, "%d of %d checks failed\n", failures, checks);
    return EXIT_FAILURE;
  }
  printf("all %d checks passed\n", checks);
  return EXIT_SUCCESS;
}
