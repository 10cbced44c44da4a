"""Faults on real ranks: a peer that died or hangs, and ranks that diverge.

Three mechanisms, all on the DistributedRuntime's own process groups (distributed.py):

- Timeouts. Every group partir_torch creates (one per mesh axis, and the CPU group of the checks below) is created
  with `Options.timeout_s`, so a collective whose peer does not answer fails after timeout_s on gloo (its recv
  timeout) and NCCL (its watchdog). DeviceMesh's groups would otherwise get torch's 30-minute default, whatever
  init_process_group was given.
- Release. A rank whose step fails destroys its groups (DistributedRuntime.release): gloo has no abort that wakes a
  peer blocked in a collective, but dropping the last reference to a group closes its connections, so every peer
  waiting on this rank fails at once ("connection closed") instead of at its own timeout, releases its own groups
  in turn, and the failure reaches the whole job in a fraction of a second. The program then refuses further
  steps: the job restarts (torchrun --max-restarts; restart.py gives each attempt store keys of its own) and
  resumes from its last checkpoint.
- Agreement. Before every call of a step on real ranks, the ranks all-gather one 8-byte digest of what they are
  about to run (the program, the step number, the inputs' shapes and dtypes) on the CPU check group. Equal digests:
  run. Different: every rank gathers the described fields and raises RuntimeMismatchError naming the ranks and what
  differs, before any collective of the step.

`step_failure` turns the exception of a failed collective into RankFailureError: the step, the collective (kind,
mesh axis, the value it serves, the user's source line: the CollectiveRecord on the lowered node), the group's ranks
and the likely cause. Which rank is to blame is not in the backend's error (gloo names a peer's address at most):
after a failure a rank calls the roll (liveness.py): every live process answers from a thread of its own within
milliseconds, so the ranks that do not answer in REPORT_WAIT_S (1.5 s) have died, and the ones that answer
"running" are alive but their step had not failed (in a timeout: the stuck or slow ones).
"""
from __future__ import annotations

import hashlib
import traceback

import torch

from ..contract import META_COLLECTIVE
from ..errors import RankFailureError, RuntimeMismatchError

# what gloo and NCCL say when a peer closed its connection (died) or did not answer in time (hung)
_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
           "pair closure", "connection refused", "end of file")
_TIMEOUT = ("timed out", "timeout", "deadline exceeded")
_BACKEND = ("gloo", "nccl", "c10d", "processgroup", "distbackenderror", "store")


def peer_failure_kind(exc: BaseException) -> str | None:
    """"closed" (a peer's connection closed: it died), "timeout" (a peer did not answer in time) or None (not a
    failure of the communication: an error of the step itself)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = f"{type(exc).__name__}: {exc}".lower()
    if any(s in text for s in _CLOSED):
        return "closed"
    if any(s in text for s in _TIMEOUT) and (isinstance(exc, dist_error) or any(s in text for s in _BACKEND)):
        return "timeout"
    if isinstance(exc, dist_error):
        return "closed"
    return None


def node_at(gm, exc: BaseException):
    """The node of `gm` whose line of the generated code raised `exc` (the innermost one), else None."""
    lines = gm.code.splitlines()
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if fr.filename.startswith("<eval_with_key>") and 0 < fr.lineno <= len(lines):
            name = lines[fr.lineno - 1].strip().split(" = ")[0]
            return next((n for n in gm.graph.nodes if n.name == name), None)
    return None


def collective_of(node):
    """The CollectiveRecord of `node` (a collective) or of the collective a wait_tensor waits for, else None."""
    for _ in range(4):          # wait_tensor(collective); a bucket's slices of a wait; never far
        if node is None or not hasattr(node, "meta"):
            return None
        rec = node.meta.get(META_COLLECTIVE)
        if rec is not None:
            return rec
        node = next((a for a in node.args if hasattr(a, "meta")), None)
    return None


def group_ranks(mesh, rank: int, axis: str) -> list[int]:
    """The ranks of `rank`'s process group on mesh axis `axis` (the ranks that differ from it on that axis only)."""
    coord = mesh.coordinate(rank)
    return [r for r in range(mesh.size)
            if all(v == coord[a] for a, v in mesh.coordinate(r).items() if a != axis)]


REPORT_WAIT_S = 1.5      # after a failure, how long a rank waits for the others' answers (liveness.WAIT_S)


def step_failure(what: str, rank: int, mesh, rec, exc: BaseException, timeout_s: float,
                 coll: str | None = None, answers: dict | None = None,
                 wait_s: float = REPORT_WAIT_S) -> RankFailureError:
    """RankFailureError for the collective `rec` of `what` ("step 3") that failed with `exc`; `coll` describes it
    when it has no record (the agreement check); neither: "a collective of the step" (a compiled step). `answers`:
    the other ranks' answers to the roll call (liveness.py; None: unknown)."""
    kind = peer_failure_kind(exc) or "closed"
    if rec is not None:
        op = f"({rec.reduce_op})" if rec.reduce_op else ""
        members = rec.parts()
        value = members[0].value + (f" and {len(members) - 1} more (a bucket)" if len(members) > 1 else "")
        why = f", a {rec.why} collective" if rec.why else ""
        src = next((m.source for m in members if m.source), "")
        ranks = group_ranks(mesh, rank, rec.axis)
        coll = (f"{rec.kind}{op} on mesh axis '{rec.axis}' (size {rec.group_size}, ranks {ranks}) for {value}{why}"
                f" (tactic {rec.tactic}{', ' + rec.phase if rec.phase else ''})"
                + (f", made by {src}" if src else "") + f" [{rec.node}]")
    elif coll is None:
        coll = f"a collective of the step on the mesh {mesh} (ranks {list(range(mesh.size))})"
    cause = ("a rank in this group closed its connection: it died (or its step failed first); see its log"
             if kind == "closed" else
             f"a rank in this group did not answer within timeout_s={timeout_s:g} s: it is stuck or much slower; "
             f"see its log")
    cause += blame(answers, wait_s, kind)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RankFailureError(
        f"partir_torch: {what} failed on rank {rank}: {coll}.\n  Likely cause: {cause}.\n"
        f"  The backend said: {type(exc).__name__}: {first[:300]}\n"
        f"  This program's process groups are released; restart the job (torchrun --max-restarts=N, with "
        f"partir_torch imported before dist.init_process_group so that every attempt gets store keys of its own) "
        f"and resume from the last checkpoint (examples/train_loop.py shows the recipe).")


def blame(answers: dict | None, wait_s: float, kind: str) -> str:
    """The roll call's verdict for the message: the ranks with no live process (dead), and in a timeout or when none
    died the live ranks whose step had not failed (stuck, slow, or still to notice). "silent": no answer where only
    failing ranks answer (no TCPStore for the answering threads); "unknown": the store could not be reached; None or
    {}: not asked."""
    if not answers:
        return ""
    if "unknown" in answers.values():
        return ". The roll call could not reach the store (its host, rank 0 or torchrun's agent, is gone)"
    dead = [r for r, a in sorted(answers.items()) if a is None]
    running = [r for r, a in sorted(answers.items()) if a == "running"]
    s = lambda rs: "s" if len(rs) > 1 else ""
    out = ""
    if dead:
        out += (f". Dead: rank{s(dead)} {', '.join(map(str, dead))} (no answer to the roll call {wait_s:g} s after "
                f"the failure: no live process; see {'their logs' if len(dead) > 1 else 'its log'})")
    if running and (kind == "timeout" or not dead):     # a death explains a closed connection: no live rank named
        out += (f". Alive but not failing: rank{s(running)} {', '.join(map(str, running))} (stuck, much slower, or "
                f"still to notice the failure: see {'their logs' if len(running) > 1 else 'its log'})")
    silent = [r for r, a in sorted(answers.items()) if a == "silent"]
    if silent:
        out += (f". Rank{s(silent)} {', '.join(map(str, silent))} did not answer the roll call {wait_s:g} s after "
                f"the failure (dead, stuck, or still to notice it: the default store is not a TCPStore, so only "
                f"failing ranks answer)")
    if not dead and not running and not silent:
        out += ". Every other rank answered the roll call: none died"
    return out


def socket_fds(store_port: int | None = None) -> set[int]:
    """This process's open socket descriptors (Linux /proc; empty elsewhere), but a TCPStore server's (local port
    `store_port`: the rank hosting the store accepts other ranks' connections at any time): taken before and after a
    runtime creates its process groups, the difference is their gloo connections and listeners."""
    import os
    import socket

    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    out = set()
    for n in names:
        try:
            if os.readlink(f"/proc/self/fd/{n}").startswith("socket:"):
                out.add(int(n))
        except OSError:
            pass
    if store_port is not None:
        out = {fd for fd in out if _local_port(socket, fd) != store_port}
    return out


def _local_port(socket, fd: int) -> int | None:
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        addr = s.getsockname()
        return addr[1] if isinstance(addr, tuple) and len(addr) > 1 else None
    except OSError:
        return None
    finally:
        s.detach()


def shut_sockets(fds) -> None:
    """shutdown(2) each connected socket of `fds` without closing it: a peer blocked on one reads end-of-file now
    ("connection closed by peer"), whatever still references the group in this process."""
    import socket

    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            s.getpeername()                 # a connection; a listener's accept() must not fail under gloo
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()          # the descriptor stays gloo's


def describe_call(what: str, program: str, step: int, flat) -> dict:
    """The fields every rank must agree on before running `what`: the program's digest, the step number, and each
    input's type, shape and dtype."""
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
        return type(x).__name__
    return {"call": what, "program": program, "step": str(step),
            "inputs": "; ".join(f"inputs.{i} {one(x)}" for i, x in enumerate(flat))}


def digest(fields: dict) -> int:
    """A signed 63-bit digest of `fields` (sha256: Python's hash() of str is salted per process)."""
    h = hashlib.sha256("\x00".join(f"{k}={v}" for k, v in sorted(fields.items())).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def divergence(fields_by_rank: list[dict], what: str) -> RuntimeMismatchError:
    """RuntimeMismatchError naming, for each field that differs, the ranks in the minority and what they have."""
    world = len(fields_by_rank)
    lines = []
    for key in fields_by_rank[0]:
        groups: dict = {}
        for r, f in enumerate(fields_by_rank):
            groups.setdefault(f.get(key), []).append(r)
        if len(groups) < 2:
            continue
        order = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))     # the majority first
        for val, ranks in order:
            lines.append(f"  {key}: ranks {ranks}: {val}")
    return RuntimeMismatchError(
        f"partir_torch: the {world} ranks disagree on what to run for {what}; nothing ran (no collective of the "
        f"step started):\n" + "\n".join(lines) + "\nEvery rank must call the same program at the same step with "
        f"inputs of the same shapes and dtypes (train_step: the global batch; train_step_local: each rank's "
        f"equal-sized slice).")
