"""Model zoo: small deterministic pure-torch.nn models used by the tests and benchmarks.

    from examples.models import ZOO, get
    spec = ZOO["gpt"]                      # ModelSpec(name, build, batch, loss_fn, batch_dims)
    model = spec.build()                   # seeded: two builds have equal weights
    batch = spec.batch(4)                  # (inputs..., targets)
    loss = spec.loss_fn(model, *batch)
    spec = get("gpt", attention="sdpa")    # same spec with config overrides bound in
"""
from __future__ import annotations

import dataclasses
import functools

from . import gns, gpt, llama, mlp, moe, unet, vit
from ._common import ModelSpec

ZOO: dict[str, ModelSpec] = {
    m.SPEC.name: m.SPEC for m in (mlp, gpt, llama, unet, gns, moe, vit)
}

# Named config variants worth exercising in addition to each model's defaults.
VARIANTS: dict[str, dict] = {
    "gpt": {"attention": "matmul"},
    "gpt_sdpa": {"attention": "sdpa"},
    "moe": {"dispatch": "onehot"},
    "moe_index": {"dispatch": "index"},
    "moe_capacity": {"dispatch": "capacity"},
}


def get(name: str, **overrides) -> ModelSpec:
    """ZOO[name]; with overrides, a spec whose build/batch have those config values bound.

    `name` may also be a VARIANTS key such as "gpt_sdpa" or "moe_index".
    """
    base = name
    if name not in ZOO:
        if name not in VARIANTS:
            raise KeyError(f"unknown model {name!r}; known: {sorted(ZOO) + sorted(VARIANTS)}")
        base = name.split("_")[0]
        overrides = {**VARIANTS[name], **overrides}
    spec = ZOO[base]
    if not overrides:
        return spec
    suffix = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return dataclasses.replace(
        spec,
        name=f"{base}[{suffix}]",
        build=functools.partial(spec.build, **overrides),
        batch=functools.partial(_batch_with, spec.batch, overrides),
    )


def _batch_with(batch_fn, overrides, batch_size=4, device="cpu", seed=0):
    return batch_fn(batch_size, device, seed, **overrides)


__all__ = ["ZOO", "VARIANTS", "ModelSpec", "get"]
