"""Context: the model geometry, index settings and stores shared by many sequences."""

import contextlib
import enum
import weakref

import numpy as np

from . import _args
from . import config as _config
from . import kvret_swig as _c
from . import tensors as _t
from ._resource import Resource
from .errors import KvretError, Status
from .sequence import Sequence, WorkingSet, _width

_KV_NUMPY_DTYPES = {_c.KVRET_KV_F16: np.float16, _c.KVRET_KV_BF16: np.float32, _c.KVRET_KV_F32: np.float32}

STATS_FIELDS = tuple(
    name
    for name, value in vars(_c.kvret_stats).items()
    if isinstance(value, property) and name not in ("thisown", "struct_size")
)


def stats_dict(stats):
    return {name: getattr(stats, name) for name in STATS_FIELDS}


class SessionTier(enum.IntEnum):
    """kvret_session_tier: where a saved session is (:meth:`Context.session_tier`)."""

    NONE = _c.KVRET_TIER_NONE  # not stored: open_session gives None
    DRAM = _c.KVRET_TIER_DRAM  # host memory
    DISK = _c.KVRET_TIER_DISK  # the disk tier (config disk_path)
    SHARED = _c.KVRET_TIER_SHARED  # only in the shared tier (config session_shared_url)


class Context(Resource):
    """A kvret context. Keyword arguments are kvret_config fields, and each design's parameters as one dict (pq,
    cluster, quant, crush, session; see :mod:`kvret.config`), e.g.::

        with kvret.Context(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=64, kv_dtype="f32",
                           index_kind="pq", budget=64, pq=dict(m=8, bits=4)) as ctx:
            with ctx.open_sequence() as seq:
                ...

    Closing the context closes its open sequences first. The context's own calls are thread-safe.

    NaN and infinity are not checked by default: a non-finite query or key still selects positions and attends to
    NaN. ``check_finite=True`` refuses them with a :class:`kvret.KvretError` of status ``Status.NONFINITE``, at
    the cost of one more pass over what is appended and over every query (BENCHMARKS.md, "The cost of
    check_finite"); ``kvret.hf.KvretCache`` turns it on.
    """

    def __init__(self, **config):
        cfg, disk_path, shared_url, _params = _config.make(config)  # _params: the structs cfg points at
        self._handle = _c.kvret_swig_create(cfg, disk_path, shared_url)
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
        """The effective config: a dict of kvret_config fields, enumerated ones by name (kv_dtype "f16", index_kind
        "exact", ...) as the constructor takes them, so that Context(**ctx.config) makes a context like this one."""
        return dict(self._config)

    @property
    def closed(self):
        return self._handle is None

    def _live(self):
        """The handle; KvretError (Status.INVALID_HANDLE) once the context is closed."""
        handle = self._handle
        if handle is None:
            raise KvretError(Status.INVALID_HANDLE, "the context is closed")
        return handle

    def close(self):
        """Closes the open sequences, waits for background work and frees the context. Closing twice is a no-op."""
        if self._handle is None:
            return
        try:
            for sequence in list(self._sequences):
                sequence._close("the sequence is closed (its context was closed)")
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

    # ---- sessions across conversation turns (docs/sessions.md) ----
    def open_session(self, session_id):
        """A new :class:`Sequence` holding what :meth:`Sequence.save_session` saved under `session_id` (the same
        tokens, index and selections), or None when no session has that id (never saved, dropped, expired or
        evicted). The session stays stored. A session id is a str (encoded as UTF-8) or bytes: 1 to 255 bytes, no
        NUL. A stored session whose files fail their checks raises KvretError with Status.CORRUPT and is dropped (the
        next open gives None)."""
        session_id = _args.session_id(session_id)
        handle = self._live()
        try:
            seq = _c.kvret_session_open(handle, session_id)
        except KvretError as error:
            if error.status == Status.NOT_FOUND:
                return None
            raise
        return Sequence(self, _handle=seq)

    def drop_session(self, session_id):
        """Removes a saved session from every tier. Returns True if there was one, False if not."""
        session_id = _args.session_id(session_id)
        handle = self._live()
        try:
            _c.kvret_session_drop(handle, session_id)
        except KvretError as error:
            if error.status == Status.NOT_FOUND:
                return False
            raise
        return True

    def schedule_sessions(self, session_ids):
        """The scheduler's job queue: the ids of the sessions it will run next, in order (ids may repeat; an empty
        iterable clears it; an id need not be stored yet). It replaces the previous queue. With
        session_policy="scheduler_aware", eviction keeps the sessions needed soonest, and those of the look-ahead
        window that are on disk are read into DRAM."""
        if isinstance(session_ids, (str, bytes, bytearray, memoryview)):
            raise TypeError("kvret: session_ids must be an iterable of session ids, not a single id")
        try:
            ids = iter(session_ids)
        except TypeError:
            raise TypeError(
                f"kvret: session_ids must be an iterable of session ids, not {type(session_ids).__name__}"
            ) from None
        ids = [_args.session_id(value, f"session_ids[{i}]") for i, value in enumerate(ids)]
        handle = self._live()
        _c.kvret_session_schedule(handle, ids)

    def session_tier(self, session_id):
        """Where a saved session is now: a :class:`SessionTier` (SessionTier.NONE when there is none)."""
        session_id = _args.session_id(session_id)
        handle = self._live()
        tier = _c.kvret_session_where(handle, session_id)
        try:
            return SessionTier(tier)
        except ValueError:
            raise KvretError(Status.INTERNAL, f"kvret_session_where gave an unknown tier {tier}") from None

    def flush_sessions(self):
        """Waits until the session store's background writer has written every earlier save through to the shared
        tier, then raises the first failure, since the last flush, of the work the store does after a call has
        returned (a write-through to the shared tier; removing the files of a dropped, replaced or expired
        session), which no call reports itself."""
        _c.kvret_session_flush(self._live())

    # ---- calls ----
    def attend(self, q, k, v, rows=None, scale=None, out=None, stream=None):
        """Reference attention of q [n_q_heads, head_dim] over the first `rows` rows (default: all) of k, v
        [n_kv_heads, >= rows, head_dim]. Returns out, float32 [n_q_heads, head_dim]. scale None: 1/sqrt(head_dim)."""
        handle = self._live()
        rows = None if rows is None else _args.int64(rows, "rows")
        scale = _args.scale(scale)
        stream = _t.stream_handle(stream)
        device_id = self._device_id
        q_arg = _t.as_input(q, stream=stream, device_id=device_id)
        k_arg = _t.as_input(k, stream=stream, device_id=device_id)
        v_arg = _t.as_input(v, stream=stream, device_id=device_id)
        if rows is None:
            shape = _t.shape_of(k_arg)
            rows = shape[1] if len(shape) > 1 else 0
        if out is None:
            out = _t.empty((self._n_q_heads, self._head_dim), np.float32, self._device_type, self._device_id, like=q)
        _c.kvret_attend(handle, q_arg, k_arg, v_arg, rows, scale, _t.as_output(out, stream, device_id), stream)
        return out

    def select_batch(self, sequences, layer, q, budget=None):
        """kvret_select for several distinct sequences of this context at once; q is [n, n_q_heads, head_dim].
        Returns one int32 [n_kv_heads, count] array of positions per sequence (an empty list for no sequences)."""
        handle = self._live()
        sequences = list(sequences)
        for i, sequence in enumerate(sequences):
            if not isinstance(sequence, Sequence):
                raise TypeError(f"kvret: sequences[{i}] is a {type(sequence).__name__}, not a kvret.Sequence")
        layer = _args.layer(layer)
        budget_arg = _args.budget(budget)
        with contextlib.ExitStack() as locks:
            for sequence in sorted(set(sequences), key=id):
                locks.enter_context(sequence._lock)
            handles = [s._live(f"sequences[{i}]") for i, s in enumerate(sequences)]
            width = max([_width(h, layer, budget) for h in handles] + [1])
            out = np.empty((len(sequences), self._n_kv_heads, width), dtype=np.int32)
            counts = np.zeros(len(sequences), dtype=np.int32)
            _c.kvret_select_batch(
                handle, handles, layer, _t.as_input(q, device_id=self._device_id), budget_arg, out, counts
            )
        return [out[i, :, : counts[i]] for i in range(len(sequences))]

    def fetch_batch(self, sequences, layer, selections, outs=None, stream=None, dtype=None):
        """kvret_fetch_batch_async: Sequence.fetch for several distinct sequences of this context in one call.
        selections holds one selection per sequence (int32 [n_kv_heads, count], as select_batch returns them);
        outs, when given, one (k, v, positions) tuple per sequence to write into (else new arrays, as
        Sequence.fetch makes them). Returns one :class:`WorkingSet` per sequence, the same as Sequence.fetch of
        each. Every argument of every sequence is checked before anything is written: a bad one raises KvretError
        naming its index, and no working set is written."""
        handle = self._live()
        sequences = list(sequences)
        for i, sequence in enumerate(sequences):
            if not isinstance(sequence, Sequence):
                raise TypeError(f"kvret: sequences[{i}] is a {type(sequence).__name__}, not a kvret.Sequence")
        selections = list(selections)
        if len(selections) != len(sequences):
            raise ValueError(f"kvret: {len(selections)} selections for {len(sequences)} sequences")
        if outs is not None:
            outs = list(outs)
            if len(outs) != len(sequences):
                raise ValueError(f"kvret: {len(outs)} working sets (outs) for {len(sequences)} sequences")
            for i, out in enumerate(outs):
                if not (isinstance(out, tuple) and len(out) == 3):
                    raise TypeError(f"kvret: outs[{i}] must be a tuple (k, v, positions)")
        layer = _args.layer(layer)
        stream = _t.stream_handle(stream)
        # one int32 [n, n_kv_heads, width] array and the counts, as kvret_select_batch writes them
        rows_of = [np.asarray(_t.as_input(s, "int32")) for s in selections]
        for i, rows in enumerate(rows_of):
            if rows.ndim != 2 or rows.shape[0] != self._n_kv_heads:
                raise KvretError(
                    Status.SHAPE,
                    f"selections[{i}]: shape {rows.shape}, expected [n_kv_heads = {self._n_kv_heads}, count]",
                )
        counts = np.array([rows.shape[1] for rows in rows_of], dtype=np.int32)
        positions = np.zeros((len(sequences), self._n_kv_heads, max([1] + list(counts))), dtype=np.int32)
        for i, rows in enumerate(rows_of):
            positions[i, :, : rows.shape[1]] = rows
        row_counts = np.zeros(len(sequences), dtype=np.int64)
        with contextlib.ExitStack() as locks:
            for sequence in sorted(set(sequences), key=id):
                locks.enter_context(sequence._lock)
            handles = [s._live(f"sequences[{i}]") for i, s in enumerate(sequences)]
            if outs is None:
                outs = []
                for h, count in zip(handles, counts):
                    length = _c.kvret_seq_length(h, layer)
                    count = int(count)
                    # count is the library's to judge, with its message naming the entry
                    capacity = _c.kvret_working_set_capacity(h, layer, min(count, length)) if count > 0 else length
                    outs.append(self._empty_working_set(capacity, dtype))
            working_sets = [tuple(_t.as_output(x, stream, self._device_id) for x in out) for out in outs]
            _c.kvret_fetch_batch_async(handle, handles, layer, positions, counts, working_sets, row_counts, stream)
        return [
            WorkingSet(k[:, :rows], v[:, :rows], p[:, :rows]) for (k, v, p), rows in zip(outs, row_counts.tolist())
        ]

    def synchronize(self, stream=None):
        """Waits for the work kvret enqueued on `stream` (a no-op on the CPU backend)."""
        handle = self._live()
        _c.kvret_synchronize(handle, _t.stream_handle(stream))

    def stats(self):
        """The context's statistics as a dict (see kvret_stats)."""
        handle = self._live()
        stats = _c.kvret_stats()
        _c.kvret_stats_init(stats)
        _c.kvret_context_stats(handle, stats)
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
