/* kvret_common.i — the part of the SWIG interface that every language shares.
 *
 * A language's interface file defines its typemaps (tensors, handles, status -> exception) first and then
 * %includes this file, which wraps kvret.h. Tensors and working sets never become SWIG proxy classes: each
 * language maps its own array type onto them. Only kvret_config, the per-design parameter structs
 * (kvret_pq_params, ...) and kvret_stats get proxies (no hand-kept field lists that could drift from the header).
 * A config's pointers to parameter structs are set by each binding, which keeps the structs alive until
 * kvret_swig_create returns. */

%include <stdint.i>

/* Declarations behind KVRET_EXPERIMENTAL are wrapped too (they are marked experimental in each binding). */
#define KVRET_EXPERIMENTAL

%{
#define KVRET_EXPERIMENTAL
#include "kvret.h"
%}

/* Descriptors are built by each binding from its own arrays. */
%ignore kvret_tensor;
%ignore kvret_device;
%ignore kvret_dtype;
%ignore kvret_working_set;

/* struct_size is set by the *_init functions, never by hand. */
%immutable kvret_config::struct_size;
%immutable kvret_stats::struct_size;
%immutable kvret_pq_params::struct_size;
%immutable kvret_cluster_params::struct_size;
%immutable kvret_quant_params::struct_size;
%immutable kvret_crush_params::struct_size;
%immutable kvret_session_params::struct_size;

/* The config's strings (disk_path, session_shared_url) are borrowed: a SWIG setter would have to copy (and leak)
 * them. The bindings pass them to kvret_swig_create instead, which borrows the binding's strings for the duration of
 * kvret_create. */
%ignore kvret_config::disk_path;
%ignore kvret_config::session_shared_url;
%ignore kvret_create;

%inline %{
/** kvret_create with the config's strings given separately (NULL = no disk tier, no shared tier). */
static kvret_status kvret_swig_create(const kvret_config* config, const char* disk_path,
                                      const char* session_shared_url, kvret_context** out) {
  kvret_config copy;
  if (config == NULL) {
    kvret_status status = kvret_config_init(&copy);
    if (status != KVRET_OK) return status;
  } else {
    copy = *config;
  }
  copy.disk_path = disk_path;
  copy.session_shared_url = session_shared_url;
  return kvret_create(&copy, out);
}

/** *dst = *src (for bindings whose config objects are proxies of a C struct). */
static void kvret_swig_config_copy(kvret_config* dst, const kvret_config* src) {
  if (dst != NULL && src != NULL) *dst = *src;
}

/** The disk_path of a config (NULL when none); the string belongs to whoever filled the config. */
static const char* kvret_swig_config_disk_path(const kvret_config* config) {
  return config == NULL ? NULL : config->disk_path;
}

/** The session_shared_url of a config (NULL when none); the string belongs to whoever filled the config. */
static const char* kvret_swig_config_session_shared_url(const kvret_config* config) {
  return config == NULL ? NULL : config->session_shared_url;
}
%}

%include "kvret.h"
