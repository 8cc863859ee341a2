"""A complete example of kvxfer's Python binding: a context instance of TP2,
one process per rank (agreeing through a coordinated group), hands a
request's KV cache to a generation instance of TP1 in a third process,
which checks every byte.

    make lib
    KVXFER_LIB=lib/libkvxfer.so PYTHONPATH=python /usr/bin/python3 examples/python/transfer.py

Each block holds [layers][kv][heads][tokens_per_block][head_dim] elements
of the rank's heads (layout.CacheState.RankLayout); a context rank of TP2
holds half the heads, the generation rank all of them. The example fills
every element with a value computed from its logical coordinates, so the
generation side can check its blocks without the context side's.
"""

import multiprocessing as mp
import socket
import sys

import numpy as np

import kvxfer

CONFIG = {"cache_transceiver_config": {"backend": "TCP", "kv_transfer_timeout_ms": 20000}}
SHAPE = dict(layers=4, kv_heads=8, head_dim=64, tokens_per_block=16, dtype="fp16")
TOKENS, BLOCKS, POOL_BLOCKS = 100, 7, 16  # 100 tokens fill 7 blocks of 16


def element(block, layer, kv, head, token, dim):
    """The value of one logical element, as a uint16 (the fp16 bits)."""
    return (block * 7919 + layer * 613 + kv * 101 + head * 31 + token * 7 + dim) % 65521


def fill(pool, state, rank, blocks):
    """Writes the elements rank holds into its blocks."""
    heads = state.kv_heads // state.tp
    lo = (rank % state.tp) * heads
    view = np.frombuffer(pool, dtype=np.uint16).reshape(
        POOL_BLOCKS, state.layers, 2, heads, state.tokens_per_block, state.head_dim)
    b, l, kv, h, t, d = np.indices((len(blocks), state.layers, 2, heads, state.tokens_per_block, state.head_dim))
    view[blocks] = element(b, l, kv, h + lo, t, d).astype(np.uint16)


def context_rank(rank, coordinator, opaque_out):
    """One context rank of the TP2 instance, in its own process."""
    state = kvxfer.CacheState(tp=2, **SHAPE)
    pool = np.zeros(POOL_BLOCKS * state.block_bytes(rank), dtype=np.uint8)
    group = kvxfer.CoordinatedGroup(process=rank, processes=2, coordinator=coordinator)
    with kvxfer.KvCacheTransceiver(kvxfer.Config.from_dict(CONFIG), state, pools=[pool],
                                   ranks=[rank], group=group) as tr:
        blocks = [2, 3, 5, 8, 9, 10, 15]  # wherever the engine put the prompt's KV
        fill(pool, state, rank, blocks)
        req = kvxfer.Request(request_id=7, block_ids=blocks, num_tokens=TOKENS)
        tr.respond_and_send_async(req)  # every rank makes the same call, each at its own time
        if rank == 0:
            # Any rank's state serves, as soon as that rank has it: a pull that
            # reaches rank 1 before rank 1's call is held there until the call.
            opaque_out.send(req.opaque_state)  # the router carries it
        for done in tr.check_context_transfer_status(1, timeout=30):
            if done.error is not None:
                raise done.error
        print(f"context rank {rank}: request {req.request_id} sent, {done.state}")


def generation(opaque_in):
    """The TP1 generation instance: pulls the request into its own blocks."""
    state = kvxfer.CacheState(tp=1, **SHAPE)
    pool = np.zeros(POOL_BLOCKS * state.block_bytes(0), dtype=np.uint8)
    with kvxfer.KvCacheTransceiver(kvxfer.Config.from_dict(CONFIG), state, pools=[pool]) as tr:
        blocks = [0, 1, 4, 6, 11, 12, 13]
        req = kvxfer.Request(request_id=70, block_ids=blocks, num_tokens=TOKENS, opaque_state=opaque_in.recv())
        tr.request_and_receive_sync(req, timeout=30)
        got = np.frombuffer(pool, dtype=np.uint16).reshape(
            POOL_BLOCKS, state.layers, 2, state.kv_heads, state.tokens_per_block, state.head_dim)[blocks]
        want = element(*np.indices(got.shape)).astype(np.uint16)
        if not np.array_equal(got, want):
            raise SystemExit(f"generation: {np.count_nonzero(got != want)} elements differ")
        print(f"generation: {got.nbytes} bytes in {len(blocks)} blocks, equal to what the context ranks wrote")


def free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


def main():
    mp.set_start_method("spawn")  # load the library only in the final processes, never before a fork
    recv, send = mp.Pipe(duplex=False)
    coordinator = free_address()
    procs = [mp.Process(target=context_rank, args=(r, coordinator, send)) for r in (0, 1)]
    procs.append(mp.Process(target=generation, args=(recv,)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    failed = [p for p in procs if p.exitcode != 0]
    for p in failed:
        print(f"{p.name}: exit code {p.exitcode}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
