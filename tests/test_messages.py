"""The messages a new user meets first (issue 22, item 5): each names the real cause and the fix, and is a
pt.PartitionError. Programs built on the meta device report (collectives, summary, simulate) but do not run."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from examples.models import ZOO, get
from tests.harness import train_next_to_eager

T = pt.tactics


class Wide(nn.Module):
    """A 256-wide MLP block: fc1 (256 -> 1024), GELU, fc2 (1024 -> 256)."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _sum_loss(m, x):
    return m(x).pow(2).mean()


# -- megatron ----------------------------------------------------------------------------------------------------
def test_megatron_axis_size_that_divides_no_dim_says_so():
    """3 does not divide 1024 under strict=True (without it the features are tiled unevenly, test_uneven.py): the
    pair was found, the axis size is the cause, and 2 / 4 are sizes that fit."""
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(Wide(), pt.Mesh({"model": 3}), [T.megatron("model")], example_inputs=(torch.randn(8, 256),),
                     loss_fn=_sum_loss, options=pt.Options(strict=True))
    msg = str(e.value)
    assert "found column-parallel/row-parallel linear pairs" in msg
    assert "axis 'model' (size 3)" in msg and "3 does not divide" in msg
    assert "1024 output features in fc1.weight" in msg
    assert "(2 or 4 or 8 or 16 here)" in msg
    assert "found no" not in msg


def test_megatron_heads_the_axis_does_not_divide_are_named():
    spec = get("gpt_sdpa")     # 4 heads, MLP hidden 128 (tiled unevenly without strict=True)
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(spec.build(), pt.Mesh({"model": 3}), [T.megatron("model")], example_inputs=spec.batch(4),
                     loss_fn=spec.loss_fn, options=pt.Options(strict=True))
    msg = str(e.value)
    assert "4 attention heads in layers.0.attn.wq.weight and 5 more" in msg
    assert "128 output features in layers.0.mlp.w1.weight and 1 more" in msg
    assert "(2 or 4 here)" in msg


def test_megatron_without_any_linear_pair_keeps_its_message():
    spec = ZOO["unet"]
    with pytest.raises(pt.PartitionError, match="found no column-parallel/row-parallel linear pair"):
        pt.partition(spec.build(), pt.Mesh({"model": 2}), [T.megatron("model")], example_inputs=spec.batch(2),
                     loss_fn=spec.loss_fn)


@pytest.mark.parametrize("glob, expect", [
    ("fc1", "it names the module fc1, and plan globs name parameters. Use 'fc1.weight'."),
    ("fc?", "it names the modules fc1, fc2, and plan globs name parameters. Use 'fc?.weight'."),
    ("fc1.weigth", "Did you mean 'fc1.weight'"),
])
def test_megatron_plan_glob_naming_a_module_suggests_its_weight(glob, expect):
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(Wide(), pt.Mesh({"model": 2}), [T.megatron("model", plan={glob: "colwise"})],
                     example_inputs=(torch.randn(8, 256),), loss_fn=_sum_loss)
    assert f"plan entry {glob!r} matches no parameter weight" in str(e.value)
    assert expect in str(e.value)


def test_megatron_plan_without_colwise_says_what_is_missing():
    with pytest.raises(pt.PartitionError, match=r"names no 'colwise' weight.*'<fqn glob>.weight': 'colwise'"):
        pt.partition(Wide(), pt.Mesh({"model": 2}), [T.megatron("model", plan={"fc2.weight": "rowwise"})],
                     example_inputs=(torch.randn(8, 256),), loss_fn=_sum_loss)


# -- example_inputs --------------------------------------------------------------------------------------------------
def test_a_bare_tensor_is_one_input_in_partition_and_train_step():
    """example_inputs=x means (x,): partition and train_step(x) train like eager (it used to be unpacked row by
    row: 'forward() takes 2 positional arguments but 9 were given')."""
    torch.manual_seed(0)
    model, x = Wide(16), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=x,
                        loss_fn=_sum_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert prog.sharding("inputs.0").dims[0] == ("batch",)
    train_next_to_eager(prog, ref, [(x,)] * 2, _sum_loss, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    fwd = pt.partition(ref, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=x)
    torch.testing.assert_close(fwd(x), ref(x))


class Keywords(nn.Module):
    """Takes its batch as keywords, as Hugging Face models do: model(input_ids=..., mask=...)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, input_ids, mask=None):
        return self.fc(input_ids) * mask


def _dict_batch(n=8):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randn(n, 16, generator=g), "mask": (torch.rand(n, 16, generator=g) > 0.3).float()}


def _dict_loss(m, batch):
    return m(**batch).pow(2).mean()


def test_a_dict_batch_is_one_input_for_loss_fn_and_keywords_for_the_model():
    torch.manual_seed(0)
    model, batch = Keywords(), _dict_batch()
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=batch,
                        loss_fn=_dict_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert prog.sharding("inputs.1").dims[0] == ("batch",)       # inputs.<i> in the dict's order: mask is 1
    train_next_to_eager(prog, ref, [(batch,)] * 2, _dict_loss, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.testing.assert_close(prog.eval_step(batch), _dict_loss(ref.eval(), batch))
    # forward only: the model is called as model(**batch), and so is prog(batch) / prog.forward(batch)
    fwd = pt.partition(ref, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=batch)
    torch.testing.assert_close(fwd(batch), ref(**batch))
    torch.testing.assert_close(fwd.forward(_dict_batch(4)), ref(**_dict_batch(4)))


def test_a_dict_batch_in_another_key_order_feeds_the_same_inputs():
    """Capture flattens a dict in its key order; a call whose dict has the keys in another order is put in the
    captured order (train_step, eval_step), and a dict with other keys is refused naming both structures."""
    torch.manual_seed(0)
    model, batch = Keywords(), _dict_batch()
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=batch,
                        loss_fn=_dict_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    swapped = {"mask": batch["mask"], "input_ids": batch["input_ids"]}
    train_next_to_eager(prog, ref, [(swapped,)] * 2, _dict_loss, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.testing.assert_close(prog.eval_step(swapped), _dict_loss(ref.eval(), batch))
    torch.testing.assert_close(prog.eval_step(batch), _dict_loss(ref.eval(), batch))
    with pytest.raises(pt.PartitionError, match="(?s)captured with .*the same dict keys"):
        prog.train_step({"input_ids": batch["input_ids"]})
    # keywords are the dict: train_step(**batch) is train_step(batch)
    want = _dict_loss(ref.train(), batch)
    torch.testing.assert_close(prog.eval_step(**swapped), _dict_loss(ref.eval(), batch))
    torch.testing.assert_close(prog.train_step(**swapped), want)     # the loss before this step's update
    with pytest.raises(pt.PartitionError, match="positionally or as keywords, not both"):
        prog.train_step(batch["input_ids"], mask=batch["mask"])


class TakesADict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, graph):
        return self.fc(graph["nodes"]) + graph["bias"]


def test_a_dict_that_names_no_forward_parameter_is_passed_whole():
    model, graph = TakesADict(), {"nodes": torch.randn(8, 16), "bias": torch.randn(8, 16)}
    fwd = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=graph)
    torch.testing.assert_close(fwd(graph), model(graph))


def test_a_dict_batch_with_a_loss_fn_taking_keywords_says_how_to_take_it():
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(Keywords(), pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=_dict_batch(),
                     loss_fn=lambda m, input_ids, mask: m(input_ids, mask).sum())
    assert "A single dict as example_inputs is one input: loss_fn(model, batch)" in str(e.value)
    assert "loss_fn=lambda m, batch: m(**batch).loss" in str(e.value)


def test_a_dict_batch_whose_keys_forward_does_not_take_is_named():
    batch = {**_dict_batch(), "labels": torch.zeros(8)}
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(Keywords(), pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=batch)
    msg = str(e.value)
    assert "keys ['input_ids', 'labels', 'mask']" in msg and "Keywords.forward(input_ids, mask=None)" in msg
    assert "'labels'" in msg and "loss_fn=lambda m, batch:" in msg


def test_a_non_tensor_leaf_is_named_by_its_path():
    with pytest.raises(pt.PartitionError, match=r"example_inputs\[0\]\['mode'\] \(inputs.1\) is a str \('train'\), "
                                                r"not a tensor"):
        pt.partition(Wide(16), pt.Mesh({"batch": 2}), [T.data_parallel("batch")],
                     example_inputs={"x": torch.randn(8, 16), "mode": "train"}, loss_fn=lambda m, b: m(b["x"]).sum())


def test_a_hugging_face_batch_dict_trains_and_runs_the_model_with_keywords():
    """The HF way: batch = {"input_ids", "attention_mask", "labels"}; loss_fn(model, batch) = model(**batch).loss;
    without a loss_fn, prog(batch) is model(**batch)."""
    from harness import adamw
    from test_hf import gpt2

    torch.manual_seed(0)
    model = gpt2().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (8, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def loss_fn(m, b):
        return m(**b).loss

    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=batch, loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(batch,)] * 2, loss_fn, make_opt=adamw(eps=1e-5))
    fwd = pt.partition(ref, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs={"input_ids": ids})
    torch.testing.assert_close(fwd({"input_ids": ids}).logits, ref(input_ids=ids).logits)


# -- meta-device models ------------------------------------------------------------------------------------------
META_CASES = {"gpt": ({"batch": 2, "model": 2}, lambda: [T.data_parallel("batch"), T.megatron("model")]),
              "llama": ({"batch": 2, "model": 2}, lambda: [T.data_parallel("batch"), T.megatron("model"),
                                                            T.zero(3, "batch")]),
              "mlp": ({"batch": 4}, lambda: [T.data_parallel("batch"), T.zero(3, "batch")])}


def _meta_program(name, loss=True, device="meta"):
    spec, (mesh, schedule) = ZOO[name], META_CASES[name]
    model, batch = spec.build(device=device), spec.batch(8, device=device)
    assert all(p.device.type == device for p in model.parameters())
    kw = dict(loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3)) if loss else {}
    prog = pt.partition(model, pt.Mesh(mesh), schedule(), example_inputs=batch if loss else batch[:-1], **kw)
    return prog, batch, mesh


@functools.lru_cache(maxsize=None)
def _shared_meta_program(name):
    """One meta-built program per model for the read-only report tests below (collectives, summary, simulate)."""
    return _meta_program(name)


META_NAMES = [pytest.param(n, marks=pytest.mark.xdist_group(f"meta_{n}")) for n in META_CASES]


@pytest.mark.parametrize("name", META_NAMES)
def test_meta_model_collectives(name):
    prog, _, mesh = _shared_meta_program(name)
    got = prog.collectives()
    assert got and all(r.nbytes > 0 and r.axis in mesh for r in got)
    real = _meta_program(name, device="cpu")[0].collectives()      # the same program as the model built for real
    assert [(r.kind, r.axis, r.nbytes, r.phase) for r in got] == [(r.kind, r.axis, r.nbytes, r.phase) for r in real]
    if "model" in mesh:      # Megatron: 2 all-reduces per layer forward (the zoo models have 2 layers)
        assert sum(r.kind == "all_reduce" and r.axis == "model" and r.phase == "forward" for r in got) == 4
    else:                    # ZeRO-3 gathers the parameters and reduce-scatters their gradients
        assert {r.kind for r in got} >= {"all_gather", "reduce_scatter"}


@pytest.mark.parametrize("name", META_NAMES)
def test_meta_model_summary(name):
    prog, _, _ = _shared_meta_program(name)
    text = prog.summary()
    for tactic in ("BP", "MP" if name != "mlp" else "Z3"):
        assert tactic in text


@pytest.mark.parametrize("name", META_NAMES)
def test_meta_model_simulate(name):
    prog, _, mesh = _shared_meta_program(name)
    n = 1
    for size in mesh.values():
        n *= size
    report = prog.simulate(pt.sim.hardware("h100", gpus_per_node=n))
    assert report.step_time_s > 0 and report.peak_memory_bytes > 0
    assert "BP" in report.table()


def test_meta_model_does_not_run():
    prog, batch, _ = _meta_program("gpt")
    with pytest.raises(pt.PartitionError, match="the model lives on the meta device, so it cannot run"):
        prog.train_step(*batch)
    fwd, batch, _ = _meta_program("mlp", loss=False)
    assert fwd.collectives() and "BP" in fwd.summary()
    with pytest.raises(pt.PartitionError, match="meta device"):
        fwd(*batch[:-1])


def test_zero_that_shards_nothing_raises_with_the_sizes():
    """issue 20: zero(k) on an axis that divides no dim of any parameter was a silent no-op. Under strict=True (no
    uneven tiling; without it the dims are tiled unevenly, tests/test_uneven.py) it raises."""
    from examples.models import get

    spec = get("gpt_sdpa")                     # d=32, vocab 64, seq 16: no dim divides by 3
    model = spec.build()
    with pytest.raises(pt.PartitionError, match=r"axis 'batch' \(size 3\) divides no dim .* zero\(3\) would shard "
                                                r"nothing"):
        pt.partition(model, pt.Mesh({"batch": 3}), [pt.tactics.zero(3, "batch")], example_inputs=spec.batch(3),
                     loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                     options=pt.Options(strict=True))
