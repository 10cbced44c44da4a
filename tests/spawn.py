"""Real gloo ranks for the tests: spawn `world` processes of `worker(rank, port, ckpt, queue)`, collect one result
dict per rank from the queue, and fail (never hang) after `timeout_s`."""
from __future__ import annotations

import queue as queue_mod
import shutil
import socket
import tempfile
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, timeout_s: float, prefix: str = "partir_dcp_") -> dict:
    """{rank: results}. Each worker gets (rank, a free port, a checkpoint directory, the queue) and puts one dict
    with its "rank"; a "fatal" entry fails the test with that rank's message."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    t0 = time.perf_counter()
    ckpt = tempfile.mkdtemp(prefix=prefix)
    procs = mp.start_processes(worker, args=(free_port(), ckpt, queue), nprocs=world, join=False,
                               start_method="spawn")
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"real ranks: only ranks {sorted(results)} reported within {timeout_s} s")
            try:
                r = queue.get(timeout=min(left, 5.0))
                results[r["rank"]] = r
            except queue_mod.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(procs.processes)
                        if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    pytest.fail(f"real ranks: rank {dead[0][0]} exited with code {dead[0][1]} before reporting")
        while not procs.join(timeout=max(deadline - time.monotonic(), 1)):
            if time.monotonic() > deadline:
                pytest.fail("real ranks: processes did not exit")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"spawn of {world} gloo ranks: {time.perf_counter() - t0:.1f} s")
    for r in results.values():
        assert "fatal" not in r, f"rank {r['rank']}: {r['fatal']}"
    return results
