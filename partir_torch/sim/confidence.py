"""How far to trust a simulated figure: the held-out error of the closest validated family.

``benchmarks/sim_validation.py`` judges the simulator on published measurements grouped in families (chip x
strategy) and writes each family's median |error| on data the fit did not see (the validation half for validation
families, leave-one-family-out for calibration families) into ``FAMILY_ERROR`` below
(``--write-confidence``). A report finds its family from the hardware preset and the tactics its collectives come
from, and falls back to the closest validated family: same strategy on the nearest chip, then neighbouring strategies.

>>> closest_family("h200", "fsdp")[0] in FAMILY_ERROR
True
"""
from __future__ import annotations

from ..contract import tactic_family
from .hardware import CHIPS

# median |error| per family, held out (written by benchmarks/sim_validation.py --write-confidence)
FAMILY_ERROR = {
    "a100/all_reduce": 0.004,
    "a100/attention": 0.032,
    "a100/attention-fwd+bwd": 0.242,
    "a100/fsdp": 0.026,
    "a100/gemm": 0.056,
    "a100/hbm": 0.076,
    "b200/all_reduce": 0.153,
    "h100/all_gather": 0.005,
    "h100/all_reduce": 0.034,
    "h100/all_to_all": 0.084,
    "h100/attention": 0.007,
    "h100/attention-fwd+bwd": 0.230,
    "h100/dp": 0.063,
    "h100/fsdp": 0.036,
    "h100/fsdp+async-tp": 0.247,
    "h100/fsdp+dcn": 0.029,
    "h100/fsdp+tp": 0.189,
    "h100/gemm": 0.093,
    "h100/hbm": 0.078,
    "h100/tp": 0.163,
    "h100/tp+pp": 0.395,
    "h100/zero2": 0.063,
    "h200/all_reduce": 0.012,
    "h200/attention": 0.013,
    "h200/gemm": 0.091,
    "h200/hbm": 0.043,
    "v4/fsdp": 0.112,
    "v5e/fsdp": 0.038,
    "v5e/fsdp+dcn": 0.061,
    "v5p/fsdp+tp": 0.148,
}  # end FAMILY_ERROR

# chip class of each preset, and the classes nearest to each: declared on the chips (sim/hardware.py CHIPS)
CHIP = {name: chip.confidence for name, chip in CHIPS.items()}
NEAR_CHIPS = {chip.confidence: chip.nearest for chip in CHIPS.values()}
NEAR_STRATEGIES = {"fsdp": ("fsdp+dcn", "zero2", "dp"), "fsdp+dcn": ("fsdp", "zero2"), "zero2": ("fsdp", "dp"),
                   "dp": ("zero2", "fsdp"), "tp": ("fsdp+tp",), "fsdp+tp": ("tp", "fsdp"), "tp+pp": ("tp", "fsdp+tp"),
                   "ep": ("all_to_all", "dp"), "single": ("gemm", "attention", "hbm", "dp")}


# strategy of a program from the families its tactic classes declare (tactics.base.declare): tensor-parallel
# families, and the family that makes each other strategy; any other tactic (data parallel, manual, automatic, a name
# no class declared) makes a data-parallel program
TENSOR_PARALLEL = frozenset({"megatron", "sequence", "multi_query", "embedding"})


def strategy_of(tactics, families: dict | None = None) -> str:
    """Strategy family from the tactic names of a program's collectives (``CollectiveRecord.tactic``; a bucket's
    "BP+Z3" counts both) and the families their records carry (``CollectiveRecord.family``, declared by the tactic
    classes: a renamed tactic is still what it does); a name without one is looked up by its class's default name
    (``contract.TACTIC_FAMILY``)."""
    names = [t for t in tactics if t]
    families = families or {}
    fams = set()
    for t in names:
        known = families.get(t)
        fams.update(known.split("+") if known else (tactic_family(n) for n in t.split("+")))
    tp = bool(fams & TENSOR_PARALLEL)
    if "expert" in fams:
        return "ep"
    if "zero3" in fams:
        return "fsdp+tp" if tp else "fsdp"
    if tp:
        return "tp"
    if "zero2" in fams:
        return "zero2"
    return "dp" if names else "single"


def pipelined(strategy: str) -> str:
    """The strategy family of a pipelined program whose SPMD part is `strategy`: validated pipelined runs are
    tensor-parallel inside their stages ("tp+pp")."""
    return "tp+pp" if strategy in ("tp", "fsdp+tp") else f"{strategy}+pp"


def closest_family(hw_name: str, strategy: str) -> tuple:
    """(family, held-out median |error|) of the validated family closest to this chip and strategy, or
    ("", None) when no family has been validated. A pipelined strategy ("...+pp") is closest to the pipelined
    family, then to its SPMD part's."""
    chip = CHIP.get(hw_name, hw_name)
    chips = (chip,) + NEAR_CHIPS.get(chip, ())
    if strategy.endswith("+pp"):
        base = strategy[:-3]
        strategies = (strategy, "tp+pp", base) + NEAR_STRATEGIES.get(base, ())
        strategies = tuple(dict.fromkeys(strategies))
    else:
        strategies = (strategy,) + NEAR_STRATEGIES.get(strategy, ())
    ranked = sorted(((si + ci, ci), f"{c}/{s}") for si, s in enumerate(strategies) for ci, c in enumerate(chips))
    for _, fam in ranked:
        if fam in FAMILY_ERROR:
            return fam, FAMILY_ERROR[fam]
    return "", None
