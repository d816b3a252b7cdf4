/* kvret_swig.i — the low-level Python module kvret.kvret_swig (C extension kvret._kvret_swig).
 *
 * It is not meant to be used directly: the package kvret wraps it in Context and Sequence classes. What this layer
 * guarantees:
 *  - every call into libkvret runs with the GIL released (the %exception below);
 *  - a non-OK kvret_status raises the registered error class (kvret.KvretError) with the status and the message of
 *    kvret_last_error, read on the same thread right after the call;
 *  - a tensor argument is a NumPy array, a DLPack capsule ("dltensor" or "dltensor_versioned"), or a raw descriptor
 *    tuple (data, shape, strides, (code, bits), (device_type, device_id)); none of them is copied.
 */
%module(package = "kvret") kvret_swig

%{
#define KVRET_EXPERIMENTAL
#include "kvret.h"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <string.h>

#define KVRET_PY_MAX_NDIM 8

/* DLPack's managed tensors, declared here by layout (kvret_tensor is DLTensor) to avoid a dlpack.h dependency. */
typedef struct kvret_py_dlmanaged {
  kvret_tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct kvret_py_dlmanaged*);
} kvret_py_dlmanaged;

typedef struct kvret_py_dlmanaged_versioned {
  uint32_t version_major;
  uint32_t version_minor;
  void* manager_ctx;
  void (*deleter)(struct kvret_py_dlmanaged_versioned*);
  uint64_t flags;
  kvret_tensor dl_tensor;
} kvret_py_dlmanaged_versioned;

#define KVRET_PY_DLPACK_READ_ONLY 1u
#define KVRET_PY_DLPACK_COMPLEX 5 /* kDLComplex */
#define KVRET_PY_DLPACK_BOOL 6    /* kDLBool */

/** A descriptor and the storage its shape and strides point into, for one call. */
typedef struct kvret_py_tensor {
  kvret_tensor tensor;
  int64_t shape[KVRET_PY_MAX_NDIM];
  int64_t strides[KVRET_PY_MAX_NDIM];
  PyObject* owner; /* a DLPack capsule kept alive until the call returns; its destructor frees the tensor */
} kvret_py_tensor;

/** The error class raised for a non-OK status: kvret.KvretError once the package registered it. */
static PyObject* kvret_py_error_class = NULL;

static void kvret_py_raise(kvret_status status) {
  const char* message = kvret_last_error();
  PyObject* cls = kvret_py_error_class != NULL ? kvret_py_error_class : PyExc_RuntimeError;
  PyObject* text = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
  PyObject* exc = text == NULL ? NULL : PyObject_CallFunction(cls, "iO", (int)status, text);
  Py_XDECREF(text);
  if (exc != NULL) {
    PyErr_SetObject((PyObject*)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  }
}

/* A call's output (a handle, a count) replaces the None its status gives; a second one would make a list. SWIG's own
 * SWIG_Python_AppendOutput changed in SWIG 4.3 (a third argument, and a list [None, output] for a function that does
 * not return void, as every kvret function returns a status): this one is the same under every SWIG. */
static PyObject* kvret_py_append_output(PyObject* result, PyObject* obj) {
  if (obj == NULL) { /* the output's conversion failed: its exception fails the call */
    Py_XDECREF(result);
    return NULL;
  }
  if (result == NULL || result == Py_None) {
    Py_XDECREF(result);
    return obj;
  }
  if (!PyList_Check(result)) {
    PyObject* list = PyList_New(1);
    if (list == NULL) {
      Py_DECREF(obj);
      return result;
    }
    PyList_SET_ITEM(list, 0, result);
    result = list;
  }
  PyList_Append(result, obj);
  Py_DECREF(obj);
  return result;
}

static int kvret_py_dtype_from_numpy(PyArrayObject* array, kvret_dtype* out) {
  PyArray_Descr* descr = PyArray_DESCR(array);
  out->lanes = 1;
  out->bits = (uint8_t)(PyArray_ITEMSIZE(array) * 8);
  switch (PyArray_TYPE(array)) {
    case NPY_FLOAT16:
    case NPY_FLOAT32:
    case NPY_FLOAT64:
      out->code = KVRET_DTYPE_FLOAT;
      return 0;
    case NPY_INT8:
    case NPY_INT16:
    case NPY_INT32:
    case NPY_INT64:
      out->code = KVRET_DTYPE_INT;
      return 0;
    case NPY_UINT8:
    case NPY_UINT16:
    case NPY_UINT32:
    case NPY_UINT64:
      out->code = KVRET_DTYPE_UINT;
      return 0;
    /* Described as DLPack would (kDLBool, kDLComplex), so that the library refuses them with KVRET_ERR_DTYPE as it
     * refuses the same array passed through __dlpack__. */
    case NPY_BOOL:
      out->code = KVRET_PY_DLPACK_BOOL;
      return 0;
    case NPY_COMPLEX64:
    case NPY_COMPLEX128:
      out->code = KVRET_PY_DLPACK_COMPLEX;
      return 0;
    default:
      break;
  }
  /* ml_dtypes.bfloat16 is a user dtype: recognize it by name ("bfloat16" or "ml_dtypes.bfloat16") and size. */
  const char* type_name = descr->typeobj->tp_name;
  const char* dot = strrchr(type_name, '.');
  if (PyArray_ITEMSIZE(array) == 2 && strcmp(dot != NULL ? dot + 1 : type_name, "bfloat16") == 0) {
    out->code = KVRET_DTYPE_BFLOAT;
    return 0;
  }
  PyErr_Format(PyExc_TypeError, "kvret: unsupported NumPy dtype '%s'", descr->typeobj->tp_name);
  return -1;
}

static int kvret_py_from_numpy(PyObject* obj, int writable, const char* name, kvret_py_tensor* out) {
  PyArrayObject* array = (PyArrayObject*)obj;
  int ndim = PyArray_NDIM(array);
  npy_intp itemsize = PyArray_ITEMSIZE(array);
  if (ndim > KVRET_PY_MAX_NDIM) {
    PyErr_Format(PyExc_ValueError, "kvret: %s has %d dimensions (at most %d)", name, ndim, KVRET_PY_MAX_NDIM);
    return -1;
  }
  if (!PyArray_ISNOTSWAPPED(array) || !PyArray_ISALIGNED(array)) {
    PyErr_Format(PyExc_ValueError, "kvret: %s must be aligned and in native byte order", name);
    return -1;
  }
  if (writable && !PyArray_ISWRITEABLE(array)) {
    PyErr_Format(PyExc_ValueError, "kvret: output %s is read-only", name);
    return -1;
  }
  if (kvret_py_dtype_from_numpy(array, &out->tensor.dtype) != 0) return -1;
  for (int i = 0; i < ndim; ++i) {
    npy_intp stride = PyArray_STRIDE(array, i);
    if (stride % itemsize != 0) {
      PyErr_Format(PyExc_ValueError, "kvret: %s has a stride that is not a whole number of elements", name);
      return -1;
    }
    out->shape[i] = (int64_t)PyArray_DIM(array, i);
    out->strides[i] = (int64_t)(stride / itemsize);
  }
  out->tensor.data = PyArray_DATA(array);
  out->tensor.device.device_type = KVRET_DEVICE_CPU;
  out->tensor.device.device_id = 0;
  out->tensor.ndim = ndim;
  out->tensor.shape = out->shape;
  out->tensor.strides = out->strides;
  out->tensor.byte_offset = 0;
  return 0;
}

static int kvret_py_from_dltensor(const kvret_tensor* dl, const char* name, kvret_py_tensor* out) {
  if (dl->ndim < 0 || dl->ndim > KVRET_PY_MAX_NDIM) {
    PyErr_Format(PyExc_ValueError, "kvret: %s has %d dimensions (at most %d)", name, (int)dl->ndim,
                 KVRET_PY_MAX_NDIM);
    return -1;
  }
  out->tensor = *dl;
  for (int i = 0; i < dl->ndim; ++i) out->shape[i] = dl->shape[i];
  out->tensor.shape = out->shape;
  if (dl->strides != NULL) {
    for (int i = 0; i < dl->ndim; ++i) out->strides[i] = dl->strides[i];
    out->tensor.strides = out->strides;
  }
  return 0;
}

static int kvret_py_from_capsule(PyObject* capsule, int writable, const char* name, kvret_py_tensor* out) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    kvret_py_dlmanaged* managed = (kvret_py_dlmanaged*)PyCapsule_GetPointer(capsule, "dltensor");
    if (kvret_py_from_dltensor(&managed->dl_tensor, name, out) != 0) return -1;
  } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    kvret_py_dlmanaged_versioned* managed =
        (kvret_py_dlmanaged_versioned*)PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (writable && (managed->flags & KVRET_PY_DLPACK_READ_ONLY) != 0) {
      PyErr_Format(PyExc_ValueError, "kvret: output %s is read-only", name);
      return -1;
    }
    if (kvret_py_from_dltensor(&managed->dl_tensor, name, out) != 0) return -1;
  } else {
    PyErr_Format(PyExc_TypeError, "kvret: %s is a capsule that holds no unconsumed DLPack tensor", name);
    return -1;
  }
  /* Not consumed: the capsule's own destructor calls the deleter once the call no longer needs the memory. */
  Py_INCREF(capsule);
  out->owner = capsule;
  return 0;
}

/* (data, shape, strides or None, (code, bits), (device_type, device_id)[, owner]), e.g. from
 * __cuda_array_interface__; the optional owner (the object that holds the memory) is kept alive for the call. */
static int kvret_py_from_tuple(PyObject* tuple, const char* name, kvret_py_tensor* out) {
  PyObject *data, *shape, *strides, *owner = NULL;
  int code, bits, device_type, device_id;
  if (!PyArg_ParseTuple(tuple, "OOO(ii)(ii)|O", &data, &shape, &strides, &code, &bits, &device_type, &device_id,
                        &owner)) {
    return -1;
  }
  Py_ssize_t ndim = PySequence_Size(shape);
  if (ndim < 0) return -1;
  if (ndim > KVRET_PY_MAX_NDIM) {
    PyErr_Format(PyExc_ValueError, "kvret: %s has too many dimensions", name);
    return -1;
  }
  out->tensor.data = PyLong_AsVoidPtr(data);
  if (PyErr_Occurred()) return -1;
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    PyObject* item = PySequence_GetItem(shape, i);
    if (item == NULL) return -1;
    out->shape[i] = (int64_t)PyLong_AsLongLong(item);
    Py_DECREF(item);
    if (PyErr_Occurred()) return -1;
  }
  out->tensor.strides = NULL;
  if (strides != Py_None) {
    if (PySequence_Size(strides) != ndim) {
      PyErr_Format(PyExc_ValueError, "kvret: %s has strides of the wrong length", name);
      return -1;
    }
    for (Py_ssize_t i = 0; i < ndim; ++i) {
      PyObject* item = PySequence_GetItem(strides, i);
      if (item == NULL) return -1;
      out->strides[i] = (int64_t)PyLong_AsLongLong(item);
      Py_DECREF(item);
      if (PyErr_Occurred()) return -1;
    }
    out->tensor.strides = out->strides;
  }
  out->tensor.ndim = (int32_t)ndim;
  out->tensor.shape = out->shape;
  out->tensor.dtype.code = (uint8_t)code;
  out->tensor.dtype.bits = (uint8_t)bits;
  out->tensor.dtype.lanes = 1;
  out->tensor.device.device_type = device_type;
  out->tensor.device.device_id = device_id;
  out->tensor.byte_offset = 0;
  Py_XINCREF(owner);
  out->owner = owner;
  return 0;
}

/** Fills *out from obj; 0 on success, -1 with a Python exception set. */
static int kvret_py_tensor_from(PyObject* obj, int writable, const char* name, kvret_py_tensor* out) {
  memset(out, 0, sizeof(*out));
  if (PyArray_Check(obj)) return kvret_py_from_numpy(obj, writable, name, out);
  if (PyCapsule_CheckExact(obj)) return kvret_py_from_capsule(obj, writable, name, out);
  if (PyTuple_Check(obj)) return kvret_py_from_tuple(obj, name, out);
  PyErr_Format(PyExc_TypeError, "kvret: %s must be a NumPy array, a DLPack capsule or a descriptor tuple, not %s",
               name, Py_TYPE(obj)->tp_name);
  return -1;
}

static void kvret_py_tensor_release(kvret_py_tensor* tensor) {
  Py_CLEAR(tensor->owner);
}

typedef struct kvret_py_working_set {
  kvret_working_set set;
  kvret_py_tensor k, v, positions;
} kvret_py_working_set;
%}

%init %{
  import_array();
%}

/* Docstrings with C types: the package reads each config field's type from its property ("n_layers : int32_t") to
 * check a value before SWIG converts it. */
%feature("autodoc", "1");

/* ---- helpers that touch Python objects: declared before %exception, so they keep the GIL ---- */
%inline %{
/** Registers the class raised for a failed call; it is called as cls(status, message). */
static PyObject* kvret_swig_set_error_class(PyObject* cls) {
  Py_XINCREF(cls);
  Py_XDECREF(kvret_py_error_class);
  kvret_py_error_class = cls;
  Py_RETURN_NONE;
}

/** The DLTensor of an unconsumed DLPack capsule, or NULL with a Python exception set. */
static const kvret_tensor* kvret_py_capsule_tensor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    return &((kvret_py_dlmanaged*)PyCapsule_GetPointer(capsule, "dltensor"))->dl_tensor;
  }
  if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    return &((kvret_py_dlmanaged_versioned*)PyCapsule_GetPointer(capsule, "dltensor_versioned"))->dl_tensor;
  }
  PyErr_SetString(PyExc_TypeError, "kvret: a capsule that holds no unconsumed DLPack tensor");
  return NULL;
}

/** What a DLPack capsule describes: (device_type, device_id, code, bits, lanes, shape, strides or None). The capsule
 *  is not consumed. */
static PyObject* kvret_swig_dlpack_info(PyObject* capsule) {
  const kvret_tensor* dl = kvret_py_capsule_tensor(capsule);
  if (dl == NULL) return NULL;
  if (dl->ndim < 0 || dl->ndim > KVRET_PY_MAX_NDIM) {
    PyErr_Format(PyExc_ValueError, "kvret: a DLPack tensor of %d dimensions (at most %d)", (int)dl->ndim,
                 KVRET_PY_MAX_NDIM);
    return NULL;
  }
  PyObject* shape = PyTuple_New(dl->ndim);
  PyObject* strides = dl->strides != NULL ? PyTuple_New(dl->ndim) : (Py_INCREF(Py_None), Py_None);
  if (shape == NULL || strides == NULL) {
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return NULL;
  }
  for (int i = 0; i < dl->ndim; ++i) {
    PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong((long long)dl->shape[i]));
    if (dl->strides != NULL) PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong((long long)dl->strides[i]));
  }
  return Py_BuildValue("(iiiiiNN)", (int)dl->device.device_type, (int)dl->device.device_id, (int)dl->dtype.code,
                       (int)dl->dtype.bits, (int)dl->dtype.lanes, shape, strides);
}

/** A read-only NumPy view of the host memory of a DLPack capsule, with the given NumPy dtype (of the tensor's
 *  element size); the view keeps the capsule, and so the memory, alive. Used to convert a DLPack input the way a
 *  NumPy input is converted. */
static PyObject* kvret_swig_dlpack_view(PyObject* capsule, PyObject* dtype) {
  const kvret_tensor* dl = kvret_py_capsule_tensor(capsule);
  if (dl == NULL) return NULL;
  if (dl->device.device_type != KVRET_DEVICE_CPU && dl->device.device_type != KVRET_DEVICE_CUDA_HOST) {
    PyErr_SetString(PyExc_ValueError, "kvret: only a DLPack tensor in host memory can be viewed");
    return NULL;
  }
  if (dl->ndim < 0 || dl->ndim > KVRET_PY_MAX_NDIM) {
    PyErr_SetString(PyExc_ValueError, "kvret: a DLPack tensor of too many dimensions");
    return NULL;
  }
  const int64_t itemsize = ((int64_t)dl->dtype.bits * (int64_t)dl->dtype.lanes + 7) / 8;
  npy_intp dims[KVRET_PY_MAX_NDIM];
  npy_intp strides[KVRET_PY_MAX_NDIM];
  for (int i = 0; i < dl->ndim; ++i) {
    dims[i] = (npy_intp)dl->shape[i];
    if (dl->strides != NULL) strides[i] = (npy_intp)(dl->strides[i] * itemsize);
  }
  PyArray_Descr* descr = NULL;
  if (!PyArray_DescrConverter(dtype, &descr)) return NULL;
  char* data = (char*)dl->data + dl->byte_offset;
  /* flags 0: read-only; NumPy computes the alignment and contiguity flags itself. Steals descr. */
  PyObject* array = PyArray_NewFromDescr(&PyArray_Type, descr, dl->ndim, dims, dl->strides != NULL ? strides : NULL,
                                         data, 0, NULL);
  if (array == NULL) return NULL;
  if ((int64_t)PyArray_ITEMSIZE((PyArrayObject*)array) != itemsize) {
    Py_DECREF(array);
    PyErr_SetString(PyExc_ValueError, "kvret: the dtype does not have the DLPack tensor's element size");
    return NULL;
  }
  Py_INCREF(capsule);
  if (PyArray_SetBaseObject((PyArrayObject*)array, capsule) != 0) {
    Py_DECREF(array);
    return NULL;
  }
  PyArray_UpdateFlags((PyArrayObject*)array, NPY_ARRAY_UPDATE_ALL & ~NPY_ARRAY_WRITEABLE);
  return array;
}
%}

/* ---- every other call runs with the GIL released ---- */
%exception {
  Py_BEGIN_ALLOW_THREADS
  $action
  Py_END_ALLOW_THREADS
}

/* ---- status: a failure raises, success returns None (or the outputs) ---- */
%typemap(out) kvret_status {
  if ($1 != KVRET_OK) {
    kvret_py_raise($1);
    SWIG_fail;
  }
  $result = SWIG_Py_Void();
}

/* ---- tensors ---- */
%typemap(in) const kvret_tensor* (kvret_py_tensor pyt = {0}) {
  if (kvret_py_tensor_from($input, 0, "$1_name", &pyt) != 0) SWIG_fail;
  $1 = &pyt.tensor;
}
%typemap(in) const kvret_tensor* out_positions (kvret_py_tensor pyt = {0}),
             const kvret_tensor* out_scores (kvret_py_tensor pyt = {0}),
             const kvret_tensor* out (kvret_py_tensor pyt = {0}) {
  if (kvret_py_tensor_from($input, 1, "$1_name", &pyt) != 0) SWIG_fail;
  $1 = &pyt.tensor;
}
%typemap(freearg) const kvret_tensor* {
  kvret_py_tensor_release(&pyt$argnum);
}
/* (k, v, positions): three writable tensors. */
%typemap(in) const kvret_working_set* out (kvret_py_working_set ws = {0}) {
  if (!PyTuple_Check($input) || PyTuple_GET_SIZE($input) != 3) {
    PyErr_SetString(PyExc_TypeError, "kvret: a working set is a tuple (k, v, positions)");
    SWIG_fail;
  }
  if (kvret_py_tensor_from(PyTuple_GET_ITEM($input, 0), 1, "k", &ws.k) != 0 ||
      kvret_py_tensor_from(PyTuple_GET_ITEM($input, 1), 1, "v", &ws.v) != 0 ||
      kvret_py_tensor_from(PyTuple_GET_ITEM($input, 2), 1, "positions", &ws.positions) != 0) {
    SWIG_fail;
  }
  ws.set.k = ws.k.tensor;
  ws.set.v = ws.v.tensor;
  ws.set.positions = ws.positions.tensor;
  $1 = &ws.set;
}
%typemap(freearg) const kvret_working_set* out {
  kvret_py_tensor_release(&ws$argnum.k);
  kvret_py_tensor_release(&ws$argnum.v);
  kvret_py_tensor_release(&ws$argnum.positions);
}

/* ---- the config's strings: None or bytes (os.fsencode of the path, the URL in UTF-8), without a NUL ---- */
%define KVRET_PY_OPTIONAL_BYTES(NAME)
%typemap(in) const char* NAME {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    char* bytes = NULL;
    Py_ssize_t size = 0;
    if (!PyBytes_Check($input) || PyBytes_AsStringAndSize($input, &bytes, &size) != 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kvret: " #NAME " must be None or bytes");
      SWIG_fail;
    }
    if ((size_t)size != strlen(bytes)) {
      PyErr_SetString(PyExc_ValueError, "kvret: " #NAME " contains a NUL character");
      SWIG_fail;
    }
    $1 = bytes;
  }
}
%enddef
KVRET_PY_OPTIONAL_BYTES(disk_path)
KVRET_PY_OPTIONAL_BYTES(session_shared_url)

/* ---- session ids: bytes without a NUL (the package encodes a str as UTF-8); the library judges the length ---- */
%{
/** The bytes of a session id, or NULL with a Python exception set. */
static const char* kvret_py_session_id(PyObject* obj, const char* name) {
  char* bytes = NULL;
  Py_ssize_t size = 0;
  if (!PyBytes_Check(obj) || PyBytes_AsStringAndSize(obj, &bytes, &size) != 0) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "kvret: %s must be bytes", name);
    return NULL;
  }
  if ((size_t)size != strlen(bytes)) {
    PyErr_Format(PyExc_ValueError, "kvret: %s contains a NUL character", name);
    return NULL;
  }
  return bytes;
}
%}
%typemap(in) const char* session_id {
  $1 = (char*)kvret_py_session_id($input, "session_id");
  if ($1 == NULL) SWIG_fail;
}
/* A sequence of them; the list (and so its items) is held until the call returns. */
%typemap(in) (const char* const* session_ids, int32_t n) (PyObject* fast = NULL, const char** id_array = NULL) {
  fast = PySequence_Fast($input, "kvret: session_ids must be a sequence of bytes");
  if (fast == NULL) SWIG_fail;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
  if (count > INT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "kvret: more session ids than an int32 counts");
    SWIG_fail;
  }
  id_array = (const char**)PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(const char*));
  if (id_array == NULL) {
    PyErr_NoMemory();
    SWIG_fail;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    id_array[i] = kvret_py_session_id(PySequence_Fast_GET_ITEM(fast, i), "session_ids[i]");
    if (id_array[i] == NULL) SWIG_fail;
  }
  $1 = ($1_ltype)id_array;
  $2 = (int32_t)count;
}
%typemap(freearg) (const char* const* session_ids, int32_t n) {
  PyMem_Free((void*)id_array$argnum);
  Py_XDECREF(fast$argnum);
}

/* ---- streams: None or an integer (a cudaStream_t value) ---- */
%typemap(in) kvret_stream {
  if ($input == Py_None) {
    $1 = NULL;
  } else {
    $1 = (kvret_stream)PyLong_AsVoidPtr($input);
    if (PyErr_Occurred()) SWIG_fail;
  }
}

/* ---- handles created by the library ---- */
%typemap(in, numinputs = 0) kvret_context** out (kvret_context* handle = NULL) {
  $1 = &handle;
}
%typemap(argout) kvret_context** out {
  $result = kvret_py_append_output($result, SWIG_NewPointerObj(*$1, $descriptor(kvret_context*), 0));
}
%typemap(in, numinputs = 0) kvret_seq** out (kvret_seq* handle = NULL) {
  $1 = &handle;
}
%typemap(argout) kvret_seq** out {
  $result = kvret_py_append_output($result, SWIG_NewPointerObj(*$1, $descriptor(kvret_seq*), 0));
}

/* ---- scalar outputs ---- */
%define KVRET_PY_SCALAR_OUT(TYPE, NAME)
%typemap(in, numinputs = 0) TYPE* NAME (TYPE value = 0) {
  $1 = &value;
}
%typemap(argout) TYPE* NAME {
  $result = kvret_py_append_output($result, PyLong_FromLongLong((long long)*$1));
}
%enddef
KVRET_PY_SCALAR_OUT(int32_t, out_count)
KVRET_PY_SCALAR_OUT(int32_t, out_budget)
KVRET_PY_SCALAR_OUT(int32_t, out_tier)
KVRET_PY_SCALAR_OUT(int64_t, out_tokens)
KVRET_PY_SCALAR_OUT(int64_t, out_rows)

/* ---- select_batch: a sequence of handles, and a writable int32 array of counts ---- */
%typemap(in) (int32_t n, kvret_seq* const* seqs) (kvret_seq** seq_array = NULL) {
  Py_ssize_t count = PySequence_Size($input);
  if (count < 0) SWIG_fail;
  seq_array = (kvret_seq**)PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(kvret_seq*));
  if (seq_array == NULL) {
    PyErr_NoMemory();
    SWIG_fail;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PySequence_GetItem($input, i);
    void* ptr = NULL;
    int res = item == NULL ? SWIG_ERROR : SWIG_ConvertPtr(item, &ptr, $descriptor(kvret_seq*), 0);
    Py_XDECREF(item);
    if (!SWIG_IsOK(res)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kvret: seqs must hold kvret_seq pointers");
      SWIG_fail;
    }
    seq_array[i] = (kvret_seq*)ptr;
  }
  $1 = (int32_t)count;
  $2 = seq_array;
}
%typemap(freearg) (int32_t n, kvret_seq* const* seqs) {
  PyMem_Free(seq_array$argnum);
}
%typemap(in) int32_t* out_counts (kvret_py_tensor pyt = {0}) {
  if (kvret_py_tensor_from($input, 1, "out_counts", &pyt) != 0) SWIG_fail;
  /* The stride of an array of 0 or 1 entries says nothing (NumPy gives an empty array the stride 0). */
  if (pyt.tensor.device.device_type != KVRET_DEVICE_CPU || pyt.tensor.dtype.code != KVRET_DTYPE_INT ||
      pyt.tensor.dtype.bits != 32 || pyt.tensor.ndim != 1 ||
      (pyt.tensor.strides != NULL && pyt.tensor.shape[0] > 1 && pyt.tensor.strides[0] != 1)) {
    PyErr_SetString(PyExc_TypeError, "kvret: out_counts must be a contiguous 1-D int32 NumPy array");
    SWIG_fail;
  }
  $1 = (int32_t*)pyt.tensor.data;
}
%typemap(freearg) int32_t* out_counts {
  kvret_py_tensor_release(&pyt$argnum);
}

/* ---- fetch_batch: int32 counts and int64 row counts (1-D NumPy arrays of n entries), and a sequence of n working
 * sets (k, v, positions). n is the call's second argument (the length of seqs). ---- */
%define KVRET_PY_VECTOR(CTYPE, NAME, WRITABLE, CODE, BITS, WHAT)
%typemap(in) CTYPE* NAME (kvret_py_tensor pyt = {0}) {
  if (kvret_py_tensor_from($input, WRITABLE, "NAME", &pyt) != 0) SWIG_fail;
  if (pyt.tensor.device.device_type != KVRET_DEVICE_CPU || pyt.tensor.dtype.code != CODE ||
      pyt.tensor.dtype.bits != BITS || pyt.tensor.ndim != 1 ||
      (pyt.tensor.strides != NULL && pyt.tensor.shape[0] > 1 && pyt.tensor.strides[0] != 1)) {
    PyErr_SetString(PyExc_TypeError, "kvret: " #NAME " must be a contiguous 1-D " WHAT " NumPy array");
    SWIG_fail;
  }
  $1 = ($1_ltype)pyt.tensor.data;
}
%typemap(check) CTYPE* NAME {
  if (pyt$argnum.tensor.shape[0] != (int64_t)arg2) {
    PyErr_SetString(PyExc_ValueError, "kvret: " #NAME " must have one entry per sequence");
    SWIG_fail;
  }
}
%typemap(freearg) CTYPE* NAME {
  kvret_py_tensor_release(&pyt$argnum);
}
%enddef
KVRET_PY_VECTOR(const int32_t, counts, 0, KVRET_DTYPE_INT, 32, "int32")
KVRET_PY_VECTOR(int64_t, out_row_counts, 1, KVRET_DTYPE_INT, 64, "int64")

%typemap(in) const kvret_working_set* outs (kvret_py_working_set* py_sets = NULL, kvret_working_set* sets = NULL,
                                            Py_ssize_t n_sets = 0) {
  n_sets = PySequence_Check($input) ? PySequence_Size($input) : -1;
  if (n_sets < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kvret: outs must be a sequence of (k, v, positions)");
    SWIG_fail;
  }
  py_sets = (kvret_py_working_set*)PyMem_Calloc(n_sets > 0 ? (size_t)n_sets : 1, sizeof(kvret_py_working_set));
  sets = (kvret_working_set*)PyMem_Calloc(n_sets > 0 ? (size_t)n_sets : 1, sizeof(kvret_working_set));
  if (py_sets == NULL || sets == NULL) {
    PyErr_NoMemory();
    SWIG_fail;
  }
  for (Py_ssize_t i = 0; i < n_sets; ++i) {
    PyObject* item = PySequence_GetItem($input, i);
    int ok = item != NULL && PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3;
    if (ok) {
      ok = kvret_py_tensor_from(PyTuple_GET_ITEM(item, 0), 1, "k", &py_sets[i].k) == 0 &&
           kvret_py_tensor_from(PyTuple_GET_ITEM(item, 1), 1, "v", &py_sets[i].v) == 0 &&
           kvret_py_tensor_from(PyTuple_GET_ITEM(item, 2), 1, "positions", &py_sets[i].positions) == 0;
    } else if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "kvret: each of outs is a tuple (k, v, positions)");
    }
    Py_XDECREF(item);
    if (!ok) SWIG_fail;
    sets[i].k = py_sets[i].k.tensor;
    sets[i].v = py_sets[i].v.tensor;
    sets[i].positions = py_sets[i].positions.tensor;
  }
  $1 = sets;
}
%typemap(check) const kvret_working_set* outs {
  if (n_sets$argnum != (Py_ssize_t)arg2) {
    PyErr_SetString(PyExc_ValueError, "kvret: outs must have one working set per sequence");
    SWIG_fail;
  }
}
%typemap(freearg) const kvret_working_set* outs {
  for (Py_ssize_t i = 0; py_sets$argnum != NULL && i < n_sets$argnum; ++i) {
    kvret_py_tensor_release(&py_sets$argnum[i].k);
    kvret_py_tensor_release(&py_sets$argnum[i].v);
    kvret_py_tensor_release(&py_sets$argnum[i].positions);
  }
  PyMem_Free(py_sets$argnum);
  PyMem_Free(sets$argnum);
}

%include "kvret_common.i"
