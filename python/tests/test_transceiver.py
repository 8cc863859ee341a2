"""The Python binding end to end: every instance in its own process (spawn),
pools filled from a seeded logical cache and checked against the numpy
reference sharding; failures (cancel, timeout, a dead peer, a bad config, a
bad opaque state, a forked child) as Python exceptions with kvxfer's
messages."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kvxfer
import reference
from conftest import TCP, GatherDriver, free_address, stop_process

HERE = os.path.dirname(os.path.abspath(__file__))


def model(**kw):
    base = dict(layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bf16")
    base.update(kw)
    return kvxfer.CacheState(**base)


def test_reference_shard_splits_heads_and_layers():
    """The numpy reference itself: TP2 ranks hold the halves of TP1's heads,
    PP2 ranks the halves of its layers, TP8 over 4 heads duplicates each."""
    one = model()
    cache = reference.logical(one, 20, seed=1)
    whole = reference.shard(cache, one, 0)
    assert whole.shape == (3, 4, 2, 4, 8, 32)
    assert not whole[2, :, :, :, 4:].any()  # token slots past the prompt stay zero
    tp2 = model(tp=2)
    np.testing.assert_array_equal(reference.shard(cache, tp2, 1), whole[:, :, :, 2:4])
    pp2 = model(pp=2)
    np.testing.assert_array_equal(reference.shard(cache, pp2, 1), whole[:, 2:4])
    tp8 = model(tp=8)
    np.testing.assert_array_equal(reference.shard(cache, tp8, 5), whole[:, :, :, 2:3])


@pytest.mark.parametrize("ctx_layout,gen_layout,ctx_own_memory", [
    (dict(tp=1), dict(tp=1), False),
    (dict(tp=2), dict(tp=1), False),
    (dict(tp=1), dict(tp=2), True),
    (dict(tp=2, pp=2), dict(tp=1), True),
])
def test_transfer_between_processes(ranks, ctx_layout, gen_layout, ctx_own_memory):
    """The context instance and the generation instance each in a process of
    its own; the generation pools match the reference sharding of the
    context's logical cache, bit for bit."""
    ctx_state, gen_state = model(**ctx_layout), model(**gen_layout)
    prefill = ranks(TCP, ctx_state, own_memory=ctx_own_memory)
    gen = ranks(TCP, gen_state, own_memory=True)
    assert prefill.ready == ("ok", None) and gen.ready == ("ok", None), (prefill.ready, gen.ready)
    cases = [(1, 40, 11, [3, 1, 4, 9, 5], [0, 7, 2, 6, 8]), (2, 8, 12, [10], [15])]
    for rid, tokens, seed, ctx_blocks, gen_blocks in cases:
        opaque = prefill.call("respond", rid, tokens, seed, ctx_blocks)
        assert isinstance(opaque, bytes) and opaque, opaque
        assert gen.call("receive", 100 + rid, tokens, opaque, gen_blocks) == kvxfer.DISAGG_GENERATION_TRANS_IN_PROGRESS
    done = gen.call("gen_status", None, 20)
    assert sorted(done) == [(101, kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, None, None),
                            (102, kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, None, None)]
    assert gen.call("gen_complete") is True
    for rid, tokens, seed, ctx_blocks, gen_blocks in cases:
        assert gen.call("verify", tokens, seed, gen_blocks) == [True] * gen_state.num_ranks
        assert gen.call("verify", tokens, seed + 1, gen_blocks) == [False] * gen_state.num_ranks  # the check can fail
    done = prefill.call("ctx_status", None, 20)
    assert sorted(done) == [(1, kvxfer.DISAGG_CONTEXT_COMPLETE, None, None), (2, kvxfer.DISAGG_CONTEXT_COMPLETE, None, None)]
    # A sync receive of a third request, reported by no status call.
    opaque = prefill.call("respond", 3, 16, 13, [11, 12])
    assert gen.call("receive_sync", 103, 16, opaque, [3, 4], 20) == kvxfer.DISAGG_GENERATION_TRANS_COMPLETE
    assert gen.call("verify", 16, 13, [3, 4]) == [True] * gen_state.num_ranks
    assert gen.call("gen_status", 0, 1) == []


@pytest.mark.parametrize("mode", ["coordinated", "gather"])
@pytest.mark.parametrize("split", ["context", "generation"])
def test_one_rank_per_process(ranks, mode, split):
    """The TP2 instance (context, or generation) runs each rank in a Python
    process of its own, agreeing through a coordinated group or through the
    test's all-gather (gather mode); the other instance is TP1. Every
    process makes the same calls; the generation pools match the reference
    sharding bit for bit, and every process reports every request."""
    tp2, tp1 = model(tp=2), model(tp=1)
    addr = free_address()
    group = (lambda p: ("coordinated", p, 2, addr)) if mode == "coordinated" else (lambda p: ("gather", p, 2))
    split_state = tp2
    procs = [ranks(TCP, split_state, ranks=[p], group=group(p), wait=False) for p in range(2)]
    for p in procs:
        assert p.wait_ready() == ("ok", None), p.ready
    driver = GatherDriver(procs) if mode == "gather" else None
    other = ranks(TCP, tp1)
    try:
        if split == "context":
            ctx_procs, gen_procs, gen_state = procs, [other], tp1
        else:
            ctx_procs, gen_procs, gen_state = [other], procs, tp2
        cases = [(1, 40, 21, [3, 1, 4, 9, 5], [0, 7, 2, 6, 8]), (2, 9, 22, [10, 11], [15, 14])]
        for rid, tokens, seed, ctx_blocks, gen_blocks in cases:
            opaques = []
            for p in ctx_procs:
                deadline = time.monotonic() + 10
                while True:  # a gather group joins at its first round
                    got = p.call("respond", rid, tokens, seed, ctx_blocks)
                    if isinstance(got, tuple) and got[1] == "GroupError" and time.monotonic() < deadline:
                        time.sleep(0.01)
                        continue
                    break
                assert isinstance(got, bytes), got
                opaques.append(got)
            for p in gen_procs:
                deadline = time.monotonic() + 10
                while True:
                    got = p.call("receive", 100 + rid, tokens, opaques[0], gen_blocks)
                    if isinstance(got, tuple) and got[1] == "GroupError" and time.monotonic() < deadline:
                        time.sleep(0.01)
                        continue
                    break
                assert got == kvxfer.DISAGG_GENERATION_TRANS_IN_PROGRESS, got
        for p in gen_procs:
            done = p.call("gen_status", None, 20)
            assert sorted(done) == [(101, kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, None, None),
                                    (102, kvxfer.DISAGG_GENERATION_TRANS_COMPLETE, None, None)], done
        for p in ctx_procs:
            done = p.call("ctx_status", None, 20)
            assert sorted(done) == [(1, kvxfer.DISAGG_CONTEXT_COMPLETE, None, None),
                                    (2, kvxfer.DISAGG_CONTEXT_COMPLETE, None, None)], done
        for rid, tokens, seed, ctx_blocks, gen_blocks in cases:
            matches = [m for p in gen_procs for m in p.call("verify", tokens, seed, gen_blocks)]
            assert matches == [True] * gen_state.num_ranks, matches
    finally:
        if driver:
            driver.close()
            assert driver.error is None, driver.error


def test_cancel(ranks):
    """A cancelled context request is reported failed with CanceledError and
    kvxfer's message; a pull of it afterwards fails."""
    prefill, gen = ranks(TCP, model()), ranks(TCP, model())
    opaque = prefill.call("respond", 1, 16, 1, [0, 1])
    assert prefill.call("cancel", 1) is True
    assert prefill.call("cancel", 1) is False
    [(rid, state, err, msg)] = prefill.call("ctx_status", 1, 10)
    assert (rid, state, err) == (1, kvxfer.DISAGG_TRANS_ERROR, "CanceledError")
    assert msg.startswith("capi: context request 1: ") and "request 1 cancelled" in msg, msg
    gen.call("receive", 7, 16, opaque, [0, 1])
    [(rid, state, err, msg)] = gen.call("gen_status", 1, 20)
    assert (rid, state) == (7, kvxfer.DISAGG_TRANS_ERROR) and err is not None and msg, (err, msg)


def test_sync_timeout(ranks):
    """A sync receive from a context process that does not answer (stopped)
    raises KvxferTimeoutError at its timeout, and cancels the pull."""
    prefill, gen = ranks(TCP, model()), ranks(TCP, model())
    opaque = prefill.call("respond", 1, 16, 1, [0, 1])
    try:
        stop_process(prefill.proc.pid)
        t0 = time.monotonic()
        ans = gen.call("receive_sync", 5, 16, opaque, [0, 1], 1.0)
        took = time.monotonic() - t0
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    assert ans[:3] == ("err", "KvxferTimeoutError", "KVXFER_ERR_TIMEOUT"), ans
    assert "did not end in time" in ans[3]
    assert 0.9 < took < 10, took
    assert gen.call("gen_complete") is True


def test_peer_death(ranks):
    """The context process dies after handing out its opaque state: the pull
    fails with an exception that says the peer is gone, and nothing hangs."""
    prefill, gen = ranks(TCP, model()), ranks(TCP, model())
    opaque = prefill.call("respond", 1, 16, 1, [0, 1])
    prefill.proc.kill()
    prefill.proc.join()
    gen.call("receive", 9, 16, opaque, [2, 3])
    [(rid, state, err, msg)] = gen.call("gen_status", 1, 20)
    assert (rid, state, err) == (9, kvxfer.DISAGG_TRANS_ERROR, "PeerError"), (err, msg)
    assert msg.startswith("capi: generation request 9: ") and "peer lost" in msg, msg


def test_bad_config(tmp_path):
    """A bad config raises ConfigError with config check's message
    (file:line:col, the key, the valid values)."""
    with pytest.raises(kvxfer.ConfigError) as e:
        kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "PIGEON"}}, name="engine.json")
    assert e.value.status == "KVXFER_ERR_CONFIG"
    assert str(e.value).startswith('engine.json:1:'), str(e.value)
    assert 'cache_transceiver_config.backend: unknown backend "PIGEON" (valid:' in str(e.value)
    path = str(tmp_path / "bad-config.yaml")
    with open(path, "w") as f:
        f.write("cache_transceiver_config:\n  backend: TCP\n  kv_transfer_timeout_ms: -5\n")
    with pytest.raises(kvxfer.ConfigError) as e:
        kvxfer.Config.from_file(path)
    assert str(e.value).startswith(path + ":3:"), str(e.value)
    assert "kv_transfer_timeout_ms" in str(e.value)
    with pytest.raises(kvxfer.ConfigError, match="no such file"):
        kvxfer.Config.from_file(str(tmp_path / "missing.yaml"))


def test_bad_opaque_state_and_arguments():
    """In this process: a bad opaque state, a reused id, a bad block id, a
    closed transceiver."""
    cfg = kvxfer.Config.from_dict(TCP)
    pool = np.zeros(4 * model().block_bytes(), dtype=np.uint8)
    with kvxfer.KvCacheTransceiver(cfg, model(), pools=[pool]) as tr:
        with pytest.raises(kvxfer.BadOpaqueStateError, match="opaque state"):
            tr.request_and_receive_async(kvxfer.Request(1, [0], opaque_state=b"not an opaque state"))
        req = kvxfer.Request(2, [0, 1], num_tokens=10)
        tr.respond_and_send_async(req)
        assert req.state == kvxfer.DISAGG_CONTEXT_TRANS_IN_PROGRESS and len(req.opaque_state) > 0
        with pytest.raises(kvxfer.InFlightError, match="context request 2 is already in flight"):
            tr.respond_and_send_async(kvxfer.Request(2, [2]))
        with pytest.raises(kvxfer.InvalidArgumentError, match=r"block 9 of rank 0 is out of range \[0,4\)"):
            tr.respond_and_send_async(kvxfer.Request(3, [9]))
        t0 = time.monotonic()
        assert tr.check_context_transfer_status(0) == []  # at_least 0 never waits
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(kvxfer.KvxferTimeoutError):
            tr.check_context_transfer_status(1, timeout=0.05)
        # The held request's reply to a generation side of another model.
        other = kvxfer.CacheState(layers=2, kv_heads=4, head_dim=32, tokens_per_block=8)
        with kvxfer.KvCacheTransceiver(cfg, other, num_blocks=4) as gen:
            with pytest.raises(kvxfer.IncompatibleError):
                gen.request_and_receive_async(kvxfer.Request(5, [0, 1], opaque_state=req.opaque_state))
    tr.shutdown()  # idempotent
    with pytest.raises(kvxfer.ClosedError):
        tr.check_gen_transfer_complete()
    with pytest.raises(kvxfer.InvalidArgumentError, match="cache state"):
        kvxfer.KvCacheTransceiver(cfg, model(kv_heads=3, tp=2), num_blocks=4)


def test_forked_child_gets_an_error_not_a_hang():
    """A child forked after the library was loaded gets ForkedError from
    every call, at once (checked in C before entering Go)."""
    script = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, %r)
        import kvxfer
        kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "TCP"}})  # loads the library
        pid = os.fork()
        if pid == 0:
            try:
                kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "TCP"}})
                os._exit(3)
            except kvxfer.ForkedError as e:
                ok = "forked child" in str(e) and e.status == "KVXFER_ERR_FORKED"
                os._exit(0 if ok else 4)
            except BaseException:
                os._exit(5)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """) % os.path.dirname(HERE)
    r = subprocess.run([sys.executable, "-c", script], timeout=30, capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr)


def test_last_error_is_per_thread():
    """kvxfer_last_error belongs to the calling thread: a failure on another
    thread between a call and the read of its message does not replace it."""
    import ctypes
    import threading

    from kvxfer import _lib

    lib = _lib.lib()
    first_failed, second_failed = threading.Event(), threading.Event()
    seen = {}

    def fail(name, after, then):
        if after:
            after.wait(10)
        h = ctypes.c_uint64()
        rc = lib.kvxfer_config_load_yaml(b"x: [", 4, name.encode(), ctypes.byref(h))
        then.set()
        if name == "first":
            second_failed.wait(10)  # the other thread has failed since
        seen[name] = (rc, lib.kvxfer_last_error().decode())

    a = threading.Thread(target=fail, args=("first", None, first_failed))
    b = threading.Thread(target=fail, args=("second", first_failed, second_failed))
    a.start(), b.start()
    a.join(10), b.join(10)
    assert seen["first"][0] == seen["second"][0] == 2, seen
    assert seen["first"][1].startswith("first:") and seen["second"][1].startswith("second:"), seen


def test_rank_process_death_fails_the_instance(ranks):
    """A TP2 context instance with a process per rank (coordinated): when the
    process of rank 1 dies, the request held on rank 0 fails there too, and
    the generation side's pull fails; nothing hangs."""
    addr = free_address()
    tp2 = model(tp=2)
    procs = [ranks(TCP, tp2, ranks=[p], group=("coordinated", p, 2, addr), wait=False) for p in range(2)]
    for p in procs:
        assert p.wait_ready() == ("ok", None), p.ready
    gen = ranks(TCP, model())
    opaque = [p.call("respond", 1, 16, 5, [0, 1]) for p in procs][0]
    assert isinstance(opaque, bytes), opaque
    procs[1].proc.kill()
    procs[1].proc.join()
    [(rid, state, err, msg)] = procs[0].call("ctx_status", 1, 20)
    assert (rid, state, err) == (1, kvxfer.DISAGG_TRANS_ERROR, "GroupError"), (err, msg)
    assert "process 1 (ranks 1) left" in msg, msg
    gen.call("receive", 9, 16, opaque, [2, 3])
    [(rid, state, err, msg)] = gen.call("gen_status", 1, 20)
    assert (rid, state, err) == (9, kvxfer.DISAGG_TRANS_ERROR, "PeerError"), (err, msg)
