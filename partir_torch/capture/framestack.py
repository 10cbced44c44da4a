"""Call a function at the start of a fresh, large chunk of CPython's frame stack (a capture-speed fix).

CPython (3.11 on) keeps the frames of Python calls in per-thread chunks of at least 16 KiB: a call that does not
fit in the current chunk gets a new one (mmap), freed (munmap) when that call returns. make_fx calls the traced
step through a generated ``lambda arg0, ..., argN: fn(arg0, ..., argN)`` whose frame holds about 2N slots of 8
bytes for N placeholders (21 KiB for a 48-layer Llama with AdamW: 1,300 placeholders). Below it, every traced op
runs a few dozen Python frames deep (the functional, proxy and fake tensor modes, pytree helpers); when a chunk
boundary falls inside that range, each op crosses it back and forth, and each crossing maps, faults in and unmaps a
chunk: 450,000 times (4 of 12 CPU s) for that model, and a capture time that grew faster than the model.

``call_in_fresh_chunk(fn, args)`` calls ``fn(*args)`` from a frame of 16,384 slots (128 KiB): it never fits in a
chunk in use, so CPython allocates a 256 KiB chunk for it, and the trace below it runs in that chunk's free half.
"""
from __future__ import annotations

import types

_SLOTS = 16384      # 128 KiB of frame: the chunk allocated for it is 256 KiB, half of it free for the callees


def _call(fn, args):
    return fn(*args)


def _padded(func: types.FunctionType, slots: int) -> types.FunctionType:
    """`func` with `slots` extra (never used) local variables, so its frame is that much larger."""
    code = func.__code__
    names = code.co_varnames + tuple(f"_slot{i}" for i in range(slots))
    code = code.replace(co_varnames=names, co_nlocals=len(names))
    return types.FunctionType(code, func.__globals__, func.__name__)


call_in_fresh_chunk = _padded(_call, _SLOTS)
call_in_fresh_chunk.__doc__ = "fn(*args), called from a frame that starts a fresh 256 KiB frame-stack chunk."
