"""The graph contract: what capture writes on FX nodes and every later stage (propagation, tactics, lowering, the
runtimes, the simulator) reads. One definition of each concept: node.meta keys, value roles and names, step
phases, and the op families several passes need (views, random draws).

    from partir_torch.contract import META_ROLE, Role, phase_of
    if node.meta.get(META_ROLE) == Role.PARAM and phase_of(node) == Phase.FORWARD: ...

Role and Phase are string enums: a member equals its string ("param" == Role.PARAM), so records and printed
tables keep their plain strings.
"""
from __future__ import annotations

from enum import Enum

import torch


aten = torch.ops.aten


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return str.__str__(self)

    __format__ = str.__format__


class Role(_StrEnum):
    """What a placeholder of the captured step holds."""

    PARAM = "param"            # a parameter (trainable or frozen)
    BUFFER = "buffer"          # a module buffer (running statistics, rope tables)
    OPT_STATE = "opt_state"    # optimizer state of one parameter (exp_avg, momentum_buffer, ...)
    INPUT = "input"            # a leaf of the batch
    CONST = "const"            # a tensor created inside the step (torch.tensor(...), an HF cache), lifted
    LR = "lr"                  # an optimizer hyperparameter fed at every step (each group's lr, betas, ...)
    STEP = "step"              # the optimizer's step count (or one parameter's: `step.<fqn>`)
    DRAW = "draw"              # a random draw the step's guards made before it (capture/branches.py), fed per call
    COORD = "coord"            # per-device programs only: the rank's coordinate on one mesh axis


STATE_ROLES = (Role.PARAM, Role.BUFFER, Role.OPT_STATE)      # kept on device between steps, tied to an output
OPTIMIZER_INPUTS = (Role.OPT_STATE, Role.LR, Role.STEP)       # what only the optimizer update reads


class Phase(_StrEnum):
    """Which part of the step a node belongs to (stamped once at capture, META_PHASE)."""

    FORWARD = "forward"        # an ancestor of the loss (every node of a forward-only program)
    BACKWARD = "backward"      # the rest that does not depend on optimizer inputs
    OPTIMIZER = "optimizer"    # depends on optimizer state, hyperparameters or the step count


# -- node.meta keys ------------------------------------------------------------------------------------------------
# captured graph
META_NAME = "partir_name"                  # placeholders: the named value ("params.w1.weight")
META_ROLE = "partir_role"                  # placeholders: a Role
META_PHASE = "partir_phase"                # every node: a Phase
META_TAG = "partir_tag"                    # the first module-output tag on a node ("layers.0.mlp:out")
META_TAGS = "partir_tags"                  # every module-output tag on a node
META_OUTPUT = "partir_output"              # True on nodes that are outputs of the step
META_REMAT = "partir_remat"                # remat: the FQN of the checkpointed module that made the node
META_RECOMPUTE = "partir_recompute"        # remat: on a recomputed copy, the module FQN
META_SAVED = "partir_saved"                # selective remat: on a kept op output (a matmul's, attention's), the FQN
META_RECOMPUTE_OF = "partir_recompute_of"  # remat: on a recomputed copy, the name of the node it recomputes
META_NO_PARTIAL_PASS = "partir_no_partial_pass"   # mixed precision: a partial value is reduced before this node
META_PARTIAL_FANOUT = "partir_partial_fanout"    # LoRA: a partial value passes to each of its users linear in it
META_ACCUMULATE = "partir_accumulate"      # fx custom meta: the node belongs to one micro-batch (accumulate=k)
META_MODULE = "partir_module"              # pipeline capture: FQN of the module whose forward (or backward) made it
META_MICRO = "partir_micro"                # pipeline capture: index of the micro-batch the node computes for
META_CLIP = "partir_clip"                  # fx custom meta of clip_grad_norm's ops: "square" (one gradient's sum of
#                                            squares), "sum" (the running total), "coef" (sqrt .. the scale), "scale"
# per-device (lowered) graph
META_SRC = "partir_src"                    # the captured node a lowered op computes
META_COLLECTIVE = "partir_collective"      # a CollectiveRecord, on the collective node
META_LOCAL_SHAPE = "partir_local_shape"    # shape of an emitted node's local result
META_IN_SHAPE = "partir_in_shape"          # a collective's local input shape
META_STAGE = "partir_stage"                # pipelined programs: the pipeline stage that runs the node
META_ACTION = "partir_action"              # pipelined programs: (stage, "F" | "B" | "W" (ZB-V), j) | (stage, "U", 0)
# on an exception raised by a per-device op in emulation: the name of the lowered node that raised it
EXC_NODE = "partir_node"

# -- value names ---------------------------------------------------------------------------------------------------
PARAMS, BUFFERS, OPT, INPUTS, CONSTS, GRADS, OUTPUTS = "params.", "buffers.", "opt.", "inputs.", "consts.", \
    "grads.", "outputs."
STATE_PREFIXES = (PARAMS, BUFFERS, OPT)     # values that persist from step to step


def param_name(fqn: str) -> str:
    return PARAMS + fqn


def opt_name(state: str, fqn: str) -> str:
    return f"{OPT}{state}.{fqn}"


# -- phases --------------------------------------------------------------------------------------------------------
def _reach(roots, step) -> set:
    """Every node reachable from the roots by `step` (inputs or users), the roots included."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


def stamp_phases(gm, forward_only: bool) -> None:
    """Write META_PHASE on every node of a captured step: forward = ancestors of the loss (output 0); optimizer =
    descendants of the optimizer's inputs; backward = the rest."""
    nodes = list(gm.graph.nodes)
    if forward_only:
        for n in nodes:
            n.meta[META_PHASE] = Phase.FORWARD
        return
    fwd = _reach([nodes[-1].args[0][0]], lambda n: n.all_input_nodes)
    opt = _reach([n for n in nodes if n.op == "placeholder" and n.meta.get(META_ROLE) in OPTIMIZER_INPUTS],
                 lambda n: n.users)
    for n in nodes:
        n.meta[META_PHASE] = Phase.FORWARD if n in fwd else Phase.OPTIMIZER if n in opt or n.op == "output" \
            else Phase.BACKWARD


def phase_of(node) -> Phase:
    """The node's phase as stamped at capture (a node without a stamp counts as backward)."""
    return node.meta.get(META_PHASE, Phase.BACKWARD)


# ---- tactic families ---------------------------------------------------------------------------------------------
# What a tactic does is declared on its class (tactics.base.declare: `family`, and whether the automatic search may
# try it as a macro-action). The simulator's confidence sees a tactic only by the name its collectives carry, so the
# declaration also enters each class's default names here: "MP" -> "megatron", "Z3" -> "zero3", ...
TACTIC_FAMILY: dict = {}


def tactic_family(name: str) -> str:
    """The family declared for a tactic name ("MP", "BP-dcn", "Z3[...]"), or "" for a name no tactic declared."""
    return TACTIC_FAMILY.get(str(name).split("[")[0].split("-")[0], "")


def forward_nodes(gm) -> set:
    """The forward phase of a captured graph, as stamped: the ancestors of the loss; every node of a forward-only
    or eval graph."""
    return {n for n in gm.graph.nodes if n.meta.get(META_PHASE) == Phase.FORWARD}


def traced_forward(gm) -> tuple:
    """(nodes in order, the forward as traced): the nodes up to the loss in program order. make_fx traces the
    forward first, so this is the forward phase plus what it saves for the backward (a norm's mean and rstd,
    detached activations), which the capture-time memory rewrites (remat, mixed precision) move or recompute."""
    nodes = list(gm.graph.nodes)
    loss = nodes[-1].args[0][0]              # the step returns loss.detach()
    while loss.target in (aten.detach.default, aten.alias.default):
        loss = loss.args[0]
    return nodes, set(nodes[:nodes.index(loss) + 1])
# context_parallel(load_balance=True) (tactics/cpbalance.py): on a sequence input's placeholder, (seq_dim, n): the
# runtime lays it out in zigzag order; on the captured GraphModule, {"axis", "n", "done"}: the axis of the layout
META_ZIGZAG = "partir_zigzag"
