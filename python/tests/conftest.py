import multiprocessing
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # reference, workers; the kvxfer package

os.environ.setdefault("KVXFER_LIB", os.path.join(HERE, "..", "..", "lib", "libkvxfer.so"))

TCP = {"cache_transceiver_config": {"backend": "TCP", "kv_transfer_timeout_ms": 20000}}


class Rank:
    """A worker process (see workers.run) and its pipe."""

    def __init__(self, config, state, num_blocks=16, own_memory=True):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        import workers

        self.proc = ctx.Process(target=workers.run, args=(child, config, state, num_blocks, own_memory), daemon=True)
        self.proc.start()
        child.close()
        self.ready = self._answer(30)

    def _answer(self, timeout):
        if not self.conn.poll(timeout):
            raise AssertionError(f"worker {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def call(self, *cmd, timeout=30):
        """Runs a command; returns its value, or the error tuple."""
        self.conn.send(cmd)
        ans = self._answer(timeout)
        return ans[1] if ans[0] == "ok" else ans

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("quit",))
                self._answer(10)
            except (OSError, EOFError, AssertionError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.fixture
def ranks():
    """Starts Ranks; stops them all at the end of the test."""
    started = []

    def start(*args, **kw):
        r = Rank(*args, **kw)
        started.append(r)
        return r

    yield start
    for r in started:
        r.close()
