"""kvret: KV-cache retrieval for long-context LLM decoding (Python binding of the C library).

    import numpy as np, kvret

    with kvret.Context(n_layers=1, n_q_heads=8, n_kv_heads=2, head_dim=64, kv_dtype="f32",
                       index_kind="exact", n_sink=4, n_local=16, budget=32) as ctx, ctx.open_sequence() as seq:
        seq.append_prefill(0, k, v)               # k, v: [T, n_kv_heads, head_dim]
        positions = seq.select(0, q)              # q: [n_q_heads, head_dim] -> int32 [n_kv_heads, count]
        ws = seq.fetch(0, positions)              # WorkingSet(k, v, positions)
        out = ctx.attend(q, ws.k, ws.v)           # float32 [n_q_heads, head_dim]

Every failed call raises :class:`KvretError` with the library's status and message.
"""

from . import _args
from . import kvret_swig as _c
from .context import Context, SessionTier
from .errors import KvretError, Status
from .sequence import Sequence, WorkingSet

__version__ = "0.1.0"

BUDGET_DEFAULT = _c.KVRET_BUDGET_DEFAULT

# The extension was compiled against one kvret.h; the loaded libkvret must have the same ABI (same minor in 0.x).
if _c.kvret_version_number() // 100 != _c.KVRET_VERSION_NUMBER // 100:
    raise ImportError(
        f"kvret: the binding was built for libkvret {_c.KVRET_VERSION_MAJOR}.{_c.KVRET_VERSION_MINOR}, "
        f"but libkvret {_c.kvret_version_string()} was loaded"
    )


def version():
    """The version of the loaded libkvret ("MAJOR.MINOR.PATCH")."""
    return _c.kvret_version_string()


def status_string(status):
    """The library's name for a status ("KVRET_ERR_SHAPE", ...)."""
    return _c.kvret_status_string(_args.int32(status, "status"))


__all__ = [
    "BUDGET_DEFAULT",
    "Context",
    "KvretError",
    "Sequence",
    "SessionTier",
    "Status",
    "WorkingSet",
    "status_string",
    "version",
]
