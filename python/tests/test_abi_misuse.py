"""The C ABI under a careless caller, called through ctypes in this process:
lengths and counts that do not fit, NULLs where the header wants an array.
Each must be refused with KVXFER_ERR_INVALID_ARGUMENT and a message that
names the argument, never KVXFER_ERR_INTERNAL (a panic of kvxfer) nor a
silent default."""

import ctypes

import pytest

import kvxfer
from conftest import TCP
from kvxfer import _lib

SIZE_MAX = 2**64 - 1
INVALID_ARGUMENT = 1


def _state(tp=1):
    s, keep = kvxfer.CacheState(layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, tp=tp)._c()
    return s, keep


def _create(cfg, state, ranks, n_ranks, pools, group=None):
    lib = _lib.lib()
    h = ctypes.c_uint64()
    rc = lib.kvxfer_transceiver_create(cfg._h, ctypes.byref(state), ranks, n_ranks, pools, group, None, ctypes.byref(h))
    return rc, lib.kvxfer_last_error().decode(), h.value


def test_lengths_that_overflow_are_invalid_arguments():
    """size_t counts past what an int holds (SIZE_MAX, or lens that sum past
    it) are refused as invalid arguments, naming the argument."""
    lib = _lib.lib()
    cfg = kvxfer.Config.from_dict(TCP)
    s, _keep = _state(tp=2)
    pools = (_lib.PoolC * 2)()
    for p in pools:
        p.num_blocks = 4
    ranks = (ctypes.c_int32 * 2)(0, 1)
    rc, msg, h = _create(cfg, s, ranks, SIZE_MAX, pools)
    if rc == 0:
        lib.kvxfer_transceiver_close(h)
    assert (rc, "n_ranks" in msg) == (INVALID_ARGUMENT, True), (rc, msg)

    mem = ctypes.create_string_buffer(64)
    big = (_lib.PoolC * 1)()
    big[0].base, big[0].size, big[0].num_blocks = ctypes.addressof(mem), SIZE_MAX, 1
    s1, _keep1 = _state()
    rc, msg, h = _create(cfg, s1, None, 0, big)
    if rc == 0:
        lib.kvxfer_transceiver_close(h)
    assert (rc, "pools[0]" in msg and "size" in msg) == (INVALID_ARGUMENT, True), (rc, msg)

    with kvxfer.KvCacheTransceiver(cfg, kvxfer.CacheState(layers=4, kv_heads=4, head_dim=32, tokens_per_block=8, tp=2),
                                   num_blocks=4, ranks=[0], group=kvxfer.GatherGroup(0, 2)) as tr:
        for lens in ([SIZE_MAX, 1], [2**63, 2**63], [SIZE_MAX]):
            arr = (ctypes.c_size_t * len(lens))(*lens)
            rc = lib.kvxfer_group_deliver(tr._h, b"x", arr, len(lens))
            msg = lib.kvxfer_last_error().decode()
            assert (rc, "lens" in msg) == (INVALID_ARGUMENT, True), (lens, rc, msg)


def test_null_ranks_with_a_count_is_refused():
    """ranks NULL with n_ranks > 0 is inconsistent: the header's "every rank"
    is NULL and 0. It is refused, not taken as every rank."""
    lib = _lib.lib()
    cfg = kvxfer.Config.from_dict(TCP)
    s, _keep = _state()
    pools = (_lib.PoolC * 1)()
    pools[0].num_blocks = 4
    rc, msg, h = _create(cfg, s, None, 1, pools)
    if rc == 0:
        lib.kvxfer_transceiver_close(h)
    assert (rc, "ranks is NULL" in msg) == (INVALID_ARGUMENT, True), (rc, msg)


def test_a_long_message_is_whole():
    """kvxfer_last_error holds the whole message however long (config check's
    every problem at once): it was cut at 4095 bytes, in the middle of a
    line, and the problems after it were lost."""
    keys = "".join(f"  bogus_key_{i}: {i}\n" for i in range(300))
    try:
        kvxfer.Config.from_yaml("cache_transceiver_config:\n  backend: TCP\n" + keys)
    except kvxfer.ConfigError as e:
        msg = str(e)
    else:
        raise AssertionError("300 unknown keys loaded")
    assert len(msg) > 4096, len(msg)
    assert msg.count("unknown key") == 300 and "cache_transceiver_config.bogus_key_299: unknown key" in msg, msg[-300:]
    # Past 1 MiB (80,000 problems) it is cut at a line, and says so.
    keys = "".join(f"  k{i}: 1\n" for i in range(80000))
    with pytest.raises(kvxfer.ConfigError) as e:
        kvxfer.Config.from_yaml("cache_transceiver_config:\n  backend: TCP\n" + keys)
    msg = str(e.value)
    assert len(msg) <= 1 << 20 and msg.endswith("transceiver_runtime)\n(kvxfer: message cut here)"), (len(msg), msg[-200:])
    h = ctypes.c_uint64()
    lib = _lib.lib()
    assert lib.kvxfer_config_load_yaml(b"x: [", 4, b"short", ctypes.byref(h)) == 2
    assert lib.kvxfer_last_error().decode().startswith("short:"), "a short message after a long one"


def test_a_bad_log_level_is_said():
    """KVXFER_LOG_LEVEL with a value that is not a level is said on stderr,
    naming the variable, rather than silently taken for warn."""
    import os
    import subprocess
    import sys

    script = ("import sys; sys.path.insert(0, %r); import kvxfer; "
              "kvxfer.Config.from_dict({'cache_transceiver_config': {'backend': 'TCP'}})") % os.path.dirname(
                  os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KVXFER_LOG_LEVEL="verbose")
    r = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "KVXFER_LOG_LEVEL=verbose" in r.stderr and "debug, info, warn or error" in r.stderr, r.stderr
