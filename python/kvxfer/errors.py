"""Exceptions of the binding: one class per kvxfer_status, each carrying the
library's message."""

from . import _lib


class KvxferError(Exception):
    """A kvxfer call failed. code is the kvxfer_status value, status its
    name (KVXFER_ERR_...), and the message is kvxfer's own."""

    code = -1

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def status(self):
        return _lib.STATUS_NAMES.get(self.code, f"kvxfer_status({self.code})")


class InvalidArgumentError(KvxferError, ValueError):
    code = 1


class ConfigError(KvxferError, ValueError):
    """The config is invalid; the message is `kvxfer config check`'s."""

    code = 2


class BadHandleError(KvxferError):
    code = 3


class BufferTooSmallError(KvxferError):
    code = 4


class BadOpaqueStateError(KvxferError, ValueError):
    code = 5


class IncompatibleError(KvxferError):
    code = 6


class KvxferTimeoutError(KvxferError, TimeoutError):
    code = 7


class CanceledError(KvxferError):
    code = 8


class PeerError(KvxferError, ConnectionError):
    code = 9


class ClosedError(KvxferError):
    code = 10


class InFlightError(KvxferError):
    code = 11


class ForkedError(KvxferError):
    """Called in a forked child of the process that loaded the library."""

    code = 12


class TransferError(KvxferError):
    code = 13


class NotFoundError(KvxferError, KeyError):
    code = 14

    def __str__(self):  # KeyError would quote the message
        return self.args[0] if self.args else ""


class InternalError(KvxferError):
    code = 15


class UnsupportedError(KvxferError):
    code = 16


class GroupError(KvxferError):
    """The instance's group of processes: not joined yet (gather mode: no
    round delivered), lost (a process or the coordinator died, a round
    failed), or bad."""

    code = 17


_BY_CODE = {c.code: c for c in KvxferError.__subclasses__()}


def error_for(code, message):
    """Returns the exception of a kvxfer_status code with message."""
    cls = _BY_CODE.get(code, KvxferError)
    return cls(message, code)
