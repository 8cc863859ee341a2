"""Transfer throughput through the Python binding, to compare with
`kvxfer bench` on the same pairing: the context instance in a process of its
own (all its ranks, or one process per rank with --split), the generation
instance (TP1) in this one; requests one at a time (concurrency 1), each
timed from request_and_receive_async to its report by
check_gen_transfer_status, GB/s = bytes received / time, as kvxfer bench
measures.

Usage: KVXFER_LIB=lib/libkvxfer.so python3 python/benchmarks/throughput.py
       [--ctx-tp 2] [--isl 4096] [--requests 20] [--split]
"""

import argparse
import multiprocessing
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CFG = {"cache_transceiver_config": {"backend": "TCP", "kv_transfer_timeout_ms": 60000}}
MODEL = dict(layers=32, kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bf16")  # llama-3.1-8b


def context(conn, tp, blocks, ranks, group):
    import kvxfer

    state = kvxfer.CacheState(tp=tp, **MODEL)
    g = kvxfer.CoordinatedGroup(*group) if group else None
    tr = kvxfer.KvCacheTransceiver(kvxfer.Config.from_dict(CFG), state, num_blocks=blocks, ranks=ranks, group=g)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            tr.shutdown()
            return
        rid, tokens = msg
        req = kvxfer.Request(rid, [list(range(blocks))] * len(tr.ranks), num_tokens=tokens)
        tr.respond_and_send_async(req)
        conn.send(req.opaque_state)
        tr.check_context_transfer_status(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx-tp", type=int, default=2)
    ap.add_argument("--isl", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--split", action="store_true", help="one context process per rank (coordinated group)")
    a = ap.parse_args()
    import kvxfer

    blocks = -(-a.isl // MODEL["tokens_per_block"])
    mp = multiprocessing.get_context("spawn")
    procs, conns = [], []
    layouts = [(list(range(a.ctx_tp)), None)]
    if a.split:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr = "127.0.0.1:%d" % s.getsockname()[1]
        layouts = [([r], (r, a.ctx_tp, addr)) for r in range(a.ctx_tp)]
    for ranks, group in layouts:
        mine, theirs = mp.Pipe()
        p = mp.Process(target=context, args=(theirs, a.ctx_tp, blocks, ranks, group), daemon=True)
        p.start()
        procs.append(p)
        conns.append(mine)
    for c in conns:
        assert c.recv() == "ready"
    state = kvxfer.CacheState(tp=1, **MODEL)
    gen = kvxfer.KvCacheTransceiver(kvxfer.Config.from_dict(CFG), state, num_blocks=blocks)
    nbytes = blocks * state.block_bytes(0)
    measured, n = 0.0, 0
    for i in range(a.warmup + a.requests):
        for c in conns:
            c.send((i + 1, a.isl))
        opaque = [c.recv() for c in conns][0]
        req = kvxfer.Request(1000 + i, list(range(blocks)), num_tokens=a.isl, opaque_state=opaque)
        t0 = time.perf_counter()
        gen.request_and_receive_async(req)
        [done] = gen.check_gen_transfer_status(None)
        dt = time.perf_counter() - t0
        assert done.error is None, done.error
        if i >= a.warmup:
            measured += dt
            n += 1
    gen.shutdown()
    for c in conns:
        c.send(None)
    for p in procs:
        p.join(30)
    print(f"binding: ctx TP{a.ctx_tp}{' (a process per rank)' if a.split else ''} -> gen TP1, llama-3.1-8b bf16, ISL {a.isl}, "
          f"{n} requests of {nbytes / 2**20:.0f} MiB: {n * nbytes / measured / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
