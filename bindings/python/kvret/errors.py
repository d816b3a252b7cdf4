"""Statuses and the exception raised for every failed kvret call."""

import enum

from . import kvret_swig as _c


class Status(enum.IntEnum):
    """kvret_status: 0 is success, every other value names what was wrong."""

    OK = _c.KVRET_OK
    INVALID_ARGUMENT = _c.KVRET_ERR_INVALID_ARGUMENT
    INVALID_HANDLE = _c.KVRET_ERR_INVALID_HANDLE
    SHAPE = _c.KVRET_ERR_SHAPE
    DTYPE = _c.KVRET_ERR_DTYPE
    STRIDE = _c.KVRET_ERR_STRIDE
    DEVICE = _c.KVRET_ERR_DEVICE
    OUT_OF_RANGE = _c.KVRET_ERR_OUT_OF_RANGE
    BUDGET = _c.KVRET_ERR_BUDGET
    CAPACITY = _c.KVRET_ERR_CAPACITY
    OUT_OF_MEMORY = _c.KVRET_ERR_OUT_OF_MEMORY
    NONFINITE = _c.KVRET_ERR_NONFINITE
    STATE = _c.KVRET_ERR_STATE
    UNSUPPORTED = _c.KVRET_ERR_UNSUPPORTED
    IO = _c.KVRET_ERR_IO
    CORRUPT = _c.KVRET_ERR_CORRUPT
    CUDA = _c.KVRET_ERR_CUDA
    VERSION = _c.KVRET_ERR_VERSION
    INTERNAL = _c.KVRET_ERR_INTERNAL
    NOT_FOUND = _c.KVRET_ERR_NOT_FOUND
    BUSY = _c.KVRET_ERR_BUSY


class KvretError(RuntimeError):
    """A kvret call failed.

    Attributes:
        status: the :class:`Status` (an int for a status this version does not know).
        message: the library's message (kvret_last_error) for the failed call.
    """

    def __init__(self, status, message):
        try:
            status = Status(status)
        except ValueError:
            pass
        self.status = status
        self.message = message
        name = status.name if isinstance(status, Status) else str(int(status))
        super().__init__(f"[{name}] {message}")

    def __reduce__(self):
        return (type(self), (int(self.status), self.message))


# Raised by the extension itself, right after the failing call, on the same thread.
_c.kvret_swig_set_error_class(KvretError)
