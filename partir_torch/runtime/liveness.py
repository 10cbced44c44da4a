"""Who is alive after a failed step: a roll call answered by a thread of every rank (issue 37).

A rank whose step fails must name the rank to blame, and the backend does not say (gloo names a peer's address at
most, and that peer may be a survivor that released its groups). So each rank of a program runs a small daemon
thread on a TCP store connection of its own, blocked on the program's "fault" key. A failing rank sets that key and
its own answer, then waits up to wait_s: every live process answers at once from its thread, whatever its main
thread is doing (computing, blocked in a collective, asleep), "failed" when its step has failed too and "running"
otherwise. A rank that does not answer has no live process: it died (or its interpreter is frozen).

Keys live under partir_live/<attempt>/<the program's check group>, so programs and torchrun attempts never share
them. Without a TCPStore under the default store (a FileStore, a HashStore) there is no thread: only failing ranks
answer, and a live rank still to notice the failure is named as not answering (the message says so).
"""
from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .faults import REPORT_WAIT_S as WAIT_S     # how long a failing rank waits (a live rank answers in milliseconds)


def tcp_store():
    """The TCPStore under the default group's store (PrefixStores peeled off), or None."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


POLL_S = 0.2           # the answering thread checks the store this often (a non-blocking check: a blocking wait that
                       # times out logs a c10d warning each time, and one still blocked at exit aborts the process)
_STOP = threading.Event()
_THREADS: list = []


@atexit.register
def _stop_threads() -> None:
    """At exit, before the interpreter finalises: end the answering threads. A daemon thread still blocked in the
    store's C++ wait when the interpreter finalises is killed inside it, which aborts the process (SIGABRT)."""
    _STOP.set()
    for t in _THREADS:
        t.join(timeout=2 * POLL_S)


class Liveness:
    """The roll call of one program on rank `rank` of `world`; `failed()` says whether this rank's step failed."""

    def __init__(self, key: str, rank: int, world: int, failed):
        self.key, self.rank, self.world, self.failed = key, rank, world, failed
        base = tcp_store()
        self.store = dist.distributed_c10d._get_default_store()
        if base is not None:        # own connections: a blocking wait would hold a shared client's lock
            self.store = self._client(base)
            t = threading.Thread(target=self._answer, args=(self._client(base),), daemon=True,
                                 name=f"partir-liveness-{key}")
            t.start()
            _THREADS.append(t)
        self.answered_by_thread = base is not None

    @staticmethod
    def _client(base):
        return dist.TCPStore(base.host, base.port, is_master=False, timeout=timedelta(seconds=30),
                             wait_for_workers=False)

    def _answer(self, client) -> None:
        try:
            while not client.check([f"{self.key}/fault"]):
                if _STOP.wait(POLL_S):
                    return                       # the process is exiting
            client.set(f"{self.key}/alive/{self.rank}", "failed" if self.failed() else "running")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is asking any more
            return

    def roll_call(self, wait_s: float = WAIT_S) -> dict:
        """Announce the fault, answer for this rank ("failed"), wait up to wait_s for the others: {rank: "failed" |
        "running" | None (no answer: dead) | "silent" (no
        answer where only failing ranks answer) | "unknown" (the store cannot be reached)} for the other ranks."""
        try:
            self.store.set(f"{self.key}/alive/{self.rank}", "failed")
            self.store.set(f"{self.key}/fault", "1")
            keys = [f"{self.key}/alive/{r}" for r in range(self.world)]
            deadline = time.monotonic() + wait_s
            while not self.store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.02)
            none = None if self.answered_by_thread else "silent"
            return {r: (self.store.get(k).decode() if self.store.check([k]) else none)
                    for r, k in enumerate(keys) if r != self.rank}
        except Exception:  # noqa: BLE001 - the store is on a rank or agent that is gone
            return {r: "unknown" for r in range(self.world) if r != self.rank}
