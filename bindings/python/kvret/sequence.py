"""Sequence: one request or conversation whose keys and values kvret stores, indexes and retrieves."""

import collections
import threading

import numpy as np

from . import _args
from . import kvret_swig as _c
from . import tensors as _t
from .errors import KvretError, Status
from ._resource import Resource

WorkingSet = collections.namedtuple("WorkingSet", ["k", "v", "positions"])
WorkingSet.__doc__ = """The working set of one layer: sink + selected + local tokens of every KV head, in position order.

k, v: [n_kv_heads, rows, head_dim]; positions: int32 [n_kv_heads, rows] (the token position of each row)."""


class Sequence(Resource):
    """A sequence of a :class:`Context`. Use it as a context manager, or call :meth:`close`.

    Calls on one sequence are serialized by a lock, so sharing one between threads is safe (if not parallel);
    distinct sequences run in parallel, with the GIL released inside the library.
    """

    def __init__(self, context, _handle=None):
        self._context = context
        self._lock = threading.Lock()
        self._closed_message = "the sequence is closed"
        self._handle = _c.kvret_seq_open(context._live()) if _handle is None else _handle
        context._sequences.add(self)

    # ---- lifetime ----
    @property
    def context(self):
        return self._context

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        """Waits for the sequence's background work and frees it. Closing twice is a no-op."""
        self._close("the sequence is closed")

    def _close(self, message):
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is not None:
                self._closed_message = message
                if self._context._handle is not None:
                    _c.kvret_seq_close(handle)

    def _live(self, name="the sequence"):
        """The handle (call with the lock held); KvretError (Status.INVALID_HANDLE) once the sequence is closed."""
        handle = self._handle
        if handle is None:
            message = self._closed_message
            if name != "the sequence":
                message = message.replace("the sequence", name, 1)
            raise KvretError(Status.INVALID_HANDLE, message)
        return handle

    def __repr__(self):
        return f"<kvret.Sequence {'closed' if self.closed else 'open'}>"

    # ---- appending ----
    def append_prefill(self, layer, k, v):
        """Appends prefill tokens to `layer`: k, v are [T, n_kv_heads, head_dim] (f16/bf16/f32; other float dtypes
        are converted to float32). Schedules the layer's index build (in the background by default)."""
        layer = _args.layer(layer)
        with self._lock:
            _c.kvret_append_prefill(self._live(), layer, _t.as_input(k), _t.as_input(v))

    def append_decode(self, layer, k, v):
        """Appends one decode token ([n_kv_heads, head_dim] or [1, n_kv_heads, head_dim]) to `layer`."""
        layer = _args.layer(layer)
        with self._lock:
            _c.kvret_append_decode(self._live(), layer, _t.as_input(k), _t.as_input(v))

    def wait_index(self, layer=-1):
        """Waits until the index of `layer` (every layer when -1) is built."""
        layer = _args.layer(layer)
        with self._lock:
            _c.kvret_wait_index(self._live(), layer)

    def fork(self):
        """A new sequence holding what this one holds (every layer's tokens and index), for beam search, parallel
        sampling or several continuations of one prompt. The two share their KV pages copy on write and are
        independent from then on (see kvret_seq_fork)."""
        with self._lock:
            handle = _c.kvret_seq_fork(self._live())
        return Sequence(self._context, _handle=handle)

    def truncate(self, length):
        """Rolls the sequence back to its first `length` tokens in every layer (speculative decoding: drop the
        rejected draft tokens; regeneration). The sequence is then as if the dropped tokens had never been
        appended; on failure nothing changes. `length` is a non-negative integer (see kvret_seq_truncate)."""
        length = _args.index(length, "length")  # an int, not a float rounded to one
        if length < 0:
            raise ValueError(f"kvret: length must be >= 0, got {length}")
        with self._lock:
            _c.kvret_seq_truncate(self._live(), min(length, _args.INT64[1]))  # beyond every layer: a no-op

    def drop_front(self, keep, count):
        """Context-window truncation: drops `count` tokens of every layer after its first `keep` tokens (keep 0: the
        earliest tokens; keep = n_sink keeps the attention sinks, as StreamingLLM does). The later tokens move
        `count` positions earlier: with rope_keys=True their keys are rotated at their new positions (exactly as in
        a sequence given only the remaining tokens), with rope_keys=False they stay as given. Each shortened layer's
        index is rebuilt, on the calling thread, so the sequence selects as one given the remaining tokens. A layer
        holding at most `keep` tokens is unchanged; one holding fewer than keep + count keeps its first `keep`.
        keep and count are non-negative integers (ValueError when negative); count 0 changes nothing; on failure
        nothing changes (see kvret_seq_drop_front)."""
        keep, count = _args.non_negative(keep, "keep"), _args.non_negative(count, "count")
        with self._lock:
            _c.kvret_seq_drop_front(self._live(), keep, count)

    # ---- sessions ----
    def save_session(self, session_id):
        """Saves what this sequence holds now under `session_id` (a str, encoded as UTF-8, or bytes: 1 to 255
        bytes, no NUL) in the context's session store, replacing an older save of that id once the new one is
        whole. The sequence stays open and unchanged: go on appending to it, or close it; a later turn reopens it
        with :meth:`Context.open_session`. Raises KvretError, and changes nothing, with Status.CAPACITY for a
        session that fits no tier, Status.IO when a disk write it needs fails (a full disk), Status.UNSUPPORTED for
        a sequence of a context with hamming_fraction > 0 or one holding an observed query window or accumulated
        attention (KVCrush's state is not saved)."""
        session_id = _args.session_id(session_id)
        with self._lock:
            _c.kvret_session_save(self._live(), session_id)

    # ---- queries ----
    def length(self, layer):
        """Tokens stored for `layer` (sink + middle + local)."""
        layer = _args.layer(layer)
        with self._lock:
            return _c.kvret_seq_length(self._live(), layer)

    def budget(self, layer):
        """The budget select uses by default for `layer` at its current length."""
        layer = _args.layer(layer)
        with self._lock:
            return _c.kvret_seq_budget(self._live(), layer)

    def working_set_capacity(self, layer, budget=None):
        """Upper bound of the working-set rows for `layer` at `budget` (None: the default budget)."""
        layer, budget = _args.layer(layer), _args.budget(budget)
        with self._lock:
            return _c.kvret_working_set_capacity(self._live(), layer, budget)

    def stats(self):
        """This sequence's statistics as a dict (see kvret_stats)."""
        from .context import stats_dict

        stats = _c.kvret_stats()
        _c.kvret_stats_init(stats)
        with self._lock:
            _c.kvret_seq_stats(self._live(), stats)
        return stats_dict(stats)

    # ---- retrieval ----
    def select(self, layer, q, budget=None, out=None):
        """Selects the top `budget` middle tokens of every KV head for query q ([n_q_heads, head_dim]).

        Returns int32 positions [n_kv_heads, count], ascending per head (a view of `out` when given: int32
        [n_kv_heads, >= budget]). budget None means the sequence's default budget."""
        ctx = self._context
        layer, budget_arg = _args.layer(layer), _args.budget(budget)
        with self._lock:
            handle = self._live()
            if out is None:
                out = np.empty((ctx._n_kv_heads, _width(handle, layer, budget)), dtype=np.int32)
            count = _c.kvret_select(
                handle, layer, _t.as_input(q, device_id=ctx._device_id), budget_arg, _t.as_output(out)
            )
        return out[:, :count]

    def retained_set(self, layer, budget=None, out=None):
        """KVCrush's eviction-only mode: the middle positions to keep per KV head after the prefill, for an engine
        that drops KV instead of offloading it (kvret_seq_retained_set). No query: SnapKV's top tokens by importance
        (from the queries given to observe, else a window of the layer's last 32 keys; under
        hamming_importance="accumulated", from the accumulated attention once a step was observed), plus floor(hamming_fraction * count) bucket representatives of
        the others (the context's hamming_fraction; 0 gives SnapKV's set exactly). Sink and local tokens are kept
        besides and not counted in the budget. Changes nothing in the sequence.

        Returns int32 positions [n_kv_heads, count], ascending per head, count = min(budget, middle tokens) (a view
        of `out` when given: int32 [n_kv_heads, >= budget]). budget None means the sequence's default budget.
        Raises KvretError: Status.STATE when the layer holds no tokens (no observation window), Status.BUDGET for
        a budget of 0 or above the layer's length, Status.OUT_OF_RANGE for a bad layer."""
        ctx = self._context
        layer, budget_arg = _args.layer(layer), _args.budget(budget)
        with self._lock:
            handle = self._live()
            if out is None:
                out = np.empty((ctx._n_kv_heads, _width(handle, layer, budget)), dtype=np.int32)
            count = _c.kvret_seq_retained_set(handle, layer, budget_arg, _t.as_output(out))
        return out[:, :count]

    def observe(self, layer, q_window):
        """Gives KVCrush the prompt's observation window of `layer` (kvret_seq_observe): the queries of its last w
        prompt tokens, [w, n_q_heads, head_dim] (float16/bfloat16/float32, 1 <= w <= the layer's length), after the
        layer's prefill. From then on the importance behind the layer's KVCrush signatures (one bit per query head),
        representatives and retained_set comes from these queries instead of the layer's last 32 keys. A second
        call replaces the window. Raises KvretError: Status.STATE when the layer holds no tokens, Status.SHAPE for
        a wrong shape, Status.OUT_OF_RANGE for a bad layer; nothing changes then."""
        ctx = self._context
        layer = _args.layer(layer)
        with self._lock:
            _c.kvret_seq_observe(self._live(), layer, _t.as_input(q_window, device_id=ctx._device_id))

    def observe_attention(self, layer, probs):
        """Adds one decode step's attention probabilities of `layer` to its accumulated attention (H2O;
        kvret_seq_observe_attention), for engines that attend themselves, on a context with
        hamming_importance="accumulated". probs: [n_q_heads, n] (float16/bfloat16/float32), 1 <= n <= the layer's
        length, probs[i, t] what query head i gave token t; finite and >= 0. Once a layer has a step, its KVCrush
        signatures, representatives and retained_set come from the sums. Raises KvretError: Status.STATE on a
        context without accumulated importance or a layer holding no tokens, Status.SHAPE for a wrong shape,
        Status.INVALID_ARGUMENT for a negative or non-finite value; nothing changes then."""
        ctx = self._context
        layer = _args.layer(layer)
        with self._lock:
            _c.kvret_seq_observe_attention(self._live(), layer, _t.as_input(probs, device_id=ctx._device_id))

    def select_scored(self, layer, q, budget=None, out=None):
        """:meth:`select`, with the score each position was ranked by (see kvret_select_scored).

        Returns (positions, scores): int32 and float32 [n_kv_heads, count], aligned; views of `out` = (positions,
        scores) when given (int32 and float32 [n_kv_heads, >= budget])."""
        ctx = self._context
        layer, budget_arg = _args.layer(layer), _args.budget(budget)
        if out is not None and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("kvret: out must be a tuple (positions, scores)")
        with self._lock:
            handle = self._live()
            if out is None:
                width = _width(handle, layer, budget)
                out = (np.empty((ctx._n_kv_heads, width), np.int32), np.empty((ctx._n_kv_heads, width), np.float32))
            positions, scores = out
            count = _c.kvret_select_scored(
                handle,
                layer,
                _t.as_input(q, device_id=ctx._device_id),
                budget_arg,
                _t.as_output(positions),
                _t.as_output(scores),
            )
        return positions[:, :count], scores[:, :count]

    def attend(self, layer, q, budget=None, scale=None, out=None, stream=None):
        """Attention of q ([n_q_heads, head_dim]) over this step's working set of `layer`, in one call: select,
        fetch and attention inside kvret (see kvret_seq_attend). Returns out, float32 [n_q_heads, head_dim] (written
        in place when given: float32, or on the CPU backend also float16 or bfloat16). budget None: the default budget; scale None: 1/sqrt(head_dim)."""
        ctx = self._context
        layer, budget, scale = _args.layer(layer), _args.budget(budget), _args.scale(scale)
        stream = _t.stream_handle(stream)
        if out is None:
            out = _t.empty((ctx._n_q_heads, ctx._head_dim), np.float32, ctx._device_type, ctx._device_id, like=q)
        with self._lock:
            _c.kvret_seq_attend(
                self._live(),
                layer,
                _t.as_input(q, stream=stream, device_id=ctx._device_id),
                budget,
                scale,
                _t.as_output(out, stream, ctx._device_id),
                stream,
            )
        return out

    def fetch(self, layer, positions, count=None, out=None, stream=None, dtype=None):
        """Writes the working set of `layer` for a selection (positions [n_kv_heads, >= count] as returned by
        :meth:`select`; count defaults to positions.shape[1]).

        Returns a :class:`WorkingSet` (k, v, positions) of `rows` rows: views of `out` = (k, v, positions) when
        given, else of new arrays (NumPy on a CPU context; dtype defaults to the KV dtype, float32 for bf16).
        On a CUDA context the copy is enqueued on `stream`: synchronize before reading it."""
        ctx = self._context
        layer = _args.layer(layer)
        stream = _t.stream_handle(stream)
        if out is not None and not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError("kvret: out must be a tuple (k, v, positions)")
        positions = _t.as_input(positions, "int32")
        if count is None:
            shape = _t.shape_of(positions)
            count = shape[1] if len(shape) > 1 else 0  # a wrong shape is the library's to refuse
        count = _args.int32(count, "count")
        with self._lock:
            handle = self._live()
            if out is None:
                length = _c.kvret_seq_length(handle, layer)
                # count is the library's to judge (the middle tokens bound it), by fetch itself, with its message.
                capacity = _c.kvret_working_set_capacity(handle, layer, min(count, length)) if count > 0 else length
                out = ctx._empty_working_set(capacity, dtype)
            k, v, rows_positions = out
            working_set = (
                _t.as_output(k, stream, ctx._device_id),
                _t.as_output(v, stream, ctx._device_id),
                _t.as_output(rows_positions, stream, ctx._device_id),
            )
            rows = _c.kvret_fetch_async(handle, layer, positions, count, working_set, stream)
        return WorkingSet(k[:, :rows], v[:, :rows], rows_positions[:, :rows])

    def prefetch(self, layer, q_guess, budget=None, stream=None):
        """Experimental: selects with a guessed next query; the layer's next fetch counts the rows it takes from
        that selection in stats()["prefetch_hits"] (the speculative hit rate). Nothing is loaded ahead yet."""
        ctx = self._context
        layer, budget = _args.layer(layer), _args.budget(budget)
        stream = _t.stream_handle(stream)
        with self._lock:
            _c.kvret_prefetch_async(
                self._live(), layer, _t.as_input(q_guess, stream=stream, device_id=ctx._device_id), budget, stream
            )

    def read(self, layer, begin, end, dtype=None):
        """Experimental: the stored keys and values of positions [begin, end) as (k, v), each
        [end - begin, n_kv_heads, head_dim] (dtype defaults to the KV dtype, float32 for bf16)."""
        ctx = self._context
        layer, begin, end = _args.layer(layer), _args.int64(begin, "begin"), _args.int64(end, "end")
        with self._lock:
            handle = self._live()
            # Sized only once the library agrees with the range (an absurd one allocates nothing).
            length = _c.kvret_seq_length(handle, layer)
            rows = end - begin if 0 <= begin <= end <= length else 0
            k = np.empty((rows, ctx._n_kv_heads, ctx._head_dim), dtype=dtype or ctx._kv_numpy_dtype)
            v = np.empty((rows, ctx._n_kv_heads, ctx._head_dim), dtype=dtype or ctx._kv_numpy_dtype)
            _c.kvret_seq_read(handle, layer, begin, end, k, v)
        return k, v


def _width(handle, layer, budget):
    """Columns of the positions buffer select needs: the budget, but never more than the layer holds (so that an
    absurd budget is refused by the library, with its message, before anything large is allocated). layer and budget
    are checked already."""
    if budget is None:
        return max(_c.kvret_seq_budget(handle, layer), 1)
    return max(min(_args.budget(budget), _c.kvret_seq_length(handle, layer)), 1)
