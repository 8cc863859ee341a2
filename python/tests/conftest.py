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

    def __init__(self, config, state, num_blocks=16, own_memory=True, ranks=None, group=None, wait=True):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.gather, gchild = (ctx.Pipe() if group and group[0] == "gather" else (None, None))
        import workers

        self.proc = ctx.Process(target=workers.run, args=(child, config, state, num_blocks, own_memory, ranks, group, gchild),
                                daemon=True)
        self.proc.start()
        child.close()
        if gchild is not None:
            gchild.close()
        self.ready = self._answer(30) if wait else None

    def wait_ready(self):
        self.ready = self._answer(30)
        return self.ready

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


class GatherDriver:
    """Runs the all-gather rounds of the processes of one instance (gather
    mode), as an engine's communicator would, in a thread of the test."""

    def __init__(self, procs):
        import threading

        self.procs, self.stop, self.error = procs, threading.Event(), None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _ask(self, p, *cmd):
        p.gather.send(cmd)
        if not p.gather.poll(30):
            raise AssertionError(f"worker {p.proc.pid}: no answer to {cmd[0]}")
        ans = p.gather.recv()
        if ans[0] != "ok":
            raise AssertionError(f"worker {p.proc.pid}: {cmd[0]}: {ans}")
        return ans[1]

    def _loop(self):
        import time

        try:
            while not self.stop.is_set():
                everyone = [self._ask(p, "outbox") for p in self.procs]
                for p in self.procs:
                    self._ask(p, "deliver", everyone)
                time.sleep(0.0005)
        except Exception as e:  # a worker died: the test sees it in error
            self.error = e

    def close(self):
        self.stop.set()
        self.thread.join(30)


def stop_process(pid, timeout=10):
    """SIGSTOPs pid and returns once every thread of it has stopped. kill
    returns before that: under load a process was still running right
    after it and served a whole transfer (2 ms) before it stopped."""
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended
                pass
        if states and all(st in "Tt" for st in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError("process %d not stopped %ss after SIGSTOP: thread states %s" % (pid, timeout, states))
        time.sleep(0.001)


def free_address():
    """A loopback address for a coordinator that listens on it later, in
    another process: a port below the ephemeral range (as the Go tests'
    internal/freeport picks), which no connection's or :0 listener's
    ephemeral port can take in the meantime, as one probed with port 0 and
    closed could be."""
    import random
    import socket

    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if low <= 21000:
        low = 32768
    for _ in range(200):
        port = random.randint(20000, low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return "127.0.0.1:%d" % port
    raise AssertionError("no free loopback port in 20000-%d" % (low - 1))


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
