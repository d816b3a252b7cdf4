"""Arrays other than NumPy: DLPack producers, __cuda_array_interface__, PyTorch."""

import numpy as np
import pytest
from conftest import GEOMETRY, TOKENS, random_kv

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
