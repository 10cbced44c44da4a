"""The op registry's rows: every op with a rule says how it runs on its shards, what FLOPs the simulator charges and
how torch-xla runs it (rules/registry.py), or is listed here as a gap; every link names a function that exists and
that the package using it finds through the row."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import flop_registry

from partir_torch.lower import indexed
from partir_torch.rules import registry as R
from partir_torch.rules.localize import ROWS
from partir_torch.sim import compute

aten = torch.ops.aten
ROOT = Path(R.__file__).resolve().parents[1]

# Ops with a rule that lack one of the others. Close a gap by adding what is missing and its LINKS row.
KNOWN_GAPS = {
    "aten.dot.default": ["flops"],              # matmul-like, not in torch's flop counter: charged as memory bound
    "aten.mv.default": ["flops"],
    "aten.glu_backward.default": ["xla"],       # torch-xla 2.9 has no kernel and no composite for it
    "aten.im2col.default": ["xla"],             # nn.Unfold / nn.Fold: torch-xla 2.9 has no kernel
    "aten.col2im.default": ["xla"],
    "aten.linalg_solve_triangular.default": ["xla"],    # torch-xla 2.9 has no kernel for it
    "aten.unfold_backward.default": ["xla"],
    "aten._fft_c2c.default": ["xla"],           # FFTs (FNet): torch-xla 2.9 has no kernel
    "aten._fft_r2c.default": ["xla"],
    "aten._fft_c2r.default": ["xla"],
    "partir.experts_grouped.default": ["xla"],  # HF's grouped-mm experts (rules/moe.py): not traced on XLA yet
    "partir.experts_grouped_backward.default": ["xla"],
    "partir.group_batch_norm.default": ["xla"],           # batchnorm="local" (rules/group_bn.py): not on XLA yet
    "partir.group_batch_norm_backward.default": ["xla"],
}


def test_every_op_with_a_rule_has_its_row_or_is_a_known_gap():
    rows = [r for r in R.default_registry().rows() if r.family != R.USER]   # other tests register ops of their own
    assert len(rows) > 200
    gaps = {str(r.op): r.gaps() for r in rows if r.gaps()}
    assert gaps == KNOWN_GAPS, "\n".join(f"{op}: lacks {', '.join(g)}" for op, g in sorted(gaps.items()))


def test_a_rule_of_the_user_s_lacks_everything_the_op_does_not_tell():
    reg = R.RuleRegistry({aten.gelu.default: "a->a", aten.mm.default: "mk,kn->mn", aten.t.default: "ab->ba"})
    assert reg.row(aten.gelu.default).gaps() == ["local", "flops", "xla"]
    assert reg.row(aten.mm.default).gaps() == ["local", "xla"] and reg.row(aten.mm.default).flops == R.TORCH
    assert reg.row(aten.t.default).xla == R.VIEW_COPY and reg.row(aten.t.default).family == R.USER


def test_links_name_the_functions_their_packages_use():
    rows = R.default_registry().rows()
    local = {r.op: r.local for r in rows if (r.local or "").startswith("lower.indexed.")}
    assert indexed.IMPLS == {op: getattr(indexed, name.rsplit(".", 1)[1]) for op, name in local.items()}
    assert set(local) == {aten.embedding.default, aten.embedding_dense_backward.default, aten.nll_loss_forward.default,
                          aten.nll_loss_backward.default, aten.arange.default, aten.arange.start,
                          aten.arange.start_step, aten._scaled_dot_product_flash_attention_for_cpu.default,
                          aten._scaled_dot_product_flash_attention_for_cpu_backward.default}   # CP's causal rows
    flops = {r.op._schema.name: getattr(compute, r.flops.rsplit(".", 1)[1]) for r in rows
             if (r.flops or "").startswith("sim.compute.")}
    assert compute.EXTRA_FLOPS == flops and len(flops) == 4      # CPU flash attention, HF grouped-mm experts
    # xla/kernels.py imports torch_xla's package here; its functions are read from the source
    tree = ast.parse((ROOT / "xla" / "kernels.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    xla = {r.xla.rsplit(".", 1)[1] for r in rows if r.xla and r.xla.startswith("xla.kernels.")}
    assert len(xla) == 15 and xla <= defined, xla - defined     # 9 kernels, 6 random draws on the host


def test_rows_agree_with_what_torch_and_the_schema_say():
    for r in R.default_registry().rows():
        if not (r.flops or "").startswith("sim.compute."):     # a formula of the simulator's own comes first
            assert (r.flops == R.TORCH) == (r.op.overloadpacket in flop_registry), r
        if R._view_copy(r.op) is not None and R.LINKS.get(r.op, R.Links()).xla is None:
            assert r.xla == R.VIEW_COPY, r
        if r.xla == R.VIEW_COPY:
            assert r.op.is_view and R._view_copy(r.op) is not None, r
        assert r.localize is ROWS.get(r.op, R.GENERIC), r
    assert set(R.LINKS) <= set(R.default_registry().ops())           # no row for an op without a rule
    assert set(R.FAMILY_LINKS) <= {r.family for r in R.default_registry().rows()}


def test_a_row_prints_on_one_line():
    line = str(R.default_registry().row(aten.embedding.default))
    assert line == ("aten.embedding.default: rule nn.embedding  localize generic  local lower.indexed.embedding  "
                    "flops none  xla as is  tags ends_layer")


def test_a_link_to_a_missing_function_fails_at_import(monkeypatch):
    monkeypatch.setitem(R.LINKS, aten.tril.default, R.Links(local="lower.indexed.tril"))
    try:
        R.linked("local", "lower.indexed", vars(indexed))
    except RuntimeError as e:
        assert "lower.indexed.tril, which does not exist" in str(e)
    else:
        raise AssertionError("a dangling link was accepted")


# ---- per-op facts live in rules/ (issue 41 item 2) ---------------------------------------------------------------

def _aten_collections(tree) -> list:
    """Module-level statements of `tree` that build a set/frozenset/tuple/list/dict literal (or a set/frozenset/...
    call on one) naming an aten op: `aten.view.default`, `torch.ops.aten.mm.default`."""
    def aten_attr(e):
        s = ast.unparse(e)
        return isinstance(e, ast.Attribute) and (s.startswith("aten.") or s.startswith("torch.ops.aten."))

    def elements(c):
        if isinstance(c, (ast.Set, ast.List, ast.Tuple)):
            return c.elts
        if isinstance(c, ast.Dict):
            return [k for k in c.keys if k is not None] + list(c.values)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in (
                "set", "frozenset", "tuple", "list", "dict") and c.args:
            return elements(c.args[0])
        return []

    return [stmt for stmt in tree.body if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None
            and any(aten_attr(e) for c in ast.walk(stmt.value) for e in elements(c))]


def test_no_module_outside_rules_lists_aten_ops():
    import partir_torch

    root = Path(partir_torch.__file__).parent
    found = [f"{p.relative_to(root)}:{s.lineno}" for p in sorted(root.rglob("*.py")) if p.parent.name != "rules"
             for s in _aten_collections(ast.parse(p.read_text()))]
    assert found == [], f"per-op facts belong in rules/tags.py (a tag, or a table there): {found}"
    bad = ast.parse("X = {torch.ops.aten.mm.default}\nY = frozenset((aten.t.default,))\nZ = {1: aten.mm.default}\n"
                    "W = (1, 2)\ndef f():\n    return {aten.mm.default}\n")
    assert [s.lineno for s in _aten_collections(bad)] == [1, 2, 3]      # the scan sees all three forms


def test_tags_name_real_ops_and_agree_with_torch():
    from partir_torch.rules import tags

    for tag, ops in tags.TAGS.items():
        assert ops and all(isinstance(op, torch._ops.OpOverload) for op in ops), tag
    for op in tags.ops("view"):            # a view's schema says it aliases its operand (reshape may copy)
        assert op.is_view or op in tags.ops("aliases"), op
    for op in tags.ops("random"):
        assert torch.Tag.nondeterministic_seeded in op.tags, op
    assert tags.ops("matmul_bias") | tags.ops("matmul_2d") <= tags.ops("matmul")
    assert tags.ops("unpacks_collective") <= tags.ops("prepares_gather")
    assert R.default_registry().has_tag(aten.view.default, "view") and "view" in R.default_registry().row(
        aten.view.default).tags
    with pytest.raises(KeyError, match="no tag 'veiw'"):
        tags.has(aten.view.default, "veiw")


def test_partir_kernels_are_declared_in_tags():
    """lower/fuse.py's adam_update is declared a kernel in rules/tags.py (not marked by function attributes): the
    simulator prices it as compute and lets its results take the storage of the arguments it donates."""
    import inspect

    from partir_torch.lower.fuse import adam_update
    from partir_torch.rules import tags

    assert tags.is_kernel(adam_update) and not tags.is_kernel(aten.mm.default) and not tags.is_kernel([])
    names = list(inspect.signature(adam_update).parameters)
    assert [names[k] for k in tags.donated_args(adam_update)] == ["params", "exp_avgs", "exp_avg_sqs",
                                                                    "max_exp_avg_sqs"]
    assert names[-1] == "donate" and tags.donated_args(aten.mm.default) == ()
    assert compute.op_class(adam_update)[0] == compute.COMPUTE
