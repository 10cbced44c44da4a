"""The user's source line of each traced forward op, recorded while make_fx traces (prog.collectives()' `source`,
prog.audit(), error messages).

make_fx(record_stack_traces=True) extracts and formats the whole Python stack for every node (25% of a 48-layer
Llama's capture). Here each new call_function node walks the live frames outward only until it finds the
innermost `forward` outside torch and partir_torch (the user's or a library's model code; our decompositions run
above it), and stops at capture.py's step frames (backward ops, traced by autograd below them, have none). The line is written in the format of torch's
stack traces, so errors.source_location reads it either way.
"""
from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys

import torch
import torch.fx as fx

_TORCH = os.path.realpath(os.path.dirname(torch.__file__))
_OURS = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STOP = os.path.join(_OURS, "capture", "capture.py")   # capture's step frames: the user's code runs above them


@functools.lru_cache(maxsize=None)
def real_path(path: str) -> str:
    """A code object's file as one spelling: a module imported through "dir/.." (or a link) on sys.path keeps that
    spelling in co_filename, and would not start with the library's own directory."""
    return path if path.startswith("<") else os.path.realpath(path)


def library_code(path: str) -> bool:
    """Whether a code object's file is torch's or partir_torch's (not the user's)."""
    path = real_path(path)
    return path.startswith(_TORCH) or path.startswith(_OURS)


def _user_forward(frame):
    """The innermost frame of a `forward` outside torch and partir_torch, or None (stop at capture's frames)."""
    while frame is not None:
        code = frame.f_code
        path = real_path(code.co_filename)
        if path == _STOP:
            return None
        if code.co_name == "forward" and not library_code(path):
            return frame
        frame = frame.f_back
    return None


@contextlib.contextmanager
def recording_sources():
    """While active, every call_function node FX creates gets node.stack_trace = its user forward line (if any)."""
    base = fx.proxy.TracerBase.create_node

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = base(self, kind, target, args, kwargs, name, type_expr)
        if kind == "call_function" and not node.stack_trace:
            f = _user_forward(sys._getframe(1))
            if f is not None:
                path, line = f.f_code.co_filename, f.f_lineno
                node.stack_trace = f'File "{path}", line {line}, in forward\n    ' \
                                   f'{linecache.getline(path, line).strip()}'
        return node

    fx.proxy.TracerBase.create_node = create_node
    try:
        yield
    finally:
        fx.proxy.TracerBase.create_node = base
