"""Context: the model geometry, index settings and stores shared by many sequences."""

import contextlib
import weakref

import numpy as np

from . import config as _config
from . import kvret_swig as _c
from . import tensors as _t
from ._resource import Resource
from .sequence import Sequence, _budget_arg, _width

_KV_NUMPY_DTYPES = {_c.KVRET_KV_F16: np.float16, _c.KVRET_KV_BF16: np.float32, _c.KVRET_KV_F32: np.float32}

STATS_FIELDS = tuple(
    name
    for name, value in vars(_c.kvret_stats).items()
    if isinstance(value, property) and name not in ("thisown", "struct_size")
)


def stats_dict(stats):
    return {name: getattr(stats, name) for name in STATS_FIELDS}


class Context(Resource):
    """A kvret context. Keyword arguments are kvret_config fields (see :mod:`kvret.config`), e.g.::

        with kvret.Context(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=64, kv_dtype="f32",
                           index_kind="exact", budget=64) as ctx:
            with ctx.open_sequence() as seq:
                ...

    Closing the context closes its open sequences first. The context's own calls are thread-safe.
    """

    def __init__(self, **config):
        cfg, disk_path = _config.make(config)
        self._handle = _c.kvret_swig_create(cfg, disk_path)
        self._sequences = weakref.WeakSet()
        effective = _c.kvret_config()
        _c.kvret_config_init(effective)
        _c.kvret_get_config(self._handle, effective)
        self._config = _config.to_dict(effective)
        self._n_q_heads = effective.n_q_heads
        self._n_kv_heads = effective.n_kv_heads
        self._head_dim = effective.head_dim
        self._device_type = effective.device_type
        self._device_id = effective.device_id
        self._kv_numpy_dtype = _KV_NUMPY_DTYPES.get(effective.kv_dtype, np.float32)

    # ---- lifetime ----
    @property
    def config(self):
        """The effective config (a dict of kvret_config fields)."""
        return dict(self._config)

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        """Closes the open sequences, waits for background work and frees the context. Closing twice is a no-op."""
        if self._handle is None:
            return
        try:
            for sequence in list(self._sequences):
                sequence.close()
        finally:
            handle, self._handle = self._handle, None
            _c.kvret_destroy(handle)

    def __repr__(self):
        if self.closed:
            return "<kvret.Context closed>"
        c = self._config
        return (
            f"<kvret.Context n_layers={c['n_layers']} n_q_heads={c['n_q_heads']} n_kv_heads={c['n_kv_heads']} "
            f"head_dim={c['head_dim']} index_kind={c['index_kind']}>"
        )

    def open_sequence(self):
        """Opens an empty sequence."""
        return Sequence(self)

    # ---- calls ----
    def attend(self, q, k, v, rows=None, scale=None, out=None, stream=None):
        """Reference attention of q [n_q_heads, head_dim] over the first `rows` rows (default: all) of k, v
        [n_kv_heads, >= rows, head_dim]. Returns out, float32 [n_q_heads, head_dim]. scale None: 1/sqrt(head_dim)."""
        if rows is None:
            rows = int(k.shape[1])
        if out is None:
            out = _t.empty((self._n_q_heads, self._head_dim), np.float32, self._device_type, self._device_id, like=q)
        stream = _t.stream_handle(stream)
        device_id = self._device_id
        _c.kvret_attend(
            self._handle,
            _t.as_input(q, stream=stream, device_id=device_id),
            _t.as_input(k, stream=stream, device_id=device_id),
            _t.as_input(v, stream=stream, device_id=device_id),
            rows,
            0.0 if scale is None else float(scale),
            _t.as_output(out, stream, device_id),
            stream,
        )
        return out

    def select_batch(self, sequences, layer, q, budget=None):
        """kvret_select for several distinct sequences of this context at once; q is [n, n_q_heads, head_dim].
        Returns one int32 [n_kv_heads, count] array of positions per sequence."""
        sequences = list(sequences)
        with contextlib.ExitStack() as locks:
            for sequence in sorted(set(sequences), key=id):
                locks.enter_context(sequence._lock)
            width = max([_width(s._handle, layer, budget) for s in sequences] + [1])
            budget_arg = _budget_arg(budget)
            out = np.empty((len(sequences), self._n_kv_heads, width), dtype=np.int32)
            counts = np.zeros(len(sequences), dtype=np.int32)
            _c.kvret_select_batch(
                self._handle,
                [s._handle for s in sequences],
                layer,
                _t.as_input(q, device_id=self._device_id),
                budget_arg,
                out,
                counts,
            )
        return [out[i, :, : counts[i]] for i in range(len(sequences))]

    def synchronize(self, stream=None):
        """Waits for the work kvret enqueued on `stream` (a no-op on the CPU backend)."""
        _c.kvret_synchronize(self._handle, _t.stream_handle(stream))

    def stats(self):
        """The context's statistics as a dict (see kvret_stats)."""
        stats = _c.kvret_stats()
        _c.kvret_stats_init(stats)
        _c.kvret_context_stats(self._handle, stats)
        return stats_dict(stats)

    # ---- helpers of Sequence ----
    def _empty_working_set(self, capacity, dtype):
        dtype = dtype or self._kv_numpy_dtype
        shape = (self._n_kv_heads, int(capacity), self._head_dim)
        return (
            _t.empty(shape, dtype, self._device_type, self._device_id),
            _t.empty(shape, dtype, self._device_type, self._device_id),
            _t.empty(shape[:2], np.int32, self._device_type, self._device_id),
        )
