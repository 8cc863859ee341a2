"""The ranks of the tests, each run in a process of its own (multiprocessing,
spawn: the library is loaded only in the final process). A worker takes
commands from a pipe and answers each with a tuple ("ok", value) or
("err", exception class name, status, message)."""

import numpy as np

import kvxfer
import reference


def _blocks_view(pool, state, rank, num_blocks):
    """The pool as an array [blocks][layers][kv][heads][tpb][head_dim] of the
    dtype's unsigned integer type."""
    pp = rank // state.tp
    lo, hi = reference.layer_range(state, pp)
    hlo, hhi = reference.head_range(state, rank)
    dt = reference._UINT[reference.SIZES[state.dtype]]
    shape = (num_blocks, hi - lo, reference.kv_factor(state), hhi - hlo, state.tokens_per_block, state.head_dim)
    return np.frombuffer(pool, dtype=dt, count=int(np.prod(shape))).reshape(shape)


def _serve_gather(tr, conn):
    """Answers the test's all-gather rounds (gather mode) on a pipe of its
    own, beside the commands."""
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "outbox":
                conn.send(("ok", tr.gather_outbox()))
            elif cmd == "deliver":
                tr.gather_deliver(args[0])
                conn.send(("ok", None))
            elif cmd == "fail":
                tr.gather_fail(args[0])
                conn.send(("ok", None))
            else:
                return
        except kvxfer.KvxferError as e:
            conn.send(("err", type(e).__name__, e.status, str(e)))


def run(conn, config, state, num_blocks, own_memory, ranks=None, group=None, gather_conn=None):
    """A process hosting ranks of an instance of state (None: every rank);
    group is ("coordinated", process, processes, address) or ("gather",
    process, processes), whose rounds come on gather_conn."""
    ranks = ranks or list(range(state.num_ranks))
    try:
        cfg = kvxfer.Config.from_dict(config) if isinstance(config, dict) else kvxfer.Config.from_file(config)
        pools = None
        if own_memory:  # numpy pools: the engine's own memory
            pools = [np.zeros(num_blocks * state.block_bytes(r), dtype=np.uint8) for r in ranks]
        g = None
        if group and group[0] == "coordinated":
            g = kvxfer.CoordinatedGroup(group[1], group[2], group[3], join_timeout=30)
        elif group:
            g = kvxfer.GatherGroup(group[1], group[2])
        tr = kvxfer.KvCacheTransceiver(cfg, state, pools=pools, num_blocks=num_blocks, ranks=ranks, group=g)
    except kvxfer.KvxferError as e:
        conn.send(("err", type(e).__name__, e.status, str(e)))
        return
    if gather_conn is not None:
        import threading

        threading.Thread(target=_serve_gather, args=(tr, gather_conn), daemon=True).start()
    views = [_blocks_view(tr.pools[i], state, r, num_blocks) for i, r in enumerate(tr.ranks)]
    conn.send(("ok", None))
    reqs = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "quit":
                tr.shutdown()
                conn.send(("ok", None))
                return
            out = _do(tr, state, views, reqs, cmd, *args)
            conn.send(("ok", out))
        except kvxfer.KvxferError as e:
            conn.send(("err", type(e).__name__, e.status, str(e)))


def _do(tr, state, views, reqs, cmd, *args):
    if cmd == "respond":  # (id, tokens, seed, blocks): fill from a logical cache, respond
        rid, tokens, seed, blocks = args
        cache = reference.logical(state, tokens, seed)
        for i, r in enumerate(tr.ranks):
            views[i][blocks] = reference.shard(cache, state, r)
        req = kvxfer.Request(rid, [blocks] * len(tr.ranks), num_tokens=tokens)
        tr.respond_and_send_async(req)
        return req.opaque_state
    if cmd == "receive":  # (id, tokens, opaque, blocks)
        rid, tokens, opaque, blocks = args
        req = kvxfer.Request(rid, [blocks] * len(tr.ranks), num_tokens=tokens, opaque_state=opaque)
        tr.request_and_receive_async(req)
        reqs[rid] = req
        return req.state
    if cmd == "receive_sync":  # (id, tokens, opaque, blocks, timeout)
        rid, tokens, opaque, blocks, timeout = args
        req = kvxfer.Request(rid, [blocks] * len(tr.ranks), num_tokens=tokens, opaque_state=opaque)
        tr.request_and_receive_sync(req, timeout=timeout)
        return req.state
    if cmd in ("ctx_status", "gen_status"):  # (at_least, timeout) -> [(id, state, error class, message)]
        at_least, timeout = args
        fn = tr.check_context_transfer_status if cmd == "ctx_status" else tr.check_gen_transfer_status
        return [(r.request_id, r.state, type(r.error).__name__ if r.error else None, str(r.error) if r.error else None)
                for r in fn(at_least, timeout=timeout)]
    if cmd == "verify":  # (tokens, seed, blocks) -> number of ranks whose blocks match the reference
        tokens, seed, blocks = args
        cache = reference.logical(state, tokens, seed)
        return [bool(np.array_equal(views[i][blocks], reference.shard(cache, state, r))) for i, r in enumerate(tr.ranks)]
    if cmd == "cancel":
        (rid,) = args
        return tr.cancel_request(kvxfer.Request(rid, []))
    if cmd == "gen_complete":
        return tr.check_gen_transfer_complete()
    raise ValueError(f"unknown command {cmd}")
