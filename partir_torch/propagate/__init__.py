"""Propagation: what each tactic's seeds imply for every value of the captured graph, one mesh axis at a time.

Modules:

- graph.py: PartGraph, the captured graph as value and op tables (operands, results, users, each op's rule), with
  tied values (a state input and its updated output) folded into one canonical value.
- state.py: the data propagation records: per-axis states as small integer codes (UNKNOWN, WHOLE,
  PARTIAL[op], dim >= 0; no module outside propagate/ imports them), Provenance (the tactic, and the op and
  neighbour a decision came through), Conflict.
- record.py: DecisionRecord, the working tables (per-axis states, the axes tiling each op factor and each value
  dim, strided splits, sealed values, conflicts), their queries, the stage snapshot and the copy-on-write trial
  copy, and the undo of one op's decision.
- engine.py: Propagator, the one worklist loop that writes them: seeds, then forward and backward to a fixed point.
- decisions.py: Decisions, the contract with everything downstream.
- arrays.py: the array form of one axis's decisions (the automatic search and the fast estimate score many
  candidates at once): named predicates (tiled, partial, undecided, ...) over the codes.

The contract. Tactics write decisions only through TacticContext (tactics/context.py: seed_and_propagate, its queries such
as is_unknown / local_dim / op_decisions, and trial() copies to try decisions on); they never touch the tables.
Lowering, the simulator, explain(), the torch-xla backend and checkpoint resharding read a Decisions: an immutable
snapshot (`prog.decisions` after the schedule, `prog.stages[k].decisions` after tactic k) whose queries give,
per value and axis, an AxisDecision with an enum kind (UNKNOWN / REPLICATED / TILED(dim, stride) / PARTIAL(op))
and the tactic that decided it; per value its public Sharding; per op the axes tiling each rule factor, the inner
split of a strided factor and the reduction a partial operand passes through:

    d = prog.decisions
    d.state("model", vid)        # AxisDecision(kind=TILED, dim=0, stride=1, tactic='MP')
    d.sharding(vid)              # pt.Sharding
    d.op_factor_axes(i)          # {factor id: ("batch",), ...}
"""
