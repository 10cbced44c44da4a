"""Capture of a GPT train step built on `meta`, in a fresh process so that its peak RSS is that capture's own.
Used by partition_speed.py (the issue's 9.9B-parameter figure) and tests/test_capture.py (the same goal, asserted).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = textwrap.dedent("""
    import resource, sys, time, torch
    sys.path.insert(0, {root!r})
    from examples.models import get
    from partir_torch.capture import capture
    spec = get("gpt", layers={layers}, d={d}, heads=32, vocab=50304, seq=1024, attention="sdpa")
    def rss_now():   # current resident set in KiB (ru_maxrss is a peak, and would hide growth below it)
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * resource.getpagesize() // 1024
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss0 = rss_now()
    t0, c0 = time.perf_counter(), time.process_time()
    model = spec.build(device="meta")
    tokens = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    cap = capture(model, (tokens, tokens), spec.loss_fn, torch.optim.AdamW(model.parameters(), lr=3e-4))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = sum(p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())
    print(dt, cpu, (rss1 - rss0) * 1024, n, len(cap.gm.graph.nodes), cap.mode)
""")


def meta_capture(layers: int = 48, d: int = 4096) -> tuple:
    """(wall seconds, CPU seconds, peak RSS increase in bytes, parameter count, graph nodes, capture mode) of
    capturing a `layers`-deep, width-`d` GPT (AdamW, batch 8 x 1024) built on `meta`, in a fresh process."""
    script = _SCRIPT.format(root=ROOT, layers=layers, d=d)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    dt, cpu, rss, n, nodes, mode = out.stdout.split()
    return float(dt), float(cpu), int(rss), int(n), int(nodes), mode
