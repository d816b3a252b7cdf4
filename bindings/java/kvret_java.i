/* kvret_java.i — the JNI layer under the org.kvret classes.
 *
 * Everything SWIG generates here is package-private (KvretNative, KvretNativeJNI, NativeConfig, Native*Params,
 * NativeStats); users see only the hand-written classes. What this layer guarantees:
 *  - handles and streams cross as Java longs;
 *  - a tensor is an org.kvret.Tensor whose fields (a direct ByteBuffer or a raw address, dtype, device, shape,
 *    strides, byte offset) become a kvret_tensor without a copy; a working set is an org.kvret.WorkingSet;
 *  - a non-OK kvret_status throws org.kvret.KvretException(status, kvret_last_error()) from inside the same native
 *    call, so the message is read on the thread that failed;
 *  - single outputs come back through one-element arrays (long[], int[]);
 *  - strings (session ids, the config's disk_path and session_shared_url) cross as byte[] of UTF-8 without a NUL,
 *    encoded by the Java classes (JNI's own strings are modified UTF-8), copied NUL-terminated for the call.
 */
%module KvretNative

%pragma(java) jniclassclassmodifiers = "final class"
%pragma(java) moduleclassmodifiers = "final class"
%pragma(java) jniclasscode = %{
  static {
    NativeLibrary.load();
  }
%}
%typemap(javaclassmodifiers) SWIGTYPE "final class"
%typemap(javafinalize) SWIGTYPE ""

/* C enums and #defines become compile-time int constants; the org.kvret enums take their values from them. */
%include <enumsimple.swg>
%javaconst(1);

/* Statuses are org.kvret.Status (checked against kvret_status_string by the tests), not int constants. */
%rename("$ignore", regextarget = 1) "^KVRET_ERR_";
%ignore KVRET_OK;

%rename(NativeConfig) kvret_config;
%rename(NativeStats) kvret_stats;
%rename(NativePqParams) kvret_pq_params;
%rename(NativeClusterParams) kvret_cluster_params;
%rename(NativeQuantParams) kvret_quant_params;
%rename(NativeCrushParams) kvret_crush_params;
%rename(NativeSessionParams) kvret_session_params;

/* The seed is a uint64_t: a Java long carries its 64 bits. */
%apply long long { uint64_t seed };

%{
#define KVRET_EXPERIMENTAL
#include "kvret.h"

#include <string.h>

#define KVRET_JAVA_MAX_NDIM 8

/** A descriptor and the storage its shape and strides point into, for one call. */
typedef struct kvret_java_tensor {
  kvret_tensor tensor;
  int64_t shape[KVRET_JAVA_MAX_NDIM];
  int64_t strides[KVRET_JAVA_MAX_NDIM];
} kvret_java_tensor;

typedef struct kvret_java_working_set {
  kvret_working_set set;
  kvret_java_tensor k, v, positions;
} kvret_java_working_set;

static void kvret_java_throw_class(JNIEnv* jenv, const char* class_name, const char* message) {
  jclass cls = (*jenv)->FindClass(jenv, class_name);
  if (cls != NULL) (*jenv)->ThrowNew(jenv, cls, message);
}

/** Throws org.kvret.KvretException(status, kvret_last_error()). */
static void kvret_java_throw(JNIEnv* jenv, kvret_status status) {
  jclass cls = (*jenv)->FindClass(jenv, "org/kvret/KvretException");
  if (cls == NULL) return; /* NoClassDefFoundError is pending */
  jmethodID init = (*jenv)->GetMethodID(jenv, cls, "<init>", "(ILjava/lang/String;)V");
  if (init == NULL) return;
  jstring message = (*jenv)->NewStringUTF(jenv, kvret_last_error());
  if (message == NULL) return;
  jobject exception = (*jenv)->NewObject(jenv, cls, init, (jint)status, message);
  if (exception != NULL) (*jenv)->Throw(jenv, (jthrowable)exception);
}

static int kvret_java_long_array(JNIEnv* jenv, jlongArray array, int64_t* out, jsize ndim) {
  jlong values[KVRET_JAVA_MAX_NDIM];
  (*jenv)->GetLongArrayRegion(jenv, array, 0, ndim, values);
  if ((*jenv)->ExceptionCheck(jenv)) return -1;
  for (jsize i = 0; i < ndim; ++i) out[i] = (int64_t)values[i];
  return 0;
}

/** Fills *out from an org.kvret.Tensor; 0 on success, -1 with a Java exception pending. */
static int kvret_java_tensor_from(JNIEnv* jenv, jobject tensor, const char* name, kvret_java_tensor* out) {
  memset(out, 0, sizeof(*out));
  if (tensor == NULL) {
    char message[96];
    snprintf(message, sizeof(message), "kvret: tensor %s is null", name);
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", message);
    return -1;
  }
  jclass cls = (*jenv)->GetObjectClass(jenv, tensor);
  jfieldID buffer_id = (*jenv)->GetFieldID(jenv, cls, "buffer", "Ljava/nio/ByteBuffer;");
  jfieldID address_id = (*jenv)->GetFieldID(jenv, cls, "address", "J");
  jfieldID byte_offset_id = (*jenv)->GetFieldID(jenv, cls, "byteOffset", "J");
  jfieldID code_id = (*jenv)->GetFieldID(jenv, cls, "dtypeCode", "I");
  jfieldID bits_id = (*jenv)->GetFieldID(jenv, cls, "dtypeBits", "I");
  jfieldID device_type_id = (*jenv)->GetFieldID(jenv, cls, "deviceType", "I");
  jfieldID device_id_id = (*jenv)->GetFieldID(jenv, cls, "deviceId", "I");
  jfieldID shape_id = (*jenv)->GetFieldID(jenv, cls, "shape", "[J");
  jfieldID strides_id = (*jenv)->GetFieldID(jenv, cls, "strides", "[J");
  if (buffer_id == NULL || address_id == NULL || byte_offset_id == NULL || code_id == NULL || bits_id == NULL ||
      device_type_id == NULL || device_id_id == NULL || shape_id == NULL || strides_id == NULL) {
    return -1; /* NoSuchFieldError is pending */
  }
  jobject buffer = (*jenv)->GetObjectField(jenv, tensor, buffer_id);
  if (buffer != NULL) {
    out->tensor.data = (*jenv)->GetDirectBufferAddress(jenv, buffer);
    if (out->tensor.data == NULL) {
      kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException", "kvret: a tensor needs a direct ByteBuffer");
      return -1;
    }
  } else {
    out->tensor.data = (void*)(intptr_t)(*jenv)->GetLongField(jenv, tensor, address_id);
  }
  out->tensor.byte_offset = (uint64_t)(*jenv)->GetLongField(jenv, tensor, byte_offset_id);
  out->tensor.dtype.code = (uint8_t)(*jenv)->GetIntField(jenv, tensor, code_id);
  out->tensor.dtype.bits = (uint8_t)(*jenv)->GetIntField(jenv, tensor, bits_id);
  out->tensor.dtype.lanes = 1;
  out->tensor.device.device_type = (int32_t)(*jenv)->GetIntField(jenv, tensor, device_type_id);
  out->tensor.device.device_id = (int32_t)(*jenv)->GetIntField(jenv, tensor, device_id_id);

  jlongArray shape = (jlongArray)(*jenv)->GetObjectField(jenv, tensor, shape_id);
  jsize ndim = shape == NULL ? 0 : (*jenv)->GetArrayLength(jenv, shape);
  if (ndim > KVRET_JAVA_MAX_NDIM) {
    kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException", "kvret: a tensor has at most 8 dimensions");
    return -1;
  }
  if (ndim > 0 && kvret_java_long_array(jenv, shape, out->shape, ndim) != 0) return -1;
  out->tensor.ndim = (int32_t)ndim;
  out->tensor.shape = out->shape;
  jlongArray strides = (jlongArray)(*jenv)->GetObjectField(jenv, tensor, strides_id);
  if (strides != NULL) {
    if ((*jenv)->GetArrayLength(jenv, strides) != ndim) {
      kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException", "kvret: strides and shape differ in length");
      return -1;
    }
    if (ndim > 0 && kvret_java_long_array(jenv, strides, out->strides, ndim) != 0) return -1;
    out->tensor.strides = out->strides;
  }
  return 0;
}

static int kvret_java_working_set_from(JNIEnv* jenv, jobject working_set, kvret_java_working_set* out) {
  memset(out, 0, sizeof(*out));
  if (working_set == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: the working set is null");
    return -1;
  }
  jclass cls = (*jenv)->GetObjectClass(jenv, working_set);
  const char* names[3] = {"k", "v", "positions"};
  kvret_java_tensor* tensors[3] = {&out->k, &out->v, &out->positions};
  for (int i = 0; i < 3; ++i) {
    jfieldID id = (*jenv)->GetFieldID(jenv, cls, names[i], "Lorg/kvret/Tensor;");
    if (id == NULL) return -1;
    jobject tensor = (*jenv)->GetObjectField(jenv, working_set, id);
    if (kvret_java_tensor_from(jenv, tensor, names[i], tensors[i]) != 0) return -1;
  }
  out->set.k = out->k.tensor;
  out->set.v = out->v.tensor;
  out->set.positions = out->positions.tensor;
  return 0;
}

/** A NUL-terminated malloc'd copy of a byte[] (free it), or NULL with a Java exception pending. */
static char* kvret_java_c_string(JNIEnv* jenv, jbyteArray bytes, const char* name) {
  char message[96];
  if (bytes == NULL) {
    snprintf(message, sizeof(message), "kvret: %s is null", name);
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", message);
    return NULL;
  }
  jsize length = (*jenv)->GetArrayLength(jenv, bytes);
  char* copy = (char*)malloc((size_t)length + 1);
  if (copy == NULL) {
    kvret_java_throw_class(jenv, "java/lang/OutOfMemoryError", name);
    return NULL;
  }
  (*jenv)->GetByteArrayRegion(jenv, bytes, 0, length, (jbyte*)copy);
  if ((*jenv)->ExceptionCheck(jenv)) {
    free(copy);
    return NULL;
  }
  copy[length] = '\0';
  if (strlen(copy) != (size_t)length) {
    free(copy);
    snprintf(message, sizeof(message), "kvret: %s contains a NUL byte", name);
    kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException", message);
    return NULL;
  }
  return copy;
}
%}

/* ---- status: a failure throws KvretException from inside the native call ---- */
%typemap(jni) kvret_status "jint"
%typemap(jtype) kvret_status "int"
%typemap(jstype) kvret_status "void"
%typemap(javaout) kvret_status {
    $jnicall;
  }
%typemap(out) kvret_status {
  $result = (jint)$1;
  if ($1 != KVRET_OK) kvret_java_throw(jenv, $1);
}
/* kvret_status_string takes a plain int. */
%typemap(jni) kvret_status status "jint"
%typemap(jtype) kvret_status status "int"
%typemap(jstype) kvret_status status "int"
%typemap(javain) kvret_status status "$javainput"
%typemap(in) kvret_status status "$1 = (kvret_status)$input;"

/* ---- handles and streams: Java longs ---- */
%define KVRET_JAVA_HANDLE(TYPE)
%typemap(jni) TYPE "jlong"
%typemap(jtype) TYPE "long"
%typemap(jstype) TYPE "long"
%typemap(javain) TYPE "$javainput"
%typemap(in) TYPE "$1 = ($1_ltype)(intptr_t)$input;"
%enddef
KVRET_JAVA_HANDLE(kvret_context*)
KVRET_JAVA_HANDLE(const kvret_context*)
KVRET_JAVA_HANDLE(kvret_seq*)
KVRET_JAVA_HANDLE(const kvret_seq*)
KVRET_JAVA_HANDLE(kvret_stream)

/* ---- outputs through one-element arrays ---- */
%define KVRET_JAVA_OUT(CTYPE, NAME, JNITYPE, JAVATYPE, JELEM, SETTER)
%typemap(jni) CTYPE* NAME "JNITYPE"
%typemap(jtype) CTYPE* NAME "JAVATYPE"
%typemap(jstype) CTYPE* NAME "JAVATYPE"
%typemap(javain) CTYPE* NAME "$javainput"
%typemap(in) CTYPE* NAME (CTYPE value = 0) {
  if ($input == NULL || (*jenv)->GetArrayLength(jenv, $input) < 1) {
    kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException", "kvret: an output array needs one element");
    return $null;
  }
  $1 = &value;
}
%typemap(argout) CTYPE* NAME {
  if (!(*jenv)->ExceptionCheck(jenv)) {
    JELEM result_value = (JELEM)(intptr_t)*$1;
    (*jenv)->SETTER(jenv, $input, 0, 1, &result_value);
  }
}
%enddef
KVRET_JAVA_OUT(kvret_context*, out, jlongArray, long[], jlong, SetLongArrayRegion)
KVRET_JAVA_OUT(kvret_seq*, out, jlongArray, long[], jlong, SetLongArrayRegion)
KVRET_JAVA_OUT(int32_t, out_count, jintArray, int[], jint, SetIntArrayRegion)
KVRET_JAVA_OUT(int32_t, out_budget, jintArray, int[], jint, SetIntArrayRegion)
KVRET_JAVA_OUT(int64_t, out_tokens, jlongArray, long[], jlong, SetLongArrayRegion)
KVRET_JAVA_OUT(int64_t, out_rows, jlongArray, long[], jlong, SetLongArrayRegion)

KVRET_JAVA_OUT(int32_t, out_tier, jintArray, int[], jint, SetIntArrayRegion)

/* ---- strings: byte[] of UTF-8 (null: NULL where the C call takes it) ---- */
%define KVRET_JAVA_BYTES(NAME, NULLABLE)
%typemap(jni) const char* NAME "jbyteArray"
%typemap(jtype) const char* NAME "byte[]"
%typemap(jstype) const char* NAME "byte[]"
%typemap(javain) const char* NAME "$javainput"
%typemap(in) const char* NAME (char* copy = NULL) {
  if ($input != NULL || !NULLABLE) {
    copy = kvret_java_c_string(jenv, $input, #NAME);
    if (copy == NULL) return $null;
  }
  $1 = copy;
}
%typemap(freearg) const char* NAME {
  free(copy$argnum);
}
%enddef
KVRET_JAVA_BYTES(session_id, 0)
KVRET_JAVA_BYTES(disk_path, 1)
KVRET_JAVA_BYTES(session_shared_url, 1)

/* The config's strings read back: byte[] (null for NULL), decoded as UTF-8 by the Java classes. */
%define KVRET_JAVA_BYTES_OUT(FUNCTION)
%typemap(jni) const char* FUNCTION "jbyteArray"
%typemap(jtype) const char* FUNCTION "byte[]"
%typemap(jstype) const char* FUNCTION "byte[]"
%typemap(javaout) const char* FUNCTION {
    return $jnicall;
  }
%typemap(out) const char* FUNCTION {
  $result = NULL;
  if ($1 != NULL) {
    jsize length = (jsize)strlen($1);
    $result = (*jenv)->NewByteArray(jenv, length);
    if ($result != NULL) (*jenv)->SetByteArrayRegion(jenv, $result, 0, length, (const jbyte*)$1);
  }
}
%enddef
KVRET_JAVA_BYTES_OUT(kvret_swig_config_disk_path)
KVRET_JAVA_BYTES_OUT(kvret_swig_config_session_shared_url)

/* ---- session_schedule: byte[][] of session ids ---- */
%typemap(jni) (const char* const* session_ids, int32_t n) "jobjectArray"
%typemap(jtype) (const char* const* session_ids, int32_t n) "byte[][]"
%typemap(jstype) (const char* const* session_ids, int32_t n) "byte[][]"
%typemap(javain) (const char* const* session_ids, int32_t n) "$javainput"
%typemap(in) (const char* const* session_ids, int32_t n) (char** id_array = NULL, jsize id_count = 0) {
  if ($input == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: session_ids is null");
    return $null;
  }
  jsize count = (*jenv)->GetArrayLength(jenv, $input);
  id_array = (char**)calloc(count > 0 ? (size_t)count : 1, sizeof(char*));
  if (id_array == NULL) {
    kvret_java_throw_class(jenv, "java/lang/OutOfMemoryError", "kvret: session_ids");
    return $null;
  }
  for (jsize i = 0; i < count; ++i) {
    jbyteArray item = (jbyteArray)(*jenv)->GetObjectArrayElement(jenv, $input, i);
    id_array[i] = (*jenv)->ExceptionCheck(jenv) ? NULL : kvret_java_c_string(jenv, item, "session_ids[i]");
    if (item != NULL) (*jenv)->DeleteLocalRef(jenv, item);
    if (id_array[i] == NULL) {
      for (jsize j = 0; j < i; ++j) free(id_array[j]);
      free(id_array);
      return $null;
    }
    id_count = i + 1;
  }
  $1 = ($1_ltype)id_array;
  $2 = (int32_t)count;
}
%typemap(freearg) (const char* const* session_ids, int32_t n) {
  for (jsize i = 0; i < id_count$argnum; ++i) free(id_array$argnum[i]);
  free(id_array$argnum);
}

/* ---- tensors and working sets ---- */
%typemap(jni) const kvret_tensor* "jobject"
%typemap(jtype) const kvret_tensor* "Tensor"
%typemap(jstype) const kvret_tensor* "Tensor"
%typemap(javain) const kvret_tensor* "$javainput"
%typemap(in) const kvret_tensor* (kvret_java_tensor jt) {
  if (kvret_java_tensor_from(jenv, $input, "$1_name", &jt) != 0) return $null;
  $1 = &jt.tensor;
}

%typemap(jni) const kvret_working_set* "jobject"
%typemap(jtype) const kvret_working_set* "WorkingSet"
%typemap(jstype) const kvret_working_set* "WorkingSet"
%typemap(javain) const kvret_working_set* "$javainput"
%typemap(in) const kvret_working_set* (kvret_java_working_set jws) {
  if (kvret_java_working_set_from(jenv, $input, &jws) != 0) return $null;
  $1 = &jws.set;
}

/* ---- select_batch: long[] of sequence handles, int[] of counts ---- */
%typemap(jni) (int32_t n, kvret_seq* const* seqs) "jlongArray"
%typemap(jtype) (int32_t n, kvret_seq* const* seqs) "long[]"
%typemap(jstype) (int32_t n, kvret_seq* const* seqs) "long[]"
%typemap(javain) (int32_t n, kvret_seq* const* seqs) "$javainput"
%typemap(in) (int32_t n, kvret_seq* const* seqs) (kvret_seq** seq_array = NULL) {
  if ($input == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: seqs is null");
    return $null;
  }
  jsize count = (*jenv)->GetArrayLength(jenv, $input);
  seq_array = (kvret_seq**)calloc(count > 0 ? (size_t)count : 1, sizeof(kvret_seq*));
  if (seq_array == NULL) {
    kvret_java_throw_class(jenv, "java/lang/OutOfMemoryError", "kvret: seqs");
    return $null;
  }
  jlong* handles = (*jenv)->GetLongArrayElements(jenv, $input, NULL);
  if (handles == NULL) {
    free(seq_array);
    return $null;
  }
  for (jsize i = 0; i < count; ++i) seq_array[i] = (kvret_seq*)(intptr_t)handles[i];
  (*jenv)->ReleaseLongArrayElements(jenv, $input, handles, JNI_ABORT);
  $1 = (int32_t)count;
  $2 = seq_array;
}
%typemap(freearg) (int32_t n, kvret_seq* const* seqs) {
  free(seq_array$argnum);
}
%typemap(jni) int32_t* out_counts "jintArray"
%typemap(jtype) int32_t* out_counts "int[]"
%typemap(jstype) int32_t* out_counts "int[]"
%typemap(javain) int32_t* out_counts "$javainput"
%typemap(in) int32_t* out_counts {
  if ($input == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: out_counts is null");
    return $null;
  }
  $1 = (int32_t*)(*jenv)->GetIntArrayElements(jenv, $input, NULL);
  if ($1 == NULL) return $null;
}
%typemap(argout) int32_t* out_counts {
  (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint*)$1, 0);
}

/* ---- fetch_batch: int[] of counts, WorkingSet[] of outputs, long[] of row counts; each of n entries (n is the
 * call's second argument, the length of seqs) ---- */
%typemap(jni) const int32_t* counts "jintArray"
%typemap(jtype) const int32_t* counts "int[]"
%typemap(jstype) const int32_t* counts "int[]"
%typemap(javain) const int32_t* counts "$javainput"
%typemap(in) const int32_t* counts {
  if ($input == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: counts is null");
    return $null;
  }
  if ((*jenv)->GetArrayLength(jenv, $input) != (jsize)arg2) {
    kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException", "kvret: counts needs one entry per sequence");
    return $null;
  }
  $1 = (int32_t*)(*jenv)->GetIntArrayElements(jenv, $input, NULL);
  if ($1 == NULL) return $null;
}
%typemap(freearg) const int32_t* counts {
  if ($1 != NULL) (*jenv)->ReleaseIntArrayElements(jenv, $input, (jint*)$1, JNI_ABORT);
}
%typemap(jni) int64_t* out_row_counts "jlongArray"
%typemap(jtype) int64_t* out_row_counts "long[]"
%typemap(jstype) int64_t* out_row_counts "long[]"
%typemap(javain) int64_t* out_row_counts "$javainput"
%typemap(in) int64_t* out_row_counts {
  if ($input == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: out_row_counts is null");
    return $null;
  }
  if ((*jenv)->GetArrayLength(jenv, $input) != (jsize)arg2) {
    kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException",
                           "kvret: out_row_counts needs one entry per sequence");
    return $null;
  }
  $1 = (int64_t*)(*jenv)->GetLongArrayElements(jenv, $input, NULL);
  if ($1 == NULL) return $null;
}
%typemap(argout) int64_t* out_row_counts {
  (*jenv)->ReleaseLongArrayElements(jenv, $input, (jlong*)$1, 0);
}
%typemap(jni) const kvret_working_set* outs "jobjectArray"
%typemap(jtype) const kvret_working_set* outs "WorkingSet[]"
%typemap(jstype) const kvret_working_set* outs "WorkingSet[]"
%typemap(javain) const kvret_working_set* outs "$javainput"
%typemap(in) const kvret_working_set* outs (kvret_java_working_set* jsets = NULL, kvret_working_set* sets = NULL) {
  if ($input == NULL) {
    kvret_java_throw_class(jenv, "java/lang/NullPointerException", "kvret: outs is null");
    return $null;
  }
  jsize count = (*jenv)->GetArrayLength(jenv, $input);
  if (count != (jsize)arg2) {
    kvret_java_throw_class(jenv, "java/lang/IllegalArgumentException",
                           "kvret: outs needs one working set per sequence");
    return $null;
  }
  jsets = (kvret_java_working_set*)calloc(count > 0 ? (size_t)count : 1, sizeof(kvret_java_working_set));
  sets = (kvret_working_set*)calloc(count > 0 ? (size_t)count : 1, sizeof(kvret_working_set));
  if (jsets == NULL || sets == NULL) {
    free(jsets);
    free(sets);
    kvret_java_throw_class(jenv, "java/lang/OutOfMemoryError", "kvret: outs");
    return $null;
  }
  for (jsize i = 0; i < count; ++i) {
    /* each working set's local references (its class, its tensors and their buffers) freed before the next */
    int failed = (*jenv)->PushLocalFrame(jenv, 32) != 0;
    if (!failed) {
      jobject item = (*jenv)->GetObjectArrayElement(jenv, $input, i);
      failed = kvret_java_working_set_from(jenv, item, &jsets[i]) != 0; /* a null item throws there */
      (*jenv)->PopLocalFrame(jenv, NULL);
    }
    if (failed) {
      free(jsets);
      free(sets);
      return $null;
    }
    sets[i] = jsets[i].set;
  }
  $1 = sets;
}
%typemap(freearg) const kvret_working_set* outs {
  free(jsets$argnum);
  free(sets$argnum);
}

%include "kvret_common.i"
