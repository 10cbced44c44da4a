"""Restarts under `torchrun --max-restarts N`: every attempt gets store keys of its own (issue 37).

torchrun (2.13) hands every attempt of a job its agent's TCP store (TORCHELASTIC_USE_AGENT_STORE=True), and that
store still holds the previous attempt's keys. gloo reads each peer's address from it: a restarted rank that reads
the dead attempt's address before its peer rewrote it fails to connect ("Gloo connectFullMesh failed ... Connection
refused") or waits out its timeout (pytorch/pytorch#135712). Two layers, both keyed by TORCHELASTIC_RESTART_COUNT:

- `install()` (run when partir_torch is imported): torch's env:// rendezvous, which a plain
  `dist.init_process_group("gloo")` under torchrun uses, hands out the agent's store under a prefix of this attempt,
  so the user's default group and everything built on it start from empty keys on every attempt.
- `program_groups_store()`: a program's own process groups are created under that prefix even when the default
  group was initialised before partir_torch was imported (its store then has no prefix); said once, with the fix.

Outside torchrun's shared agent store (mp.spawn, a given store, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) nothing changes.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch.distributed as dist

_per_attempt = False        # the default group was initialised through the prefixing handler below
_warned = False


def attempt() -> int:
    """torchrun's restart count: 0 for the first attempt, 1 after the first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def shared_agent_store() -> bool:
    """Whether the workers get torchrun's agent store, shared by every attempt of the job."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def prefix() -> str:
    return f"partir_attempt_{attempt()}"


def install() -> None:
    """Wrap torch's env:// rendezvous handler (once): under torchrun's shared agent store, the store it yields is
    prefixed by the attempt. Anything else (another scheme, an explicit store=, no agent store) is untouched."""
    import importlib

    if not dist.is_available():
        return
    rdzv = importlib.import_module("torch.distributed.rendezvous")      # the module (dist.rendezvous: a function)
    handler = rdzv._rendezvous_handlers.get("env")
    if handler is None or getattr(handler, "_partir_per_attempt", False):
        return

    def per_attempt(url, **kwargs):
        global _per_attempt
        for store, rank, world in handler(url, **kwargs):
            if shared_agent_store():
                store, _per_attempt = dist.PrefixStore(prefix(), store), True
            yield store, rank, world

    per_attempt._partir_per_attempt = True
    rdzv._rendezvous_handlers["env"] = per_attempt


def default_store_per_attempt() -> bool:
    """Whether the default group's keys cannot collide with an earlier attempt's."""
    return not shared_agent_store() or _per_attempt


@contextmanager
def program_groups_store():
    """Create a program's process groups (new_group, init_device_mesh) inside this block: when the default store is
    torchrun's shared one without a per-attempt prefix, the groups' keys get this attempt's prefix (new_group builds
    every group's store from the default group's entry of the c10d world, swapped here for the block)."""
    if default_store_per_attempt():
        yield
        return
    _say_once()
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    backend, store = c10d._world.pg_map[default]
    c10d._world.pg_map[default] = (backend, dist.PrefixStore(f"{prefix()}_groups", store))
    try:
        yield
    finally:
        c10d._world.pg_map[default] = (backend, store)


def _say_once() -> None:
    global _warned
    if _warned or attempt() == 0:
        return
    _warned = True
    warnings.warn(
        f"partir_torch: torchrun restart {attempt()} on the agent's shared store (pytorch/pytorch#135712): this "
        f"program's process groups use store keys of this attempt, but the default group was initialised before "
        f"partir_torch was imported, on the previous attempts' keys, and may fail to connect on a restart "
        f"(\"Gloo connectFullMesh failed\"). Import partir_torch before dist.init_process_group, or set "
        f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment.", RuntimeWarning, stacklevel=4)
