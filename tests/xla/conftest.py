"""The torch-xla tests run in their own environment (.venv-xla: torch 2.9 + torch-xla 2.9, `make test` builds it).

Elsewhere (the main .venv, torch 2.13, where torch-xla cannot load) this folder is not collected. In .venv-xla
the 8 virtual CPU devices are set up here, before torch_xla starts: PJRT_DEVICE=CPU CPU_NUM_DEVICES=8.
"""
from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "8")
