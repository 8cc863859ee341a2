"""kvxfer: the KV-cache transceiver of disaggregated LLM serving, from Python.

A ctypes binding of libkvxfer (include/kvxfer.h), standard library only,
shaped as TensorRT-LLM's Python KvCacheTransceiver:

    cfg = kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "TCP"}})
    state = kvxfer.CacheState(layers=32, kv_heads=8, head_dim=128, tokens_per_block=32)
    with kvxfer.KvCacheTransceiver(cfg, state, pools=[pool_array]) as tr:
        req = kvxfer.Request(request_id=1, block_ids=[3, 7], num_tokens=50)
        tr.respond_and_send_async(req)          # context side; req.opaque_state
        ...
        tr.check_context_transfer_status(1)

The library holds a Go runtime: load it (import and first use) in the final
process, never before a fork, and never with another Go c-shared library.
"""

from .errors import (BadHandleError, BadOpaqueStateError, BufferTooSmallError, CanceledError, ClosedError, ConfigError,
                     ForkedError, GroupError, InFlightError, IncompatibleError, InternalError, InvalidArgumentError, KvxferError,
                     KvxferTimeoutError, NotFoundError, PeerError, TransferError, UnsupportedError)
from .transceiver import (CONTEXT_INIT, DISAGG_CONTEXT_COMPLETE, DISAGG_CONTEXT_TRANS_IN_PROGRESS,
                          DISAGG_GENERATION_TRANS_COMPLETE, DISAGG_GENERATION_TRANS_IN_PROGRESS, DISAGG_TRANS_ERROR,
                          CacheState, Config, CoordinatedGroup, GatherGroup, KvCacheTransceiver, Request, version)
from ._lib import ABI_VERSION

__all__ = [
    "ABI_VERSION", "BadHandleError", "BadOpaqueStateError", "BufferTooSmallError", "CONTEXT_INIT", "CacheState",
    "CanceledError", "ClosedError", "Config", "ConfigError", "CoordinatedGroup", "GatherGroup", "GroupError", "DISAGG_CONTEXT_COMPLETE", "DISAGG_CONTEXT_TRANS_IN_PROGRESS",
    "DISAGG_GENERATION_TRANS_COMPLETE", "DISAGG_GENERATION_TRANS_IN_PROGRESS", "DISAGG_TRANS_ERROR", "ForkedError",
    "InFlightError", "IncompatibleError", "InternalError", "InvalidArgumentError", "KvCacheTransceiver", "KvxferError",
    "KvxferTimeoutError", "NotFoundError", "PeerError", "Request", "TransferError", "UnsupportedError", "version",
]
