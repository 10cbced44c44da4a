"""During capture, Hugging Face's grouped-mm experts are recorded as one per-token op (rules/moe.py says why).

`hf_experts()` is entered around the trace: transformers' experts registry entry "grouped_mm" (the default experts
implementation) is replaced by a function that calls `partir::experts_grouped` for a module it can stand in for
(weights `gate_up_proj`/`up_proj` and `down_proj`, no biases, no post-expert norm, no expert parallelism of HF's
own) and HF's function for any other; the entry is restored afterwards. Nothing changes when transformers is not
imported, and the user's model is never modified.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import types

import torch

from ..rules.moe import EXPERTS, experts_grouped

_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


class StandIn:
    """The experts module's static attributes (flags, activation, config, its `_apply_gate`), without weights."""

    def __init__(self, module):
        self.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
        self.__dict__.update({k: m for k, m in module._modules.items()})          # parameter-free: act_fn
        self._is_expert_parallel = False
        self._of = type(module)
        self._gated = "gate_up_proj" in module._parameters
        apply_gate = getattr(type(module), "_apply_gate", None)
        if apply_gate is not None:
            self._apply_gate = types.MethodType(apply_gate, self)

    def key(self, fn) -> int:
        """The same on every rank and in every process for the same experts (class, function and static
        attributes; the weights are operands): it is written into the program, which the ranks compare."""
        text = repr((self._of.__module__ + '.' + self._of.__qualname__, fn.__module__, fn.__qualname__,
                     sorted((k, repr(v)) for k, v in self.__dict__.items() if k not in ("_of", "_apply_gate"))))
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)

    def with_weights(self, first: torch.Tensor, down: torch.Tensor) -> "StandIn":
        me = object.__new__(StandIn)
        me.__dict__.update(self.__dict__)
        me.__dict__["gate_up_proj" if self._gated else "up_proj"] = first
        me.down_proj = down
        return me


def _supported(module) -> bool:
    params = set(module._parameters)
    first = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    return (params == {first, "down_proj"} and not getattr(module, "has_bias", False)
            and not getattr(module, "has_post_expert_norm", False) and not getattr(module, "_is_expert_parallel", False)
            and not any(any(True for _ in m.parameters()) for m in module._modules.values()))


def _partir_experts(original):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if not _supported(self):
            return original(self, hidden_states, top_k_index, top_k_weights)
        stand_in = StandIn(self)
        key = stand_in.key(original)
        EXPERTS.setdefault(key, (original, stand_in))
        first = self.gate_up_proj if "gate_up_proj" in self._parameters else self.up_proj
        return experts_grouped(hidden_states, top_k_index, top_k_weights, first, self.down_proj, key)

    forward.partir_original = original
    return forward


@contextlib.contextmanager
def hf_experts():
    """Within: HF's "grouped_mm" experts run as partir::experts_grouped (see the module docstring)."""
    moe = sys.modules.get("transformers.integrations.moe")
    registry = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    mapping = getattr(registry, "_global_mapping", None)
    original = mapping.get("grouped_mm") if isinstance(mapping, dict) else None
    if original is None or hasattr(original, "partir_original"):
        yield
        return
    mapping["grouped_mm"] = _partir_experts(original)
    try:
        yield
    finally:
        mapping["grouped_mm"] = original
