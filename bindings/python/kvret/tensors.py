"""Mapping array objects onto kvret tensor descriptors, without copies where the layout allows.

Accepted everywhere a tensor goes in or out:
  * NumPy arrays (zero-copy; inputs of another float dtype are converted to float32, inputs whose innermost stride is
    not 1 are made contiguous, outputs are used as given);
  * objects with ``__dlpack__`` (PyTorch, CuPy, JAX, ...): the DLPack capsule is handed to the extension, which
    reads the DLTensor in place (kvret_tensor is layout-identical to it);
  * objects with ``__cuda_array_interface__`` (Numba, CuPy, ...);
  * a :class:`Descriptor` for memory that no array object describes (e.g. a pointer from another library).
"""

import collections

import numpy as np

from . import kvret_swig as _c
from .errors import KvretError, Status

DEVICE_CPU = _c.KVRET_DEVICE_CPU
DEVICE_CUDA = _c.KVRET_DEVICE_CUDA
DEVICE_CUDA_HOST = _c.KVRET_DEVICE_CUDA_HOST

_FLOAT_INPUTS = ("float16", "float32", "bfloat16")
_DTYPE_CODES = {"f": _c.KVRET_DTYPE_FLOAT, "i": _c.KVRET_DTYPE_INT, "u": _c.KVRET_DTYPE_UINT}


Descriptor = collections.namedtuple("Descriptor", ["data", "shape", "strides", "dtype", "device"])
Descriptor.__doc__ = """A raw tensor: data (an int address), shape, strides (in elements, or None for row-major),
dtype (code, bits) with a KVRET_DTYPE_* code, device (device_type, device_id)."""


def stream_handle(stream):
    """None, an int (a cudaStream_t value), a torch.cuda.Stream or a cupy Stream -> None or an int."""
    if stream is None or isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"kvret: cannot use {type(stream).__name__} as a CUDA stream")


def _numpy_input(array, kind):
    if kind == "float" and array.dtype.name not in _FLOAT_INPUTS:
        if array.dtype.kind != "f":  # integers, booleans, complex: refused, never converted
            raise TypeError(
                f"kvret: keys, values and queries must be floating point (float16, bfloat16 or float32; other float "
                f"dtypes are converted to float32), got {array.dtype}"
            )
        array = array.astype(np.float32)
    elif kind == "int32" and array.dtype != np.int32:
        if array.dtype.kind not in "iu":  # floats are not rounded to positions, booleans are not positions
            raise TypeError(f"kvret: positions must be integers, got {array.dtype}")
        if array.size and (int(array.min()) < -(2**31) or int(array.max()) >= 2**31):
            bad = int(array.max()) if int(array.max()) >= 2**31 else int(array.min())
            raise KvretError(Status.OUT_OF_RANGE, f"positions: {bad} does not fit an int32 position")
        array = array.astype(np.int32)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.aligned or (array.ndim > 0 and array.shape[-1] > 1 and array.strides[-1] != array.itemsize):
        array = np.ascontiguousarray(array)
    return array


def _from_dlpack(obj, stream):
    device_type, _ = obj.__dlpack_device__()
    if device_type == DEVICE_CUDA and stream is not None:
        return obj.__dlpack__(stream=stream)
    return obj.__dlpack__()


def _from_cuda_array_interface(interface, device_id):
    dtype = np.dtype(interface["typestr"])
    if dtype.kind not in _DTYPE_CODES:
        raise TypeError(f"kvret: unsupported __cuda_array_interface__ typestr {interface['typestr']!r}")
    strides = interface.get("strides")
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            raise ValueError("kvret: a stride is not a whole number of elements")
        strides = tuple(s // dtype.itemsize for s in strides)
    return (
        interface["data"][0],
        tuple(interface["shape"]),
        strides,
        (_DTYPE_CODES[dtype.kind], dtype.itemsize * 8),
        (DEVICE_CUDA, device_id),
    )


def as_input(obj, kind="float", stream=None, device_id=0):
    """A tensor argument for data kvret reads. kind: "float" (keys, values, queries) or "int32" (positions)."""
    if isinstance(obj, np.ndarray):
        return _numpy_input(obj, kind)
    if isinstance(obj, Descriptor):
        return tuple(obj)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, stream)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_cuda_array_interface(interface, device_id)
    return _numpy_input(np.asarray(obj), kind)


def as_output(obj, stream=None, device_id=0):
    """A tensor argument kvret writes into: used exactly as given (never copied)."""
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, Descriptor):
        return tuple(obj)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, stream)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_cuda_array_interface(interface, device_id)
    raise TypeError(f"kvret: cannot write into {type(obj).__name__}; pass a NumPy array or a DLPack tensor")


def _framework(obj):
    if obj is None or isinstance(obj, np.ndarray):
        return None
    root = type(obj).__module__.split(".")[0]
    return root if root in ("torch", "cupy") else None


def empty(shape, dtype, device_type=DEVICE_CPU, device_id=0, like=None):
    """An uninitialized array for kvret to fill: on the CPU a NumPy array (a PyTorch tensor when `like` is one); on a
    CUDA device a tensor of the framework of `like`, else of the first of PyTorch and CuPy that imports."""
    dtype = np.dtype(dtype)
    framework = _framework(like)
    if device_type != DEVICE_CUDA:
        if framework == "torch":
            import torch

            return torch.empty(shape, dtype=getattr(torch, dtype.name))
        return np.empty(shape, dtype=dtype)
    if framework != "cupy":
        try:
            import torch

            return torch.empty(shape, dtype=getattr(torch, dtype.name), device=torch.device("cuda", device_id))
        except ImportError:
            pass
    try:
        import cupy
    except ImportError:
        raise RuntimeError("kvret: a CUDA context needs PyTorch or CuPy to allocate its outputs; pass out=") from None
    with cupy.cuda.Device(device_id):
        return cupy.empty(shape, dtype=dtype)
