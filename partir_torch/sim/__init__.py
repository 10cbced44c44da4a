"""Simulator: step time, memory and communication of a per-device program on GPU meshes and TPU pods.

>>> hw = hardware("h100", nodes=2)
>>> report = simulate_graph(gm, mesh, hw)            # doctest: +SKIP
>>> print(report.table())                            # doctest: +SKIP
"""
from .comm import CommEstimate, collective_time, estimate
from .hardware import PRESETS, Hardware, hardware
from .report import CollectiveTiming, SimReport
from .simulate import simulate_graph

__all__ = ["hardware", "Hardware", "PRESETS", "collective_time", "estimate", "CommEstimate", "simulate_graph",
           "SimReport", "CollectiveTiming"]
