"""Arrays other than NumPy: DLPack producers, __cuda_array_interface__, PyTorch, ml_dtypes."""

import ctypes

import numpy as np
import pytest
from conftest import GEOMETRY, TOKENS, make_context, random_kv

import kvret

N_Q, N_KV, D = GEOMETRY["n_q_heads"], GEOMETRY["n_kv_heads"], GEOMETRY["head_dim"]


class DLPackOnly:
    """Exposes an array only through the DLPack protocol, as PyTorch, CuPy or JAX would."""

    def __init__(self, array):
        self.array = array
        self.shape = array.shape

    def __dlpack__(self, stream=None, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __getitem__(self, index):  # results are views of the outputs
        return self.array[index]


class FakeCudaArray:
    def __init__(self, shape, typestr="<f4"):
        self.shape = shape
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (0x10000, False), "version": 3}


def test_dlpack_inputs_and_outputs(sequence, rng):
    k, v = random_kv(rng)
    sequence.append_prefill(0, DLPackOnly(k), DLPackOnly(v))
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    out = np.zeros((N_KV, 32), np.int32)
    positions = sequence.select(0, DLPackOnly(q), budget=32, out=DLPackOnly(out))
    assert np.shares_memory(positions, out)
    np.testing.assert_array_equal(out, sequence.select(0, q, budget=32))
    ws = sequence.fetch(0, out)
    np.testing.assert_array_equal(ws.k[0], k[ws.positions[0], 0])


def test_cuda_array_interface_maps_to_a_cuda_tensor(sequence):
    # A CPU context cannot read device memory: the library rejects the descriptor, so the mapping is visible.
    fake = FakeCudaArray((TOKENS, N_KV, D))
    with pytest.raises(kvret.KvretError) as info:
        sequence.append_prefill(0, fake, fake)
    assert info.value.status == kvret.Status.DEVICE


def test_raw_descriptor_tuple(sequence, rng):
    k, v = random_kv(rng)
    from kvret.tensors import Descriptor

    descriptor = lambda a: Descriptor(a.ctypes.data, a.shape, None, (kvret.kvret_swig.KVRET_DTYPE_FLOAT, 32), (1, 0))
    sequence.append_prefill(0, descriptor(k), descriptor(v))
    np.testing.assert_array_equal(sequence.read(0, 0, TOKENS)[0], k)


def test_streams_accept_ints_and_stream_objects():
    from kvret.tensors import stream_handle

    class TorchLikeStream:
        cuda_stream = 1234

    assert stream_handle(None) is None and stream_handle(5) == 5 and stream_handle(TorchLikeStream()) == 1234
    with pytest.raises(TypeError):
        stream_handle("default")


def test_torch_cpu_tensors(sequence, rng):
    torch = pytest.importorskip("torch")
    k, v = (torch.from_numpy(x) for x in random_kv(rng))
    sequence.append_prefill(0, k, v)
    q = torch.randn(N_Q, D)
    ws = sequence.fetch(0, sequence.select(0, q))
    out = sequence.context.attend(q, torch.from_numpy(ws.k), torch.from_numpy(ws.v))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(ws.k[0], k.numpy()[ws.positions[0], 0])


# ---- one contract for NumPy and DLPack inputs (docs/bindings.md): keys, values and queries float16, bfloat16 or
# float32 (other floats converted to float32; integers, booleans and complex refused with TypeError); positions int32
# (other integers converted when they fit, else KvretError OUT_OF_RANGE; floats and booleans refused); an innermost
# stride that is not 1 copied to a contiguous array. ----

KVRET_DTYPE_BFLOAT = kvret.kvret_swig.KVRET_DTYPE_BFLOAT


class RetaggedDLPack(DLPackOnly):
    """Exposes the memory of `array` through DLPack under another dtype code, as PyTorch exports a bfloat16 tensor
    (NumPy cannot export bfloat16 itself): bfloat16 from the bits in a uint16 array."""

    def __init__(self, array, code):
        super().__init__(array)
        self.code = code

    def __dlpack__(self, stream=None, **kwargs):
        capsule = self.array.__dlpack__()
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        managed = get_pointer(capsule, b"dltensor")
        ctypes.c_uint8.from_address(managed + 20).value = self.code  # DLTensor: data, device, ndim, dtype.code
        return capsule


def bf16_bits(x):
    """The bfloat16 bits of float32 values (truncated), and the float32 values they stand for."""
    bits = (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def as_bfloat16(bits, path):
    if path == "dlpack":
        return RetaggedDLPack(bits, KVRET_DTYPE_BFLOAT)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return bits.view(ml_dtypes.bfloat16)


def strided(x):
    """x's values in an array whose innermost stride is 2."""
    wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def heads_first(x):
    """x's values, [T, n_kv_heads, head_dim] as a view of [n_kv_heads, T, head_dim] memory (no copy needed)."""
    return np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1) if x.ndim == 3 else x


# name: (how the float32 values become the input, the float32 values the library must see or the error)
FLOAT_CASES = {
    "float32": (lambda x: x, lambda x: x),
    "float16": (lambda x: x.astype(np.float16), lambda x: x.astype(np.float16).astype(np.float32)),
    "float64": (lambda x: x.astype(np.float64), lambda x: x),
    "float32, innermost stride 2": (strided, lambda x: x),
    "float16, innermost stride 2": (lambda x: strided(x.astype(np.float16)), lambda x: x.astype(np.float16)),
    "float64, innermost stride 2": (lambda x: strided(x.astype(np.float64)), lambda x: x),
    "float32, innermost stride -1": (lambda x: x[..., ::-1].copy()[..., ::-1], lambda x: x),
    "float32, heads-first memory": (heads_first, lambda x: x),
    "bfloat16": ("bf16", lambda x: bf16_bits(x)[1]),
    "bfloat16, innermost stride 2": ("bf16 strided", lambda x: bf16_bits(x)[1]),
    "int32": (lambda x: x.astype(np.int32), TypeError),
    "int8": (lambda x: x.astype(np.int8), TypeError),
    "uint16": (lambda x: x.astype(np.uint16), TypeError),
    "bool": (lambda x: x > 0, TypeError),
    "complex64": (lambda x: x.astype(np.complex64), TypeError),
}


def float_input(case, x, path):
    make = FLOAT_CASES[case][0]
    if make == "bf16":
        return as_bfloat16(bf16_bits(x)[0], path)
    if make == "bf16 strided":
        return as_bfloat16(strided(bf16_bits(x)[0]), path)
    array = make(x)
    return DLPackOnly(array) if path == "dlpack" else array


def outcome(call):
    """The result of call(), or the error it raised as (type, status)."""
    try:
        return call()
    except (TypeError, ValueError, kvret.KvretError) as error:
        return type(error), getattr(error, "status", None)


@pytest.mark.parametrize("case", list(FLOAT_CASES))
def test_keys_values_and_queries_follow_one_contract_through_numpy_and_dlpack(context, rng, case):
    k, v = random_kv(rng, tokens=64)
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    expected = FLOAT_CASES[case][1]
    results = {}
    for path in ("numpy", "dlpack"):
        with context.open_sequence() as seq:

            def run():
                seq.append_prefill(0, float_input(case, k, path), float_input(case, v, path))
                seq.append_decode(0, float_input(case, k[0], path), float_input(case, v[0], path))
                stored = seq.read(0, 0, 65)
                return stored, seq.select(0, float_input(case, q, path), budget=8)

            results[path] = outcome(run)
    if isinstance(expected, type):
        assert results["numpy"] == results["dlpack"] == (expected, None), results
        return
    for path, (stored, positions) in results.items():
        np.testing.assert_array_equal(stored[0][:64], expected(k), err_msg=path)
        np.testing.assert_array_equal(stored[1][64], expected(v[0]), err_msg=path)
    np.testing.assert_array_equal(results["numpy"][1], results["dlpack"][1])
    with context.open_sequence() as reference:
        reference.append_prefill(0, expected(k), expected(v))
        reference.append_decode(0, expected(k[0]), expected(v[0]))
        np.testing.assert_array_equal(results["numpy"][1], reference.select(0, expected(q), budget=8))


# name: (how int64 positions become the input, the error or None)
POSITION_CASES = {
    "int32": (lambda p: p.astype(np.int32), None),
    "int64": (lambda p: p, None),
    "uint16": (lambda p: p.astype(np.uint16), None),
    "int32, innermost stride 2": (lambda p: strided(p.astype(np.int32)), None),
    "int64 past int32": (lambda p: p + 2**32, (kvret.KvretError, kvret.Status.OUT_OF_RANGE)),
    "uint64 past int32": (lambda p: p.astype(np.uint64) + 2**63, (kvret.KvretError, kvret.Status.OUT_OF_RANGE)),
    "float32": (lambda p: p.astype(np.float32), (TypeError, None)),
    "float64": (lambda p: p.astype(np.float64), (TypeError, None)),
    "bool": (lambda p: p > 0, (TypeError, None)),
}


@pytest.mark.parametrize("case", list(POSITION_CASES))
def test_positions_follow_one_contract_through_numpy_and_dlpack(sequence, rng, case):
    sequence.append_prefill(0, *random_kv(rng))
    selected = sequence.select(0, rng.standard_normal((N_Q, D), dtype=np.float32), budget=8)
    make, error = POSITION_CASES[case]
    positions = make(selected.astype(np.int64))
    results = {
        path: outcome(lambda: sequence.fetch(0, wrap(positions)).positions.copy())
        for path, wrap in (("numpy", lambda p: p), ("dlpack", DLPackOnly))
    }
    if error is not None:
        assert results["numpy"] == results["dlpack"] == error, results
        return
    for path, rows in results.items():
        np.testing.assert_array_equal(rows, sequence.fetch(0, selected).positions, err_msg=path)


@pytest.mark.parametrize(
    "case, status",
    [
        ("int32", None),
        ("int64", kvret.Status.DTYPE),
        ("bool", kvret.Status.DTYPE),
        ("int32, innermost stride 2", kvret.Status.STRIDE),
    ],
)
def test_outputs_are_used_as_given_through_numpy_and_dlpack(sequence, rng, case, status):
    sequence.append_prefill(0, *random_kv(rng))
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    make = {
        "int32": lambda: np.zeros((N_KV, 8), np.int32),
        "int64": lambda: np.zeros((N_KV, 8), np.int64),
        "bool": lambda: np.zeros((N_KV, 8), bool),
        "int32, innermost stride 2": lambda: np.zeros((N_KV, 16), np.int32)[:, ::2],
    }[case]
    for wrap in (lambda a: a, DLPackOnly):
        out = make()
        got = outcome(lambda: sequence.select(0, q, budget=8, out=wrap(out)))
        if status is None:
            np.testing.assert_array_equal(got, sequence.select(0, q, budget=8))
            assert np.shares_memory(got, out)
        else:
            assert got == (kvret.KvretError, status)
            assert not out.any()


def test_ml_dtypes_bfloat16_arrays(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with make_context(kv_dtype="bf16") as ctx, ctx.open_sequence() as seq:
        k, v = (x.astype(ml_dtypes.bfloat16) for x in random_kv(rng))
        seq.append_prefill(0, k, v)
        np.testing.assert_array_equal(seq.read(0, 0, TOKENS, dtype=np.float32)[0], k.astype(np.float32))
        np.testing.assert_array_equal(seq.read(0, 0, TOKENS, dtype=ml_dtypes.bfloat16)[1], v)
        q = rng.standard_normal((N_Q, D), dtype=np.float32).astype(ml_dtypes.bfloat16)
        positions = seq.select(0, q)
        np.testing.assert_array_equal(positions, seq.select(0, q.astype(np.float32)))
        ws = seq.fetch(0, positions, dtype=ml_dtypes.bfloat16)  # the store's own dtype, no conversion
        assert ws.k.dtype == ml_dtypes.bfloat16
        for head in range(N_KV):
            np.testing.assert_array_equal(ws.k[head], k[ws.positions[head], head])
        out = ctx.attend(q, ws.k, ws.v)
        np.testing.assert_allclose(
            out,
            ctx.attend(q.astype(np.float32), ws.k.astype(np.float32), ws.v.astype(np.float32)),
            rtol=1e-6,
            atol=1e-6,
        )
