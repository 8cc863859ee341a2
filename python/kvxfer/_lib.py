"""The ctypes declarations of include/kvxfer.h (ABI 1) and the library's loading."""

import ctypes
import ctypes.util
import os
import threading

ABI_VERSION = 1

# kvxfer_status, as in the header.
STATUS_NAMES = {
    0: "KVXFER_OK",
    1: "KVXFER_ERR_INVALID_ARGUMENT",
    2: "KVXFER_ERR_CONFIG",
    3: "KVXFER_ERR_BAD_HANDLE",
    4: "KVXFER_ERR_BUFFER_TOO_SMALL",
    5: "KVXFER_ERR_BAD_OPAQUE_STATE",
    6: "KVXFER_ERR_INCOMPATIBLE",
    7: "KVXFER_ERR_TIMEOUT",
    8: "KVXFER_ERR_CANCELED",
    9: "KVXFER_ERR_PEER",
    10: "KVXFER_ERR_CLOSED",
    11: "KVXFER_ERR_IN_FLIGHT",
    12: "KVXFER_ERR_FORKED",
    13: "KVXFER_ERR_TRANSFER",
    14: "KVXFER_ERR_NOT_FOUND",
    15: "KVXFER_ERR_INTERNAL",
    16: "KVXFER_ERR_UNSUPPORTED",
    17: "KVXFER_ERR_GROUP",
}
OK = 0
ERR_BUFFER_TOO_SMALL = 4

DTYPES = {"fp32": 1, "fp16": 2, "bf16": 3, "fp8": 4, "int8": 5}
DTYPE_SIZES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
ATTENTION = {"default": 0, "mla": 1}


class CacheStateC(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("layers", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("tokens_per_block", ctypes.c_int32),
        ("kv_factor", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("attention", ctypes.c_int32),
        ("tp", ctypes.c_int32),
        ("pp", ctypes.c_int32),
        ("attention_dp", ctypes.c_int32),
        ("dp_size", ctypes.c_int32),
        ("layers_per_pp", ctypes.POINTER(ctypes.c_int32)),
    ]


class PoolC(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("size", ctypes.c_uint64),
        ("num_blocks", ctypes.c_int32),
        ("block_bytes", ctypes.c_uint64),
    ]


class GroupC(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("mode", ctypes.c_int32),
        ("process", ctypes.c_int32),
        ("processes", ctypes.c_int32),
        ("coordinator", ctypes.c_char_p),
        ("join_timeout_ms", ctypes.c_int64),
    ]


GROUP_NONE, GROUP_COORDINATED, GROUP_GATHER = 0, 1, 2


class FinishedC(ctypes.Structure):
    _fields_ = [("request_id", ctypes.c_uint64), ("status", ctypes.c_int32)]


_u64p = ctypes.POINTER(ctypes.c_uint64)
_szp = ctypes.POINTER(ctypes.c_size_t)
_i32p = ctypes.POINTER(ctypes.c_int32)
_u8p = ctypes.POINTER(ctypes.c_uint8)

_SIGNATURES = {
    "kvxfer_abi_version": (ctypes.c_uint32, []),
    "kvxfer_version": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, _szp]),
    "kvxfer_last_error": (ctypes.c_char_p, []),
    "kvxfer_config_load_yaml": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, _u64p]),
    "kvxfer_config_load_file": (ctypes.c_int, [ctypes.c_char_p, _u64p]),
    "kvxfer_config_free": (ctypes.c_int, [ctypes.c_uint64]),
    "kvxfer_block_bytes": (ctypes.c_int, [ctypes.POINTER(CacheStateC), ctypes.c_int32, _u64p]),
    "kvxfer_transceiver_create": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.POINTER(CacheStateC), _i32p, ctypes.c_size_t, ctypes.POINTER(PoolC), ctypes.POINTER(GroupC),
         ctypes.c_char_p, _u64p],
    ),
    "kvxfer_group_outbox": (ctypes.c_int, [ctypes.c_uint64, _u8p, ctypes.c_size_t, _szp]),
    "kvxfer_group_deliver": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_char_p, _szp, ctypes.c_size_t]),
    "kvxfer_group_fail": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_char_p]),
    "kvxfer_transceiver_close": (ctypes.c_int, [ctypes.c_uint64]),
    "kvxfer_respond_and_send": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, _i32p, ctypes.c_size_t, _u8p, ctypes.c_size_t, _szp],
    ),
    "kvxfer_context_opaque_state": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, _u8p, ctypes.c_size_t, _szp]),
    "kvxfer_request_and_receive": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t, _i32p, ctypes.c_size_t],
    ),
    "kvxfer_request_and_receive_sync": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t, _i32p, ctypes.c_size_t,
         ctypes.c_int64],
    ),
    "kvxfer_check_context_status": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.POINTER(FinishedC), ctypes.c_size_t, _szp],
    ),
    "kvxfer_check_gen_status": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.POINTER(FinishedC), ctypes.c_size_t, _szp],
    ),
    "kvxfer_request_error": (
        ctypes.c_int,
        [ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t, _szp],
    ),
    "kvxfer_gen_transfer_complete": (ctypes.c_int, [ctypes.c_uint64, _i32p]),
    "kvxfer_cancel": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_uint64, _i32p]),
}

_lock = threading.Lock()
_lib = None


def _candidates():
    env = os.environ.get("KVXFER_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libkvxfer.so")
    yield os.path.normpath(os.path.join(here, "..", "..", "lib", "libkvxfer.so"))
    found = ctypes.util.find_library("kvxfer")
    if found:
        yield found


def lib():
    """Returns the loaded library, loading it on first use: from $KVXFER_LIB,
    else beside this package, else the repository's lib/, else the system's.
    Load it in the final process: a Go runtime does not survive fork."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if not os.path.exists(path) and os.sep in path:
                tried.append(path + " (missing)")
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(handle, name)
                fn.restype, fn.argtypes = res, args
            abi = handle.kvxfer_abi_version()
            if abi != ABI_VERSION:
                raise ImportError(f"kvxfer: {path} implements ABI {abi}, this binding ABI {ABI_VERSION}")
            _lib = handle
            return _lib
        raise ImportError("kvxfer: libkvxfer.so not found (build it with `make lib`, or set KVXFER_LIB): tried " + "; ".join(tried))
