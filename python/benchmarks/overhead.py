"""Host overhead per request through the Python binding, no data moved.

context: respond_and_send_async + check_context_transfer_status(0) per
request (the request is held, nothing pulls it; all are cancelled at the end).
generation: request_and_receive_async of a held request whose blocks hold
nothing of note (a 1-layer, 1-head, 8-element model: 32-byte blocks) +
check_gen_transfer_status(0) until it is reported; the pull itself runs on
kvxfer's goroutines, so this is the caller's cost plus the round trip of a
tiny pull, an upper bound of the submit + status cost.

Usage: KVXFER_LIB=lib/libkvxfer.so python3 python/benchmarks/overhead.py [N]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kvxfer  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    cfg = kvxfer.Config.from_dict({"cache_transceiver_config": {"backend": "TCP", "kv_transfer_timeout_ms": 600000}})
    state = kvxfer.CacheState(layers=1, kv_heads=1, head_dim=8, tokens_per_block=2, dtype="fp16")
    with kvxfer.KvCacheTransceiver(cfg, state, num_blocks=64) as prefill, kvxfer.KvCacheTransceiver(cfg, state, num_blocks=64) as gen:
        ctx_us, reqs = [], []
        for i in range(n):
            req = kvxfer.Request(i + 1, [i % 64], num_tokens=2)
            t0 = time.perf_counter_ns()
            prefill.respond_and_send_async(req)
            prefill.check_context_transfer_status(0)
            ctx_us.append((time.perf_counter_ns() - t0) / 1e3)
            reqs.append(req)
        gen_submit, gen_total = [], []
        for i, r in enumerate(reqs[: min(n, 2000)]):
            g = kvxfer.Request(10**6 + i, [i % 64], num_tokens=2, opaque_state=r.opaque_state)
            t0 = time.perf_counter_ns()
            gen.request_and_receive_async(g)
            t1 = time.perf_counter_ns()
            while not gen.check_gen_transfer_status(0):
                pass
            gen_submit.append((t1 - t0) / 1e3)
            gen_total.append((time.perf_counter_ns() - t0) / 1e3)
        for r in reqs:
            prefill.cancel_request(r)
        prefill.check_context_transfer_status(None, timeout=30)
    print(f"context  respond+status(0):   n={len(ctx_us)} p50={statistics.median(ctx_us):.1f} us  p99={pct(ctx_us, 99):.1f} us")
    print(f"gen      submit (async call):  n={len(gen_submit)} p50={statistics.median(gen_submit):.1f} us  p99={pct(gen_submit, 99):.1f} us")
    print(f"gen      submit..reported:     n={len(gen_total)} p50={statistics.median(gen_total):.1f} us  p99={pct(gen_total, 99):.1f} us")


if __name__ == "__main__":
    main()
