"""The one error family users see.  Every message names the value, the op, the axes with their sizes and the fix."""
from __future__ import annotations

import difflib
import os
import re
import warnings


class PartitionError(ValueError):
    """A mistake the user can fix: bad axis, non-divisible dim, unknown selector, untraceable model, ..."""


class MeshError(PartitionError):
    """Bad mesh or axis name."""


class TraceError(PartitionError):
    """The model, loss or optimizer could not be captured as one graph."""


class SelectorError(PartitionError):
    """A tactic's selector matched no named value."""


class ShardingConflictError(PartitionError):
    """Two tactics (or a tactic and the shape of a value) demand incompatible shardings."""


class RuntimeMismatchError(PartitionError):
    """Ranks disagree about the program, the step or its inputs' shapes and dtypes (raised on every rank before any
    collective of the step: runtime/faults.py)."""


class RankFailureError(PartitionError):
    """On real ranks, a peer died or did not answer within timeout_s: raised on every surviving rank, naming the step,
    the collective (kind, mesh axis, value, the user's source line), the group's ranks and the likely cause."""


def warn(message: str, stacklevel: int = 2) -> None:
    """warnings.warn(message) for partir_torch's warnings: on rank 0 only when torch.distributed is initialised (one
    copy per job, not one per rank); in one process (emulated ranks) as warnings.warn. stacklevel as there, counted
    from the caller of warn."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def user_stacklevel() -> int:
    """The stacklevel (for warn, counted from warn's caller) of the first frame outside partir_torch: a warning
    raised deep inside the library points at the user's line that led there."""
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2          # level k: the frame k above the function that called this one
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def closest(name: str, candidates, n: int = 3) -> list[str]:
    """The few candidates nearest to `name`, for 'did you mean' hints."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.3)


class InternalError(PartitionError):
    """Something partir_torch did not expect while building or running the program (a bug to report): the
    message names the node, its aten op and the user's source line that made it."""


def internal_error(node, stage: str, exc: BaseException) -> InternalError:
    """An InternalError for `exc`, raised while `stage` (lowering, running) handled fx node `node`."""
    where = source_line(node) if node is not None else ""
    what = node.format_node() if node is not None else "?"
    return InternalError(f"partir_torch: internal error while {stage} {what}: {type(exc).__name__}: {exc}"
                         + (f"\n  made by {where}" if where else "")
                         + "\nPlease report this with the model; as a workaround, leave the value whole on the axis "
                           "(ManualPartition with REPLICATED) or register a rule for the op (pt.register_rule).")


def source_line(node) -> str:
    """The user's source line that made `node`: the innermost frame of its stack trace outside torch and
    partir_torch ('' when the node has none)."""
    frame = _user_frame(node)
    if frame is None:
        return ""
    where, code = frame
    return where + (f": {code}" if code else "")


def source_location(node) -> str:
    """`source_line` as file:line ("examples/models/gpt.py:102", relative to the working directory when under it),
    '' when the node has no stack trace."""
    frame = _user_frame(node)
    m = re.match(r'"(.*)", line (\d+)', frame[0]) if frame is not None else None
    if m is None:
        return ""
    path = m.group(1)
    rel = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    return f"{rel}:{m.group(2)}"


def _user_frame(node):
    """('"file", line N, in fn', code) of the innermost user frame of node's stack trace, or None."""
    torch_dir = os.path.dirname(__import__("torch").__file__)
    our_dir = os.path.dirname(__file__)
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    found = None
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("File \"") and torch_dir not in line and our_dir not in line:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = (line[len("File "):], code if code and not code.startswith("File ") else "")
    return found
