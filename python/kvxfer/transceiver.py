"""KvCacheTransceiver: TensorRT-LLM's Python transceiver interface over libkvxfer."""

import ctypes
import dataclasses
import json
import operator
import os
import threading
import time

from . import _lib
from .errors import BufferTooSmallError, KvxferError, error_for

# Request states, with TensorRT-LLM's names (LlmRequestState).
CONTEXT_INIT = "CONTEXT_INIT"
DISAGG_CONTEXT_TRANS_IN_PROGRESS = "DISAGG_CONTEXT_TRANS_IN_PROGRESS"
DISAGG_CONTEXT_COMPLETE = "DISAGG_CONTEXT_COMPLETE"
DISAGG_GENERATION_INIT = "DISAGG_GENERATION_INIT"
DISAGG_GENERATION_TRANS_IN_PROGRESS = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
DISAGG_GENERATION_TRANS_COMPLETE = "DISAGG_GENERATION_TRANS_COMPLETE"
DISAGG_TRANS_ERROR = "DISAGG_TRANS_ERROR"


INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)


def _int(what, v, bounds):
    """v as an int of the C type whose bounds are given (INT32, UINT64),
    checked: ctypes would cut one that does not fit without a word (2**32 + 1
    as an int32 is 1), naming another block, request or shape."""
    try:
        i = operator.index(v)
    except TypeError:
        raise error_for(1, f"kvxfer: {what} is {v!r}, not an integer") from None
    lo, hi = bounds
    if not lo <= i <= hi:
        raise error_for(1, f"kvxfer: {what} is {i}, out of range [{lo}, {hi}] of its C type")
    return i


def _check(rc):
    if rc != _lib.OK:
        msg = _lib.lib().kvxfer_last_error().decode("utf-8", "replace")
        raise error_for(rc, msg)


def version():
    """The library's version string."""
    buf = ctypes.create_string_buffer(256)
    n = ctypes.c_size_t()
    _check(_lib.lib().kvxfer_version(buf, len(buf), ctypes.byref(n)))
    return buf.value.decode()


class Config:
    """A loaded, validated worker config (TensorRT-LLM's extra LLM API options
    with cache_transceiver_config), loaded with `kvxfer config check`'s rules
    and messages: ConfigError carries them."""

    def __init__(self, handle):
        self._h = handle

    @classmethod
    def from_dict(cls, d, name="config"):
        """From a dict of the file's content, e.g.
        {"cache_transceiver_config": {"backend": "TCP"}}."""
        return cls.from_yaml(json.dumps(d), name)  # JSON is YAML

    @classmethod
    def from_yaml(cls, text, name="config"):
        data = text.encode() if isinstance(text, str) else bytes(text)
        h = ctypes.c_uint64()
        nm = None if name is None else name.encode()  # None: the header's NULL, named "config"
        _check(_lib.lib().kvxfer_config_load_yaml(data, len(data), nm, ctypes.byref(h)))
        return cls(h.value)

    @classmethod
    def from_file(cls, path):
        h = ctypes.c_uint64()
        _check(_lib.lib().kvxfer_config_load_file(os.fsencode(path), ctypes.byref(h)))
        return cls(h.value)

    def close(self):
        """Frees the config (idempotent); transceivers made from it stay valid."""
        if self._h:
            _lib.lib().kvxfer_config_free(self._h)
            self._h = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclasses.dataclass
class CacheState:
    """An instance's cache state: the model's shape and parallel layout
    (kvxfer_cache_state)."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bf16"
    attention: str = "default"
    tp: int = 1
    pp: int = 1
    attention_dp: bool = False
    dp_size: int = 0
    kv_factor: int = 0
    layers_per_pp: list = None

    def _c(self):
        if self.dtype not in _lib.DTYPES:
            raise error_for(1, f"kvxfer: dtype {self.dtype!r}: want one of {sorted(_lib.DTYPES)}")
        if self.attention.lower() not in _lib.ATTENTION:
            raise error_for(1, f"kvxfer: attention {self.attention!r}: want default or mla")
        ints = [_int(f"cache state {name}", getattr(self, name), INT32)
                for name in ("layers", "kv_heads", "head_dim", "tokens_per_block", "kv_factor")]
        par = [_int(f"cache state {name}", getattr(self, name), INT32) for name in ("tp", "pp")]
        s = _lib.CacheStateC(
            ctypes.sizeof(_lib.CacheStateC), *ints, _lib.DTYPES[self.dtype], _lib.ATTENTION[self.attention.lower()], *par,
            int(bool(self.attention_dp)), _int("cache state dp_size", self.dp_size, INT32), None)
        keep = None
        if self.layers_per_pp:
            lpp = [_int(f"cache state layers_per_pp[{i}]", v, INT32) for i, v in enumerate(self.layers_per_pp)]
            keep = (ctypes.c_int32 * len(lpp))(*lpp)
            s.layers_per_pp = ctypes.cast(keep, ctypes.POINTER(ctypes.c_int32))
        return s, keep

    @property
    def num_ranks(self):
        return self.tp * self.pp

    def block_bytes(self, rank=0):
        """The bytes of one block of rank."""
        s, _keep = self._c()
        out = ctypes.c_uint64()
        _check(_lib.lib().kvxfer_block_bytes(ctypes.byref(s), _int("rank", rank, INT32), ctypes.byref(out)))
        return out.value


@dataclasses.dataclass
class CoordinatedGroup:
    """The processes of an instance agree over kvxfer's own connections; the
    process hosting rank 0 listens on coordinator (host:port) and the
    others dial it. Creating the transceiver returns once all have joined
    (at most join_timeout seconds)."""

    process: int
    processes: int
    coordinator: str
    join_timeout: float = 60.0

    def _c(self):
        ms = min(int(self.join_timeout * 1000), INT64[1])
        return _lib.GroupC(ctypes.sizeof(_lib.GroupC), _lib.GROUP_COORDINATED, _int("group process", self.process, INT32),
                           _int("group processes", self.processes, INT32), self.coordinator.encode(), ms)


@dataclasses.dataclass
class GatherGroup:
    """The processes of an instance agree through an all-gather the caller
    runs (TensorRT-LLM's communicator): see KvCacheTransceiver.gather_round."""

    process: int
    processes: int

    def _c(self):
        return _lib.GroupC(ctypes.sizeof(_lib.GroupC), _lib.GROUP_GATHER, _int("group process", self.process, INT32),
                           _int("group processes", self.processes, INT32), None, 0)


@dataclasses.dataclass(eq=False)
class Request:
    """A request as the transceiver sees it (the part of LlmRequest it uses).

    block_ids: the request's blocks, one list per hosted rank (a flat list
    for a process that hosts one rank). The transceiver sets state,
    opaque_state (context side) and error."""

    request_id: int
    block_ids: list
    num_tokens: int = 0
    dp_rank: int = 0
    opaque_state: bytes = None
    state: str = CONTEXT_INIT
    error: KvxferError = None


_FINISHED_BATCH = 1024


class KvCacheTransceiver:
    """The KV-cache transceiver of the ranks this process hosts, shaped as
    TensorRT-LLM's Python KvCacheTransceiver.

    pools: one buffer-protocol object per hosted rank (a numpy array, a
    bytearray, ...; writable and C-contiguous, at least num_blocks blocks):
    kvxfer reads and writes it in place and never frees it. None: kvxfer
    allocates shareable pools of num_blocks blocks, exposed as self.pools
    (memoryviews, valid until shutdown). ranks: the hosted ranks, ascending
    (None: every rank of the instance); when not all, group (a
    CoordinatedGroup or a GatherGroup) says how this process agrees with
    the processes hosting the others. Methods are safe to call from several
    threads. Use it as a context manager, or call shutdown(); one dropped
    without either is shut down when collected."""

    def __init__(self, config, cache_state, pools=None, num_blocks=None, ranks=None, group=None, listen_host=None):
        self._lib = _lib.lib()
        self.cache_state = cache_state
        self.ranks = [_int(f"ranks[{i}]", r, INT32) for i, r in enumerate(ranks)] if ranks else list(range(cache_state.num_ranks))
        if num_blocks is not None:
            num_blocks = _int("num_blocks", num_blocks, INT32)
        n = len(self.ranks)
        cpools = (_lib.PoolC * n)()
        self._keep = []  # the ctypes views that pin the caller's buffers
        if pools is not None:
            if len(pools) != n:
                raise error_for(1, f"kvxfer: {len(pools)} pools for {n} hosted ranks {self.ranks}")
            for i, p in enumerate(pools):
                mv = memoryview(p)
                if mv.readonly or not mv.c_contiguous:
                    raise error_for(1, f"kvxfer: pool {i} (rank {self.ranks[i]}) must be writable and C-contiguous")
                nbytes = mv.nbytes
                view = (ctypes.c_char * nbytes).from_buffer(mv.cast("B"))
                self._keep.append((mv, view))
                bb = cache_state.block_bytes(self.ranks[i])
                nb = num_blocks if num_blocks is not None else nbytes // bb
                cpools[i] = _lib.PoolC(ctypes.addressof(view), nbytes, nb, bb)
        else:
            if not num_blocks:
                raise error_for(1, "kvxfer: num_blocks is needed when kvxfer allocates the pools")
            for i in range(n):
                cpools[i].num_blocks = num_blocks
        s, keep = cache_state._c()
        rk = (ctypes.c_int32 * n)(*self.ranks)
        h = ctypes.c_uint64()
        host = listen_host.encode() if listen_host else None
        g = ctypes.byref(group._c()) if group is not None else None
        _check(self._lib.kvxfer_transceiver_create(config._h, ctypes.byref(s), rk, n, cpools, g, host, ctypes.byref(h)))
        self._h = h.value
        self.block_bytes = [cpools[i].block_bytes for i in range(n)]
        if pools is not None:
            self.pools = [mv for mv, _ in self._keep]
        else:
            self.pools = []
            for i in range(n):
                arr = (ctypes.c_uint8 * cpools[i].size).from_address(cpools[i].base)
                arr.owner = self  # a pool the caller holds keeps the mapping (see __del__)
                # Cast to "B": a ctypes array's own format ("<B") is one a
                # memoryview can neither index nor assign through.
                self.pools.append(memoryview(arr).cast("B"))
        self.num_blocks = [cpools[i].num_blocks for i in range(n)]
        self._mu = threading.Lock()
        self._reqs = ({}, {})  # by id: context side, generation side
        self._tls = threading.local()  # each thread's array for the status calls

    # The block ids of req as the C ABI wants them: hosted rank by hosted
    # rank, with req's integers checked against their C types.
    def _blocks(self, req):
        _int("request_id", req.request_id, UINT64)
        _int(f"request {req.request_id}: dp_rank", req.dp_rank, INT32)
        _int(f"request {req.request_id}: num_tokens", req.num_tokens, INT32)
        ids = req.block_ids
        if len(ids) == 0 or not hasattr(ids[0], "__len__"):
            per = [list(ids)]  # a flat list: the blocks of a process hosting one rank
        else:
            per = [list(x) for x in ids]
        if len(per) != len(self.ranks):
            raise error_for(1, f"kvxfer: request {req.request_id}: block ids for {len(per)} ranks, this process hosts {len(self.ranks)}")
        nb = len(per[0])
        if any(len(x) != nb for x in per):
            raise error_for(1, f"kvxfer: request {req.request_id}: the hosted ranks have different numbers of blocks {[len(x) for x in per]}")
        flat = [_int(f"request {req.request_id}: block id", b, INT32) for x in per for b in x]
        return (ctypes.c_int32 * len(flat))(*flat), nb

    # _register records req as the request of its id on side gen (0: context,
    # 1: generation), in progress, before the call that starts it, so that a
    # status call of another thread finds it however soon it ends, and the
    # end state it sets is not overwritten afterwards. It returns what
    # _unregister needs to undo it, None when it did not: an id already
    # recorded is one in flight, whose request keeps its place (the library
    # refuses the second with InFlightError).
    def _register(self, gen, req):
        with self._mu:
            if req.request_id in self._reqs[gen]:
                return None
            self._reqs[gen][req.request_id] = req
            undo = (req.state, req.error)
            req.state = DISAGG_GENERATION_TRANS_IN_PROGRESS if gen else DISAGG_CONTEXT_TRANS_IN_PROGRESS
            req.error = None
            return undo

    # _unregister undoes _register after the call failed.
    def _unregister(self, gen, req, undo):
        if undo is None:
            return
        with self._mu:
            if self._reqs[gen].get(req.request_id) is req:
                del self._reqs[gen][req.request_id]
                req.state, req.error = undo

    def _handle(self):
        if not self._h:
            raise error_for(10, "kvxfer: the transceiver is shut down")
        return self._h

    def respond_and_send_async(self, req):
        """Context side: hand req, whose prefill is done, to the transceiver.
        Sets req.opaque_state (for the generation side) and the state
        DISAGG_CONTEXT_TRANS_IN_PROGRESS (before the call: a status call of
        another thread that reports its end first sets the end state).

        With the instance's ranks in several processes (a group), every
        process makes this call for the request, each at its own time, and
        req.opaque_state may be handed on as soon as one process has it: a
        generation rank's pull that reaches a rank before its process has
        made the call is held there (once the group has ordered another
        process's call for the request) and served when the call comes, or
        refused when kv_transfer_timeout_ms from the request's begin passes
        or the request fails on the instance first."""
        ids, nb = self._blocks(req)
        n = ctypes.c_size_t()
        buf = ctypes.create_string_buffer(4096)
        u8 = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8))
        undo = self._register(0, req)
        try:
            _check(self._lib.kvxfer_respond_and_send(self._handle(), req.request_id, req.dp_rank, req.num_tokens, ids, nb,
                                                     u8, len(buf), ctypes.byref(n)))
            if n.value > len(buf):
                buf = ctypes.create_string_buffer(n.value)
                u8 = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8))
                _check(self._lib.kvxfer_context_opaque_state(self._h, req.request_id, u8, len(buf), ctypes.byref(n)))
        except KvxferError:
            self._unregister(0, req, undo)
            raise
        req.opaque_state = buf.raw[: n.value]

    def request_and_receive_async(self, req):
        """Generation side: start pulling req's KV cache into req.block_ids
        from the context request req.opaque_state names. Sets
        DISAGG_GENERATION_TRANS_IN_PROGRESS."""
        ids, nb = self._blocks(req)
        op = bytes(req.opaque_state or b"")
        undo = self._register(1, req)
        try:
            _check(self._lib.kvxfer_request_and_receive(self._handle(), req.request_id, req.dp_rank, req.num_tokens, op, len(op), ids, nb))
        except KvxferError:
            self._unregister(1, req, undo)
            raise

    def request_and_receive_sync(self, req, timeout=None):
        """request_and_receive_async and a wait for the end (at most timeout
        seconds; the pull is cancelled then). Raises on failure; sets
        DISAGG_GENERATION_TRANS_COMPLETE on success. Not reported by
        check_gen_transfer_status."""
        ids, nb = self._blocks(req)
        op = bytes(req.opaque_state or b"")
        ms = -1 if timeout is None or timeout == float("inf") else min(int(timeout * 1000), INT64[1])
        req.state = DISAGG_GENERATION_TRANS_IN_PROGRESS
        try:
            _check(self._lib.kvxfer_request_and_receive_sync(self._handle(), req.request_id, req.dp_rank, req.num_tokens, op, len(op), ids, nb, ms))
        except KvxferError as e:
            req.state, req.error = DISAGG_TRANS_ERROR, e
            raise
        req.state, req.error = DISAGG_GENERATION_TRANS_COMPLETE, None

    def _check_status(self, gen, at_least, timeout):
        fn = self._lib.kvxfer_check_gen_status if gen else self._lib.kvxfer_check_context_status
        at = -1 if at_least is None else _int("at_least_request_num", at_least, INT32)
        deadline = None if timeout is None or timeout == float("inf") else time.monotonic() + timeout
        out = []
        n = ctypes.c_size_t()
        # The array is this thread's: another thread's status call, between
        # this one's library call and its reading, would write over a
        # shared one.
        finished = getattr(self._tls, "finished", None)
        if finished is None:
            finished = self._tls.finished = (_lib.FinishedC * _FINISHED_BATCH)()
        while True:
            ms = -1 if deadline is None else min(max(0, int((deadline - time.monotonic()) * 1000)), INT64[1])
            rc = fn(self._handle(), at, ms, finished, _FINISHED_BATCH, ctypes.byref(n))
            err = None
            if rc != _lib.OK:
                err = error_for(rc, self._lib.kvxfer_last_error().decode("utf-8", "replace"))
            for i in range(n.value):
                f = finished[i]
                out.append(self._finish(gen, f.request_id, f.status))
            if err is not None:
                if out:  # what ended is returned; the wait's failure is not lost for a later call
                    break
                raise err
            if n.value < _FINISHED_BATCH:
                break
            at = 0  # more are queued: collect them without waiting
        return out

    def _finish(self, gen, rid, status):
        with self._mu:
            req = self._reqs[gen].pop(rid, None)
        if req is None:
            req = Request(rid, [])
        if status == _lib.OK:
            req.state = DISAGG_GENERATION_TRANS_COMPLETE if gen else DISAGG_CONTEXT_COMPLETE
            req.error = None
        else:
            buf = ctypes.create_string_buffer(4096)
            n = ctypes.c_size_t()
            rc = self._lib.kvxfer_request_error(self._h, int(gen), rid, buf, len(buf), ctypes.byref(n))
            if rc == _lib.ERR_BUFFER_TOO_SMALL and n.value >= len(buf):  # a longer message: ask again with room for it
                buf = ctypes.create_string_buffer(n.value + 1)
                rc = self._lib.kvxfer_request_error(self._h, int(gen), rid, buf, len(buf), ctypes.byref(n))
            msg = buf.value.decode("utf-8", "replace") if rc == _lib.OK else f"request {rid} failed ({_lib.STATUS_NAMES.get(status)})"
            req.state, req.error = DISAGG_TRANS_ERROR, error_for(status, msg)
        return req

    def check_context_transfer_status(self, at_least_request_num=None, timeout=None):
        """The context requests whose transfers ended since the last call
        (state DISAGG_CONTEXT_COMPLETE, or DISAGG_TRANS_ERROR with
        req.error). Waits until at least at_least_request_num have ended or
        none is in flight: 0 never waits, None waits for every request in
        flight. timeout (seconds) bounds the wait: KvxferTimeoutError when
        it passes with nothing ended."""
        return self._check_status(0, at_least_request_num, timeout)

    def check_gen_transfer_status(self, at_least_request_num=None, timeout=None):
        """check_context_transfer_status for the generation side (states
        DISAGG_GENERATION_TRANS_COMPLETE or DISAGG_TRANS_ERROR)."""
        return self._check_status(1, at_least_request_num, timeout)

    def check_gen_transfer_complete(self):
        """True when no generation transfer is in flight."""
        c = ctypes.c_int32()
        _check(self._lib.kvxfer_gen_transfer_complete(self._handle(), ctypes.byref(c)))
        return bool(c.value)

    def cancel_request(self, req):
        """Cancels req's transfer on whichever side it is in flight; True
        when one was cancelled (it is then reported with CanceledError)."""
        c = ctypes.c_int32()
        _check(self._lib.kvxfer_cancel(self._handle(), _int("request_id", req.request_id, UINT64), ctypes.byref(c)))
        return bool(c.value)

    def gather_outbox(self):
        """Gather mode: this process's contribution to the next round."""
        n = ctypes.c_size_t()
        buf = ctypes.create_string_buffer(64 << 10)
        while True:
            rc = self._lib.kvxfer_group_outbox(self._handle(), ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)), len(buf), ctypes.byref(n))
            if rc == _lib.ERR_BUFFER_TOO_SMALL and n.value > len(buf):
                buf = ctypes.create_string_buffer(n.value)
                continue
            _check(rc)
            return buf.raw[: n.value]

    def gather_deliver(self, contributions):
        """Gather mode: applies a round: every process's contribution, in
        process order."""
        flat = b"".join(contributions)
        lens = (ctypes.c_size_t * len(contributions))(*[len(c) for c in contributions])
        _check(self._lib.kvxfer_group_deliver(self._handle(), flat, lens, len(contributions)))

    def gather_round(self, all_gather):
        """Gather mode: one round with all_gather(bytes) -> [bytes of every
        process, in process order] (e.g. torch.distributed.all_gather_object
        or an MPI allgather over the instance's processes). A failing
        all_gather fails the group on this process (gather_fail) and
        raises."""
        mine = self.gather_outbox()
        try:
            everyone = all_gather(mine)
        except Exception as e:
            self.gather_fail(f"all-gather failed: {e}")
            raise
        self.gather_deliver(everyone)

    def gather_fail(self, why):
        """Gather mode: a round failed: requests in flight fail, new ones are
        refused (GroupError)."""
        _check(self._lib.kvxfer_group_fail(self._handle(), why.encode()))

    def shutdown(self):
        """Fails the transfers in flight and closes the ranks. Pools kvxfer
        allocated are unmapped: self.pools must not be used afterwards. The
        caller's pools are no longer touched. Idempotent."""
        h, self._h = getattr(self, "_h", 0), 0
        if h:
            self.pools = []
            _check(self._lib.kvxfer_transceiver_close(h))
            self._keep = []

    def __del__(self):
        # Dropped without shutdown: close before the caller's pools this
        # object pins (self._keep) are let go, which the ranks would go on
        # writing into, and stop the ranks' goroutines and listeners. A pool
        # kvxfer allocated keeps this object alive while the caller holds
        # it (its owner), so that it is not unmapped under the caller. At
        # interpreter exit, or in a forked child (ForkedError), it is let go
        # quietly.
        try:
            self.shutdown()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False
