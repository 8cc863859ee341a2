"""The binding's own bookkeeping under a careless or concurrent caller, in
this process (a context and a generation instance side by side): what it
keeps per request, what it hands ctypes, and what it frees."""

import ctypes
import gc
import threading

import numpy as np
import pytest

import kvxfer
from conftest import TCP
from kvxfer import _lib


def model(**kw):
    base = dict(layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bf16")
    base.update(kw)
    return kvxfer.CacheState(**base)


def test_reused_id_keeps_the_request_in_flight():
    """A second respond (or receive) with the id of a request in flight is
    refused (InFlightError), and the first request stays the one its status
    call reports: its own object, with its state and blocks."""
    cfg = kvxfer.Config.from_dict(TCP)
    with kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=8) as ctx, \
            kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=8) as gen:
        first = kvxfer.Request(1, [0, 1], num_tokens=16)
        ctx.respond_and_send_async(first)
        with pytest.raises(kvxfer.InFlightError):
            ctx.respond_and_send_async(kvxfer.Request(1, [2, 3], num_tokens=16))
        pull = kvxfer.Request(7, [4, 5], num_tokens=16, opaque_state=first.opaque_state)
        gen.request_and_receive_async(pull)
        with pytest.raises(kvxfer.InFlightError):
            gen.request_and_receive_async(kvxfer.Request(7, [6, 7], num_tokens=16, opaque_state=first.opaque_state))
        [got] = gen.check_gen_transfer_status(1, timeout=20)
        assert got is pull and pull.state == kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, (got, pull.error)
        [got] = ctx.check_context_transfer_status(1, timeout=20)
        assert got is first and first.state == kvxfer.DISAGG_CONTEXT_COMPLETE, (got, first.error)


class _Between:
    """The library, but after the call named name returns (before the
    binding's code after it runs) it runs then() on another thread and
    waits for it: a status call of another thread in that window."""

    def __init__(self, real, name, then):
        self._real, self._name, self._then = real, name, then

    def __getattr__(self, attr):
        fn = getattr(self._real, attr)
        if attr != self._name:
            return fn

        def call(*args):
            rc = fn(*args)
            t = threading.Thread(target=self._then)
            t.start()
            t.join(30)
            return rc

        return call


def test_a_request_that_ends_at_once_keeps_its_end_state():
    """A request that ends, and is reported by another thread's status call,
    before respond_and_send_async or request_and_receive_async returns keeps
    the state that call gave it (the end), not IN_PROGRESS."""
    cfg = kvxfer.Config.from_dict(TCP)
    with kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=8) as ctx, \
            kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=8) as gen:
        seen = []
        real = ctx._lib

        def cancel_and_report():
            real.kvxfer_cancel(ctx._h, 1, None)
            seen.extend(ctx.check_context_transfer_status(1, timeout=20))

        ctx._lib = _Between(real, "kvxfer_respond_and_send", cancel_and_report)
        req = kvxfer.Request(1, [0, 1], num_tokens=16)
        ctx.respond_and_send_async(req)
        ctx._lib = real
        assert seen == [req], seen
        assert req.state == kvxfer.DISAGG_TRANS_ERROR and isinstance(req.error, kvxfer.CanceledError), (req.state, req.error)

        done = kvxfer.Request(2, [2, 3], num_tokens=16)
        ctx.respond_and_send_async(done)
        gen._lib = _Between(gen._lib, "kvxfer_request_and_receive",
                            lambda: seen.extend(gen.check_gen_transfer_status(1, timeout=20)))
        pull = kvxfer.Request(8, [4, 5], num_tokens=16, opaque_state=done.opaque_state)
        gen.request_and_receive_async(pull)
        gen._lib = real
        assert seen[1:] == [pull], seen
        assert pull.state == kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, (pull.state, pull.error)


def test_status_calls_of_two_threads_keep_their_own_results():
    """Two threads' status calls on one transceiver (its context and its
    generation side) each get their own side's requests: the other's call,
    between one's library call and its reading of the results, does not
    write over them."""
    cfg = kvxfer.Config.from_dict(TCP)
    with kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=8) as tr, \
            kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=8) as other:
        cancelled = kvxfer.Request(1, [0, 1], num_tokens=16)
        tr.respond_and_send_async(cancelled)
        assert tr.cancel_request(cancelled)
        src = kvxfer.Request(2, [0, 1], num_tokens=16)
        other.respond_and_send_async(src)
        pull = kvxfer.Request(8, [4, 5], num_tokens=16, opaque_state=src.opaque_state)
        tr.request_and_receive_async(pull)
        while not tr.check_gen_transfer_complete():
            threading.Event().wait(0.01)
        gen_seen = []
        real = tr._lib
        tr._lib = _Between(real, "kvxfer_check_context_status",
                           lambda: gen_seen.extend(tr.check_gen_transfer_status(1, timeout=20)))
        try:
            ctx_seen = tr.check_context_transfer_status(1, timeout=20)
        finally:
            tr._lib = real
        assert gen_seen == [pull] and pull.state == kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, (gen_seen, pull)
        assert ctx_seen == [cancelled] and isinstance(cancelled.error, kvxfer.CanceledError), (ctx_seen, cancelled)


def test_integers_that_do_not_fit_are_refused():
    """ctypes cuts an int to its C type without a word (2**32 + 1 as an
    int32 is 1): every integer the binding hands the library is checked
    against its C type first, and one that does not fit is an
    InvalidArgumentError naming it, not another block, id or shape."""
    cfg = kvxfer.Config.from_dict(TCP)
    pool = np.zeros(4 * model().block_bytes(), dtype=np.uint8)
    with kvxfer.KvCacheTransceiver(cfg, model(), pools=[pool]) as tr:
        for req, what in [
            (kvxfer.Request(1, [2**32 + 1]), "block id"),
            (kvxfer.Request(2**64 + 2, [0]), "request_id"),
            (kvxfer.Request(-1, [0]), "request_id"),
            (kvxfer.Request(3, [0], num_tokens=2**32 + 16), "num_tokens"),
            (kvxfer.Request(4, [0], dp_rank=2**32), "dp_rank"),
        ]:
            with pytest.raises(kvxfer.InvalidArgumentError, match=what):
                tr.respond_and_send_async(req)
            assert req.opaque_state is None and req.state == kvxfer.CONTEXT_INIT, req
        with pytest.raises(kvxfer.InvalidArgumentError, match="at_least"):
            tr.check_context_transfer_status(2**32 + 1)
        with pytest.raises(kvxfer.InvalidArgumentError, match="request_id"):
            tr.cancel_request(kvxfer.Request(2**64, [0]))
        assert tr.check_context_transfer_status(0) == []  # nothing was started
    with pytest.raises(kvxfer.InvalidArgumentError, match="layers"):
        model(layers=2**32 + 4).block_bytes()
    with pytest.raises(kvxfer.InvalidArgumentError, match="rank"):
        model(tp=2).block_bytes(2**32)
    with pytest.raises(kvxfer.InvalidArgumentError, match="ranks"):
        kvxfer.KvCacheTransceiver(cfg, model(tp=2), num_blocks=4, ranks=[2**32], group=kvxfer.GatherGroup(0, 2))
    with pytest.raises(kvxfer.InvalidArgumentError, match="num_blocks"):
        kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=2**32 + 4)


def _open(h):
    """Whether transceiver handle h is still open in the library."""
    c = ctypes.c_int32()
    rc = _lib.lib().kvxfer_gen_transfer_complete(h, ctypes.byref(c))
    assert rc in (0, 3), (rc, _lib.lib().kvxfer_last_error())
    return rc == 0


def test_a_dropped_transceiver_is_closed():
    """A transceiver dropped without shutdown is closed when collected
    (before the caller's pools it pins are let go, which it would otherwise
    go on writing into), and not before: kvxfer's own pools, while the
    caller holds one, keep it open and mapped."""
    cfg = kvxfer.Config.from_dict(TCP)
    tr = kvxfer.KvCacheTransceiver(cfg, model(), pools=[bytearray(4 * model().block_bytes())])
    h = tr._h
    del tr
    gc.collect()
    assert not _open(h), "a dropped transceiver is still open"

    tr = kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=4)
    h, pools = tr._h, tr.pools
    del tr
    gc.collect()
    assert _open(h), "closed while the caller holds its pools"
    pools[0][0] = 7  # still mapped
    assert pools[0][0] == 7
    del pools
    gc.collect()
    assert not _open(h), "a dropped transceiver is still open once its pools are dropped too"


def test_dropped_at_exit_and_in_a_forked_child():
    """At interpreter exit, and in a forked child (where every call is
    refused), a transceiver never shut down is let go quietly: no exception
    printed from __del__, exit status 0."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, %r)
        import kvxfer
        cfg = kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "TCP"}})
        tr = kvxfer.KvCacheTransceiver(cfg, kvxfer.CacheState(layers=4, kv_heads=4, head_dim=32, tokens_per_block=8),
                                       num_blocks=4)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the child's interpreter exits, collecting tr
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """) % os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_kvxfer_pools_are_bytes():
    """The pools kvxfer allocates are memoryviews of bytes the caller can
    index and assign through, as the caller's own (a bytearray) are."""
    cfg = kvxfer.Config.from_dict(TCP)
    with kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=4) as tr:
        pool = tr.pools[0]
        assert pool.format == "B" and pool.nbytes == 4 * model().block_bytes()
        pool[0], pool[-1] = 7, 9
        assert (pool[0], pool[-1]) == (7, 9)
        assert np.frombuffer(pool, dtype=np.uint8)[-1] == 9


def test_config_without_a_name():
    """name=None is the header's NULL name: messages then say "config"."""
    kvxfer.Config.from_yaml("cache_transceiver_config: {backend: TCP}\n", name=None).close()
    with pytest.raises(kvxfer.ConfigError, match=r"^config:1:"):
        kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "PIGEON"}}, name=None)


def test_a_long_request_error_is_whole():
    """A failed request's message longer than the binding's first buffer
    (here the reason a process gave for failing its group) reaches
    req.error whole, not as a stand-in naming only the status."""
    cfg = kvxfer.Config.from_dict(TCP)
    tp2 = model(tp=2)
    procs = [kvxfer.KvCacheTransceiver(cfg, tp2, num_blocks=4, ranks=[p], group=kvxfer.GatherGroup(p, 2)) for p in range(2)]
    try:
        reqs = [kvxfer.Request(1, [0], num_tokens=8) for _ in procs]
        for _ in range(1000):
            everyone = [p.gather_outbox() for p in procs]
            for p in procs:
                p.gather_deliver(everyone)
            try:
                procs[0].respond_and_send_async(reqs[0])
                break
            except kvxfer.GroupError:  # not joined yet
                continue
        why = "the communicator said: " + "x" * 10000
        procs[0].gather_fail(why)
        [got] = procs[0].check_context_transfer_status(1, timeout=20)
        assert got is reqs[0] and isinstance(got.error, kvxfer.GroupError), (got.state, got.error)
        assert why in str(got.error), str(got.error)[:300]
    finally:
        for p in procs:
            p.shutdown()


def test_config_as_a_context_manager():
    """A Config is freed at the end of a with block, as a transceiver is shut
    down; transceivers made from it stay valid."""
    with kvxfer.Config.from_dict(TCP) as cfg:
        tr = kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=4)
    assert cfg._h == 0
    with tr:
        assert tr.check_gen_transfer_complete()
    with pytest.raises(kvxfer.BadHandleError, match="config handle"):
        kvxfer.KvCacheTransceiver(cfg, model(), num_blocks=4)
