"""Mapping array objects onto kvret tensor descriptors, without copies where the layout allows.

Accepted everywhere a tensor goes in or out:
  * NumPy arrays (zero-copy), ml_dtypes.bfloat16 arrays included;
  * objects with ``__dlpack__`` (PyTorch, CuPy, JAX, ...): the DLPack capsule is handed to the extension, which
    reads the DLTensor in place (kvret_tensor is layout-identical to it);
  * objects with ``__cuda_array_interface__`` (Numba, CuPy, ...);
  * a :class:`Descriptor` for memory that no array object describes (e.g. a pointer from another library).

Inputs follow one contract, whichever way they come (NumPy or DLPack): keys, values and queries are float16, bfloat16
or float32; another float dtype is converted to float32, an integer, boolean or complex one is refused (TypeError).
Positions are int32; another integer dtype is converted when every value fits (else KvretError, OUT_OF_RANGE), a
float or boolean one is refused (TypeError). An input whose innermost stride is not 1 is copied to a contiguous one.
Conversions and copies happen in host memory only: a device tensor that would need one is refused (KvretError,
DTYPE or STRIDE). Outputs are used exactly as given (the library refuses a wrong dtype or layout).
"""

import collections

import numpy as np

from . import _args
from . import kvret_swig as _c
from .errors import KvretError, Status

DEVICE_CPU = _c.KVRET_DEVICE_CPU
DEVICE_CUDA = _c.KVRET_DEVICE_CUDA
DEVICE_CUDA_HOST = _c.KVRET_DEVICE_CUDA_HOST

_DTYPE_CODES = {"f": _c.KVRET_DTYPE_FLOAT, "i": _c.KVRET_DTYPE_INT, "u": _c.KVRET_DTYPE_UINT}
_DLPACK_COMPLEX, _DLPACK_BOOL = 5, 6  # kDLComplex, kDLBool
_DTYPE_NAMES = {
    _c.KVRET_DTYPE_FLOAT: "float",
    _c.KVRET_DTYPE_INT: "int",
    _c.KVRET_DTYPE_UINT: "uint",
    _c.KVRET_DTYPE_BFLOAT: "bfloat",
    _DLPACK_COMPLEX: "complex",
    _DLPACK_BOOL: "bool",
}
_HOST = (DEVICE_CPU, DEVICE_CUDA_HOST)
# The NumPy dtype that views a DLPack input for its conversion.
_VIEW_TYPES = {
    (code, np.dtype(t).itemsize * 8): np.dtype(t)
    for code, types in (
        (_c.KVRET_DTYPE_FLOAT, (np.float16, np.float32, np.float64)),
        (_c.KVRET_DTYPE_INT, (np.int8, np.int16, np.int32, np.int64)),
        (_c.KVRET_DTYPE_UINT, (np.uint8, np.uint16, np.uint32, np.uint64)),
    )
    for t in types
}


Descriptor = collections.namedtuple("Descriptor", ["data", "shape", "strides", "dtype", "device"])
Descriptor.__doc__ = """A raw tensor: data (an int address), shape, strides (in elements, or None for row-major),
dtype (code, bits) with a KVRET_DTYPE_* code, device (device_type, device_id)."""


def stream_handle(stream):
    """None, an int (a cudaStream_t value), a torch.cuda.Stream or a cupy Stream -> None or an int."""
    if stream is None:
        return None
    if not isinstance(stream, int):
        for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
            value = getattr(stream, attribute, None)
            if isinstance(value, int):
                stream = value
                break
        else:
            raise TypeError(f"kvret: cannot use {type(stream).__name__} as a CUDA stream")
    return _args.integer(stream, "stream", (0, 2**64 - 1), "a cudaStream_t")


def _numpy_code(dtype):
    """(code, bits) of a NumPy dtype as DLPack would describe it, or None for one DLPack has no code for."""
    if dtype.kind in _DTYPE_CODES:
        return _DTYPE_CODES[dtype.kind], dtype.itemsize * 8
    if dtype.kind == "b":
        return _DLPACK_BOOL, 8
    if dtype.kind == "c":
        return _DLPACK_COMPLEX, dtype.itemsize * 8
    if dtype.itemsize == 2 and dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return _c.KVRET_DTYPE_BFLOAT, 16
    if dtype.type.__module__ == "ml_dtypes" and dtype.name.startswith("float"):  # float8_*, float6_*, float4_*
        return _c.KVRET_DTYPE_FLOAT, dtype.itemsize * 8
    return None


def _dtype_plan(kind, code, bits, describe):
    """What an input of dtype (code, bits) needs: "ok" (passed as it is) or "convert" (to float32 / int32); refused
    dtypes raise TypeError. One rule for NumPy and DLPack inputs."""
    if kind == "float":
        if (code, bits) in ((_c.KVRET_DTYPE_FLOAT, 16), (_c.KVRET_DTYPE_FLOAT, 32), (_c.KVRET_DTYPE_BFLOAT, 16)):
            return "ok"
        if code == _c.KVRET_DTYPE_FLOAT:
            return "convert"
        raise TypeError(
            f"kvret: keys, values and queries must be floating point (float16, bfloat16 or float32; other float "
            f"dtypes are converted to float32), got {describe()}"
        )
    if (code, bits) == (_c.KVRET_DTYPE_INT, 32):
        return "ok"
    if code in (_c.KVRET_DTYPE_INT, _c.KVRET_DTYPE_UINT):
        return "convert"
    raise TypeError(f"kvret: positions must be integers, got {describe()}")  # never rounded, booleans are not


def _to_int32_positions(array):
    if array.dtype != np.int32:
        if array.size and (int(array.min()) < -(2**31) or int(array.max()) >= 2**31):
            bad = int(array.max()) if int(array.max()) >= 2**31 else int(array.min())
            raise KvretError(Status.OUT_OF_RANGE, f"positions: {bad} does not fit an int32 position")
        array = array.astype(np.int32)
    return array


def _numpy_input(array, kind):
    code, bits = _numpy_code(array.dtype) or (None, 0)
    if _dtype_plan(kind, code, bits, lambda: str(array.dtype)) == "convert":
        array = array.astype(np.float32) if kind == "float" else _to_int32_positions(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.aligned or (array.ndim > 0 and array.shape[-1] > 1 and array.strides[-1] != array.itemsize):
        array = np.ascontiguousarray(array)
    return array


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _plan(kind, code, bits, lanes, shape, strides, describe):
    """(dtype plan, whether the innermost stride needs a copy) of a described input."""
    plan = _dtype_plan(kind, code if lanes == 1 else None, bits, describe)
    strided = strides is not None and len(shape) > 0 and shape[-1] > 1 and strides[-1] != 1
    return plan, strided


def _refuse_device_copy(kind, plan):
    """A device tensor that would need a conversion or a copy: refused (kvret converts only in host memory)."""
    if plan == "ok":
        raise KvretError(
            Status.STRIDE, "an input in device memory must have a contiguous innermost dimension (stride 1)"
        )
    wanted = "float16, bfloat16 or float32" if kind == "float" else "int32"
    raise KvretError(Status.DTYPE, f"an input in device memory must be {wanted} (kvret converts host memory only)")


def _dlpack_input(capsule, kind):
    """A DLPack input under the contract of a NumPy one: the capsule itself when it qualifies, else a converted (or
    contiguous) copy made in host memory."""
    device_type, _, code, bits, lanes, shape, strides = _c.kvret_swig_dlpack_info(capsule)
    describe = lambda: f"a DLPack tensor of {_DTYPE_NAMES.get(code, code)}{bits} x {lanes}"  # noqa: E731
    plan, strided = _plan(kind, code, bits, lanes, shape, strides, describe)
    if plan == "ok" and not strided:
        return capsule
    if device_type not in _HOST:
        _refuse_device_copy(kind, plan)
    if code == _c.KVRET_DTYPE_BFLOAT:  # bf16 is only copied to a contiguous layout
        bfloat16 = _bfloat16()
        if bfloat16 is not None:
            return np.ascontiguousarray(_c.kvret_swig_dlpack_view(capsule, bfloat16))
        copy = np.ascontiguousarray(_c.kvret_swig_dlpack_view(capsule, np.uint16))
        return (copy.ctypes.data, copy.shape, None, (code, bits), (DEVICE_CPU, 0), copy)  # the copy lives for the call
    view_type = _VIEW_TYPES.get((code, bits))
    if view_type is None:
        raise KvretError(Status.DTYPE, f"kvret cannot convert {describe()}")
    return _numpy_input(_c.kvret_swig_dlpack_view(capsule, view_type), kind)


def _from_dlpack(obj, stream):
    device_type, _ = obj.__dlpack_device__()
    if device_type == DEVICE_CUDA and stream is not None:
        return obj.__dlpack__(stream=stream)
    return obj.__dlpack__()


def shape_of(tensor):
    """The shape of what as_input returned (an array, a DLPack capsule or a descriptor tuple)."""
    if isinstance(tensor, np.ndarray):
        return tensor.shape
    if isinstance(tensor, tuple):
        return tuple(tensor[1])
    return tuple(_c.kvret_swig_dlpack_info(tensor)[5])


def _from_cuda_array_interface(interface, device_id, kind=None):
    """A descriptor tuple of device memory; for an input (kind given), checked as a device DLPack input is."""
    dtype = np.dtype(interface["typestr"])
    code, bits = _numpy_code(dtype) or (None, 0)
    if code is None:
        raise TypeError(f"kvret: unsupported __cuda_array_interface__ typestr {interface['typestr']!r}")
    shape = tuple(interface["shape"])
    strides = interface.get("strides")
    if strides is not None:
        if any(s % dtype.itemsize for s in strides):
            raise ValueError("kvret: a stride is not a whole number of elements")
        strides = tuple(s // dtype.itemsize for s in strides)
    if kind is not None:
        plan, strided = _plan(kind, code, bits, 1, shape, strides, lambda: f"typestr {interface['typestr']!r}")
        if plan != "ok" or strided:
            _refuse_device_copy(kind, plan)
    return (interface["data"][0], shape, strides, (code, bits), (DEVICE_CUDA, device_id))


def as_input(obj, kind="float", stream=None, device_id=0):
    """A tensor argument for data kvret reads. kind: "float" (keys, values, queries) or "int32" (positions)."""
    if isinstance(obj, np.ndarray):
        return _numpy_input(obj, kind)
    if isinstance(obj, Descriptor):
        return tuple(obj)
    if hasattr(obj, "__dlpack__"):
        return _dlpack_input(_from_dlpack(obj, stream), kind)
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is not None:
        return _from_cuda_array_interface(interface, device_id, kind)
    array = np.asarray(obj)
    if array.dtype.kind == "O":  # not numbers: an object that is no array (no __dlpack__, buffer or sequence of numbers)
        raise TypeError(
            f"kvret: expected an array (a NumPy array, a DLPack tensor such as a torch tensor, or nested sequences of "
            f"numbers), got {type(obj).__name__}"
        )
    return _numpy_input(array, kind)


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
