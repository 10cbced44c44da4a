"""The torch-xla side: SPMD mode, the xs.Mesh of a pt.Mesh, partition specs, and where XLA dumps its HLO.

XLA reads XLA_FLAGS once, when its runtime starts (at the first XLA tensor). To read the post-partitioning HLO the
flags must ask for dumps before that: `enable()` adds them (a fresh directory under the system temp dir, or the
user's own --xla_dump_to) and turns SPMD on. `import partir_torch.xla` calls it.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile

from ..errors import PartitionError
from ..mesh import Mesh
from ..sharding import Sharding

# the SPMD partitioner's pass; its dump is the post-partitioning module, before XLA's later rewrites
DUMP_PASS = "spmd-partitioning"
_dump_dir: str | None = None


def enable() -> str | None:
    """SPMD on, HLO dumps on (if the runtime has not started yet); returns the dump directory or None."""
    global _dump_dir
    import torch_xla
    import torch_xla.runtime as xr

    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_dump_to=(\S+)", flags)
    started = torch_xla._XLAC._xla_runtime_is_initialized()
    if m is None and not started:
        path = tempfile.mkdtemp(prefix="partir_xla_hlo_")
        atexit.register(shutil.rmtree, path, True)     # ours: XLA also dumps each kernel's LLVM IR there
        flags = f"{flags} --xla_dump_to={path} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re={DUMP_PASS}".strip()
        os.environ["XLA_FLAGS"] = flags
        m = re.search(r"--xla_dump_to=(\S+)", flags)
    elif m is not None and not started and "--xla_dump_hlo_pass_re" not in flags:   # the user's directory
        os.environ["XLA_FLAGS"] = flags = f"{flags} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re={DUMP_PASS}"
    if m is not None and "--xla_dump_hlo_pass_re" in flags:
        _dump_dir = m.group(1)
    if os.environ.get("XLA_USE_SPMD") != "1":    # use_spmd() warns when called twice
        xr.use_spmd()
    return _dump_dir


def dump_dir() -> str:
    if _dump_dir is None:
        raise PartitionError("prog.hlo() of a to_xla() program: XLA was started without HLO dumps, so the "
                             "post-partitioning HLO cannot be read. Import partir_torch.xla (or call "
                             "prog.to_xla()) before the first XLA tensor is created, or start Python with "
                             "XLA_FLAGS='--xla_dump_to=<dir> "
                             f"--xla_dump_hlo_as_text --xla_dump_hlo_pass_re={DUMP_PASS}'.")
    return _dump_dir


def xs_mesh(mesh: Mesh):
    """An xs.Mesh over device ids 0..n-1 with the pt.Mesh's axis names and sizes: device i is partir's rank i
    (row-major, the last axis fastest), so replica groups map back to axes (hlo.axes_of_groups)."""
    import numpy as np
    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs

    n = xr.global_runtime_device_count()
    if n != mesh.size:
        raise PartitionError(f"to_xla: the mesh {mesh} has {mesh.size} devices but XLA sees {n}. On CPU run with "
                             f"PJRT_DEVICE=CPU CPU_NUM_DEVICES={mesh.size}; on TPU pick a mesh of {n} devices.")
    return xs.Mesh(np.arange(n), tuple(mesh.shape.values()), tuple(mesh.axes))


def partition_spec(sh: Sharding) -> tuple | None:
    """The xs partition spec of a partir Sharding (per dim: None, an axis, or a tuple of axes major to minor), or
    None where XLA's tile assignments cannot say it: partial values (pending reductions) and strided tilings
    (`unstrided` gives the layout XLA holds those in)."""
    if sh.partial or sh.strides:
        return None
    return tuple(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in sh.dims)


def unstrided(sh: Sharding) -> Sharding:
    """`sh` with each strided dim whole on its strided axis and the axes after it on that dim (they tile within
    its strided pieces): a layout an XLA tile assignment can express. Other dims and axes are kept.

    >>> str(unstrided(Sharding(dims=(("batch",), ("model",)), strides=(("model", 3),))))
    '[{batch}, {}]'
    """
    if not sh.strides:
        return sh
    strided = dict(sh.strides)
    dims = []
    for axes in sh.dims:
        first = next((i for i, a in enumerate(axes) if a in strided), len(axes))
        dims.append(axes[:first])
    kept = {a for axes in dims for a in axes}
    return Sharding.interned(dims, sh.partial, sh.replicated, (), tuple(b for b in sh.blocks if b[0] in kept))


def strided_axes(sh: Sharding) -> dict:
    """dim -> the axes `unstrided` drops from it (a strided axis and those after it on its dim)."""
    kept = unstrided(sh).dims
    return {d: axes[len(kept[d]):] for d, axes in enumerate(sh.dims) if len(kept[d]) < len(axes)}


def dumped_modules() -> dict:
    """Dump file name -> size of the post-partitioning modules dumped so far."""
    path = dump_dir()
    if not os.path.isdir(path):
        return {}
    return {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
            if f.endswith(".txt") and f"after_{DUMP_PASS}" in f}
