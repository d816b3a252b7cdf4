"""Context configuration: keyword arguments onto the fields of kvret_config.

Every field of kvret_config is a keyword of the same name (n_layers=..., budget=...). Enumerated fields also take
names: kv_dtype="f32", index_kind="exact", gqa_fold="max_logit", cache_policy="lfu", session_policy="lru",
rope_layout="gptj", hamming_importance="accumulated", device_type="cuda". The extra keyword device="cuda:1" sets device_type and device_id together.
The strings disk_path (a str or path) and session_shared_url (a str, "redis://host:port/db") are None when unset.
Values are checked as the calls' arguments are (see kvret._args): integers from integers only, within their C type
(else KvretError, Status.INVALID_ARGUMENT).

Each retrieval design's parameters are one keyword holding a dict (or a dataclass) of that design's fields, the
names of the C struct's (kvret_pq_params, ...; GROUPS lists them):

    kvret.Context(index_kind="pq", pq=dict(m=8, bits=4), crush=dict(fraction=0.25, importance="accumulated"))

pq (kvret_pq_params), cluster (kvret_cluster_params), quant (kvret_quant_params), crush (KVCrush,
kvret_crush_params) and session (the session store, kvret_session_params). An unknown field of a group is a
TypeError naming the closest ones. The same knobs as flat fields (pq_m, cluster_tokens, quant_bits, hamming_*,
session_*) are kept for one release; giving a group and changing one of its flat fields too is refused by the library
(KvretError, Status.INVALID_ARGUMENT, naming both).

The config dicts this module returns (Context.config, defaults()) give enumerated fields by name (the first name
below: "f16", "exact", ...), so that Context(**ctx.config) makes a context of the same config. They report the
effective values in the flat fields.
"""

import os

from . import _args
from . import kvret_swig as _c
from .errors import KvretError, Status

_ENUM_NAMES = {
    "kv_dtype": {
        "f16": _c.KVRET_KV_F16,
        "float16": _c.KVRET_KV_F16,
        "bf16": _c.KVRET_KV_BF16,
        "bfloat16": _c.KVRET_KV_BF16,
        "f32": _c.KVRET_KV_F32,
        "float32": _c.KVRET_KV_F32,
    },
    "device_type": {"cpu": _c.KVRET_DEVICE_CPU, "cuda": _c.KVRET_DEVICE_CUDA},
    "gqa_fold": {"sum_prob": _c.KVRET_FOLD_SUM_PROB, "max_logit": _c.KVRET_FOLD_MAX_LOGIT},
    "index_kind": {
        "exact": _c.KVRET_INDEX_EXACT,
        "pq": _c.KVRET_INDEX_PQ,
        "streaming": _c.KVRET_INDEX_STREAMING,
        "page": _c.KVRET_INDEX_PAGE,
        "cluster": _c.KVRET_INDEX_CLUSTER,
        "quant": _c.KVRET_INDEX_QUANT,
    },
    "cache_policy": {"lru": _c.KVRET_CACHE_LRU, "lfu": _c.KVRET_CACHE_LFU},
    "session_policy": {
        "scheduler_aware": _c.KVRET_SESSION_SCHEDULER_AWARE,
        "lru": _c.KVRET_SESSION_LRU,
        "fifo": _c.KVRET_SESSION_FIFO,
    },
    "rope_layout": {"neox": _c.KVRET_ROPE_NEOX, "gptj": _c.KVRET_ROPE_GPTJ},
    "hamming_importance": {"window": _c.KVRET_IMPORTANCE_WINDOW, "accumulated": _c.KVRET_IMPORTANCE_ACCUMULATED},
}

# Each value's name in a config dict: the first name listed for it above.
_ENUM_VALUES = {
    field: {value: name for name, value in reversed(list(names.items()))} for field, names in _ENUM_NAMES.items()
}

# Each design's parameter struct: (SWIG proxy, its init function, the prefix of its flat fields in kvret_config).
_GROUP_STRUCTS = {
    "pq": (_c.kvret_pq_params, _c.kvret_pq_params_init, "pq_"),
    "cluster": (_c.kvret_cluster_params, _c.kvret_cluster_params_init, "cluster_"),
    "quant": (_c.kvret_quant_params, _c.kvret_quant_params_init, "quant_"),
    "crush": (_c.kvret_crush_params, _c.kvret_crush_params_init, "hamming_"),
    "session": (_c.kvret_session_params, _c.kvret_session_params_init, "session_"),
}


def _proxy_fields(proxy):
    return tuple(
        name
        for name, value in vars(proxy).items()
        if isinstance(value, property) and name not in ("thisown", "struct_size")
    )


# Each group's fields, in struct order, straight from the SWIG proxies (so they follow kvret.h).
GROUPS = {group: _proxy_fields(proxy) for group, (proxy, _, _) in _GROUP_STRUCTS.items()}

# The settable flat fields, in struct order, straight from the SWIG proxy (so they follow kvret.h); the group
# pointers are set from the group keywords.
FIELDS = tuple(name for name in _proxy_fields(_c.kvret_config) if name not in GROUPS) + (
    "disk_path",
    "session_shared_url",
)

# Each field's C type, from the proxy's docstrings ("n_layers : int32_t", SWIG's autodoc).
_FIELD_TYPES = {
    name: (value.__doc__ or "").partition(" : ")[2].strip()
    for name, value in vars(_c.kvret_config).items()
    if isinstance(value, property)
}


def _field_value(name, value, shown=None):
    """The C value of flat field `name` (an enumerated one also by name); `shown` names it in messages (a group's
    field as pq.m), default `name`."""
    shown = shown or name
    names = _ENUM_NAMES.get(name)
    if names is not None and isinstance(value, str):
        try:
            return names[value.lower()]
        except KeyError:
            raise ValueError(f"kvret: {shown} must be one of {sorted(names)} (or its number), not {value!r}") from None
    return _args.config_field(value, shown, _FIELD_TYPES.get(name))


def _set(struct, name, value, shown=None):
    try:
        setattr(struct, name, value)
    except (TypeError, OverflowError, ValueError):  # a field of a type _args does not know: SWIG checked it
        raise TypeError(f"kvret: {value!r} is not a valid value of the config field {shown or name}") from None


def _parse_device(device):
    if not isinstance(device, str):
        raise TypeError(f"kvret: device must be a string ('cpu', 'cuda' or 'cuda:N'), not {type(device).__name__}")
    kind, colon, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not (kind == "cuda" and index.isdigit() and index.isascii())):
        raise ValueError(f"kvret: device must be 'cpu', 'cuda' or 'cuda:N', not {device!r}")
    return _ENUM_NAMES["device_type"][kind], _args.int32(int(index), "device") if index else 0


def _disk_path(value):
    if value is None:
        return None
    try:
        path = os.fsencode(value)
    except TypeError:
        raise TypeError(f"kvret: disk_path must be None, a string or a path, not {type(value).__name__}") from None
    if b"\0" in path:
        raise KvretError(Status.INVALID_ARGUMENT, "disk_path contains a NUL character")
    return path


def _shared_url(value):
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"kvret: session_shared_url must be None or a string, not {type(value).__name__}")
    if "\0" in value:
        raise KvretError(Status.INVALID_ARGUMENT, "session_shared_url contains a NUL character")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise KvretError(
            Status.INVALID_ARGUMENT, f"session_shared_url cannot be encoded as UTF-8 ({error.reason})"
        ) from None


def _group_items(group, value):
    """The (field, value) pairs of a group keyword: a mapping, or a dataclass instance."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not hasattr(value, "items"):
        raise TypeError(
            f"kvret: {group} must be a dict (or a dataclass) of {group} parameters, not {type(value).__name__}"
        )
    return value.items()


def _group(group, value):
    """The kvret_<group>_params proxy for a group keyword, its fields checked as the flat fields are."""
    proxy, init, prefix = _GROUP_STRUCTS[group]
    params = proxy()
    init(params)
    for name, field_value in _group_items(group, value):
        if name not in GROUPS[group]:
            raise TypeError(_unknown_group_field(group, name))
        shown = f"{group}.{name}"
        _set(params, name, _field_value(prefix + name, field_value, shown), shown)
    return params


def make(options):
    """(kvret_config, disk_path, session_shared_url, params) from keyword options; unknown keywords raise TypeError.
    params holds the parameter structs the config points at: keep it until the config has been used."""
    config = _c.kvret_config()
    _c.kvret_config_init(config)
    disk_path = shared_url = None
    params = []
    for name, value in options.items():
        if name == "device":
            config.device_type, config.device_id = _parse_device(value)
        elif name == "disk_path":
            disk_path = _disk_path(value)
        elif name == "session_shared_url":
            shared_url = _shared_url(value)
        elif name in GROUPS:
            params.append(_group(name, value))
            setattr(config, name, params[-1])
        elif name in FIELDS:
            _set(config, name, _field_value(name, value))
        else:
            raise TypeError(_unknown_field(name))
    return config, disk_path, shared_url, params


def _unknown_group_field(group, name):
    import difflib

    close = difflib.get_close_matches(str(name), GROUPS[group], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"kvret: unknown {group} parameter {name!r}{hint} "
        f"(kvret.config.GROUPS[{group!r}] lists them: {', '.join(GROUPS[group])})"
    )


def _unknown_field(name):
    """The message for an unknown field: the closest names first, then where the list is (not all 60 on one line)."""
    import difflib

    close = difflib.get_close_matches(str(name), [*FIELDS, *GROUPS, "device"], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"kvret: unknown config field {name!r}{hint} (kvret.config.FIELDS lists every field; kvret.h documents each)"


def defaults():
    """The library's default config as a dict."""
    config = _c.kvret_config()
    _c.kvret_config_init(config)
    return to_dict(config)


def to_dict(config):
    """The fields of a kvret_config as a dict; enumerated fields by name (a number this version has no name for stays
    a number)."""
    values = {name: getattr(config, name) for name in FIELDS if name not in ("disk_path", "session_shared_url")}
    for name, names in _ENUM_VALUES.items():
        values[name] = names.get(values[name], values[name])
    values["disk_path"] = _c.kvret_swig_config_disk_path(config)
    values["session_shared_url"] = _c.kvret_swig_config_session_shared_url(config)
    return values
