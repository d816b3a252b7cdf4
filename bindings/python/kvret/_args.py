"""Checks of the scalar arguments of the public calls, made before anything reaches the extension (whose own
conversion errors name C parameters by number: "in method 'kvret_seq_budget', argument 2 of type 'int32_t'").

The rule, for every call: a value of the wrong type raises TypeError naming the argument; an integer never comes
from a float (operator.index, so 3.0 is refused, never rounded) and a number never from a string; a value that its C
type cannot hold raises KvretError with the status the library gives that argument's bad values (a layer:
OUT_OF_RANGE, a budget: BUDGET, any other: INVALID_ARGUMENT), naming the argument as the caller spelled it.
"""

import math
import numbers
import operator

from . import kvret_swig as _c
from .errors import KvretError, Status

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
FLOAT_MAX = 3.4028234663852886e38  # FLT_MAX

# The status for a value its C type cannot hold, per argument (INVALID_ARGUMENT for the others).
_STATUS = {
    "layer": Status.OUT_OF_RANGE,
    "begin": Status.OUT_OF_RANGE,
    "end": Status.OUT_OF_RANGE,
    "budget": Status.BUDGET,
}


def index(value, name):
    """value as a Python int: an integer (int, NumPy integer, ...), never a float rounded to one."""
    if not hasattr(type(value), "__index__"):
        raise TypeError(f"kvret: {name} must be an integer, not {type(value).__name__}")
    return operator.index(value)


def integer(value, name, bounds=INT32, c_type="an int32", status=None):
    """value as a Python int within bounds (inclusive)."""
    value = index(value, name)
    if not bounds[0] <= value <= bounds[1]:
        status = status or _STATUS.get(name, Status.INVALID_ARGUMENT)
        raise KvretError(status, f"{name} {_shown(value)} does not fit {c_type}")
    return value


def _shown(number):
    text = str(number)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text.lstrip('-'))} digits)"


def int32(value, name):
    return integer(value, name, INT32, "an int32")


def int64(value, name):
    return integer(value, name, INT64, "an int64")


def uint64(value, name):
    return integer(value, name, UINT64, "a uint64")


def real(value, name):
    """value as a Python float that a C float holds (NaN and infinities pass: the library judges them)."""
    complex_only = isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real)
    if complex_only or not hasattr(type(value), "__float__"):
        raise TypeError(f"kvret: {name} must be a real number, not {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond any double
        raise KvretError(Status.INVALID_ARGUMENT, f"{name} {_shown(value)} does not fit a float") from None
    if math.isfinite(value) and abs(value) > FLOAT_MAX:
        raise KvretError(Status.INVALID_ARGUMENT, f"{name} {value} does not fit a float")
    return value


def layer(value, name="layer"):
    return int32(value, name)


def budget(value, name="budget"):
    """None (the default budget) or an int32; for the C call."""
    if value is None:
        return _c.KVRET_BUDGET_DEFAULT
    value = int32(value, name)
    if value < 1:  # the C message names KVRET_BUDGET_DEFAULT, which Python spells None
        raise KvretError(Status.BUDGET, f"{name} must be >= 1, or None for the context's default budget; got {value}")
    return value


def scale(value, name="scale"):
    """None (1/sqrt(head_dim)) or a real number; for the C call (<= 0 means the default there)."""
    return 0.0 if value is None else real(value, name)


def session_id(value, name="session_id"):
    """A session id as the bytes the library takes: a str (encoded as UTF-8) or bytes-like, without a NUL. Its length
    (1 to 255 bytes) is the library's to judge, with its message."""
    if isinstance(value, str):
        try:
            value = value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise KvretError(Status.INVALID_ARGUMENT, f"{name} cannot be encoded as UTF-8 ({error.reason})") from None
    elif isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value)
    else:
        raise TypeError(f"kvret: {name} must be a str or bytes, not {type(value).__name__}")
    if b"\0" in value:
        raise KvretError(Status.INVALID_ARGUMENT, f"{name} contains a NUL character")
    return value


def non_negative(value, name):
    """value as a Python int >= 0 (ValueError when negative), capped at INT64's maximum: for counts of tokens, where
    anything past the sequence means the whole of it."""
    value = index(value, name)
    if value < 0:
        raise ValueError(f"kvret: {name} must be >= 0, got {_shown(value)}")
    return min(value, INT64[1])


_INTEGER_TYPES = {"int32_t": (INT32, "an int32"), "int64_t": (INT64, "an int64"), "uint64_t": (UINT64, "a uint64")}


def config_field(value, name, c_type):
    """A config field's value checked for its C type (a value out of range: Status.INVALID_ARGUMENT, as kvret_create
    gives invalid fields); a C type without a check here leaves it to SWIG."""
    if c_type in _INTEGER_TYPES:
        bounds, text = _INTEGER_TYPES[c_type]
        return integer(value, name, bounds, text, Status.INVALID_ARGUMENT)
    if c_type in ("float", "double"):
        return real(value, name)
    return value
