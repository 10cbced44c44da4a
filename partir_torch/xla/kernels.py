"""Ops of the captured graph that run differently on XLA tensors: one row per op, a short function each.

The captured step was traced on the CPU, so it holds CPU kernels that torch-xla has no lowering for (it would run
them on the host: the step splits into several XLA programs, and the collectives around them leave the HLO), and
a few kernels whose torch-xla version returns something else than eager torch.
"""
from __future__ import annotations

import math

import torch

from ..errors import PartitionError
from ..rules.registry import linked

aten = torch.ops.aten


def nll_loss_forward(x, target, weight, reduction, ignore_index):
    """torch-xla returns total_weight 1 unless reduction is mean; capture divides a sum by it (the mean)."""
    out, _ = aten.nll_loss_forward.default(x, target, weight, reduction, ignore_index)
    keep = (target != ignore_index).to(x.dtype)
    total = (keep * weight[target.clamp(min=0)]).sum() if weight is not None else keep.sum()
    return out, total


def _scores(q, k, is_causal, attn_mask, scale):
    """Scaled scores q k^T (B, H, L, S) with the causal (top-left) or given mask; K expanded for grouped heads."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    rep = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(rep, dim=-3) if rep > 1 else k
    s = torch.einsum("...ld,...sd->...ls", q, k) * scale
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return s, scale, rep


def sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """CPU flash attention (output, logsumexp) as batched dots and a softmax. Einsums keep (B, H) as two batch dims
    (a 4-d matmul would fold them into one, which XLA cannot reshape when both are tiled)."""
    if dropout_p:
        raise PartitionError("to_xla: attention dropout has no XLA form here; use dropout_p=0 for the XLA program")
    s, _, rep = _scores(q, k, is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, dim=-1)                              # (B, H, L)
    p = torch.exp(s - lse.unsqueeze(-1))
    v = v.repeat_interleave(rep, dim=-3) if rep > 1 else v
    return torch.einsum("...ls,...sd->...ld", p, v), lse


def sdpa_cpu_backward(grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """Gradients of sdpa_cpu from its saved output and logsumexp (the flash-attention backward, unfused)."""
    s, scale, rep = _scores(q, k, is_causal, attn_mask, scale)
    p = torch.exp(s - lse.unsqueeze(-1))                          # (B, H, L, S)
    ve = v.repeat_interleave(rep, dim=-3) if rep > 1 else v
    ke = k.repeat_interleave(rep, dim=-3) if rep > 1 else k
    dv = torch.einsum("...ls,...ld->...sd", p, grad_out)
    dp = torch.einsum("...ld,...sd->...ls", grad_out, ve)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    dq = torch.einsum("...ls,...sd->...ld", ds, ke) * scale
    dk = torch.einsum("...ls,...ld->...sd", ds, q) * scale
    if rep > 1:    # sum the expanded heads back onto their group's key/value head
        dk = dk.unflatten(-3, (k.shape[-3], rep)).sum(-3)
        dv = dv.unflatten(-3, (v.shape[-3], rep)).sum(-3)
    return dq, dk, dv


def layer_norm(x, normalized_shape, weight, bias, eps):
    """native_layer_norm as reductions over the normalised dims: torch-xla lowers it to XLA's batch-norm op on a
    (1, rows, features) view, which the SPMD partitioner gathers whole when the rows are tiled."""
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    mean = x.mean(dims, keepdim=True)
    rstd = torch.rsqrt((x - mean).square().mean(dims, keepdim=True) + eps)
    out = (x - mean) * rstd
    out = out * weight if weight is not None else out
    out = out + bias if bias is not None else out
    return out, mean, rstd


def layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """native_layer_norm_backward from the saved mean and 1/std (mean, rstd: input's leading dims, then ones)."""
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    lead = tuple(range(x.dim() - len(normalized_shape)))
    x_hat = (x - mean) * rstd
    g = grad_out * weight if weight is not None else grad_out
    dx = rstd * (g - g.mean(dims, keepdim=True) - x_hat * (g * x_hat).mean(dims, keepdim=True))
    dw = (grad_out * x_hat).sum(lead) if weight is not None and output_mask[1] else None
    db = grad_out.sum(lead) if bias is not None and output_mask[2] else None
    return dx if output_mask[0] else None, dw, db


def group_norm(x, weight, bias, N, C, HxW, group, eps):
    """native_group_norm as reductions per (sample, group): torch-xla lowers it to XLA's batch-norm op on a
    (1, N * groups, ...) view, which the SPMD partitioner gathers whole when the samples are tiled."""
    xg = x.reshape(N, group, -1)
    mean = xg.mean(-1)
    rstd = torch.rsqrt((xg - mean.unsqueeze(-1)).square().mean(-1) + eps)      # (N, G)
    out = ((xg - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(N, C, -1)
    out = out * weight.reshape(1, C, 1) if weight is not None else out
    out = out + bias.reshape(1, C, 1) if bias is not None else out
    return out.reshape(x.shape), mean, rstd


def group_norm_backward(grad_out, x, mean, rstd, weight, N, C, HxW, group, output_mask):
    """native_group_norm_backward from the saved per-(sample, group) mean and 1/std."""
    shape = x.shape
    xg = x.reshape(N, group, -1)                                  # (N, G, C/G * HxW)
    x_hat = (xg - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dy = grad_out.reshape(N, C, -1)                               # (N, C, HxW)
    g = dy * weight.reshape(1, C, 1) if weight is not None else dy
    g = g.reshape(N, group, -1)
    dx = rstd.unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dw = (dy * x_hat.reshape(N, C, -1)).sum((0, 2)) if weight is not None and output_mask[1] else None
    db = dy.sum((0, 2)) if output_mask[2] else None
    return dx.reshape(shape) if output_mask[0] else None, dw, db


def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    """Nearest 2-d upsampling's backward for whole scale factors: each input pixel sums its sh x sw copies."""
    (n, c, h, w), (oh, ow) = input_size, output_size
    if oh % h or ow % w:
        return aten.upsample_nearest2d_backward.default(grad_output, output_size, input_size, scales_h, scales_w)
    return grad_output.reshape(n, c, h, oh // h, w, ow // w).sum((3, 5))


def fill_tensor(x, value):
    """fill.Tensor: torch-xla reads the 0-d value on the host (a sync that splits the step into several XLA
    programs); as a broadcast it stays on the devices."""
    return value.to(x.dtype).expand(x.shape).clone()


# op -> its XLA form, for the ops whose registry row links a function here (rules/registry.py LINKS); view ops are
def _host(t):
    """A host tensor shaped like XLA tensor `t` (what a draw reads of it: shape and dtype)."""
    return torch.ones(t.shape, dtype=t.dtype)


def _on_host(kwargs) -> tuple:
    """kwargs with the device the capture traced with (the host), and the XLA device the draw goes to."""
    dev = kwargs.get("device")
    if dev is None or torch.device(dev).type != "xla":
        import torch_xla

        dev = torch_xla.device()
    return {**kwargs, "device": torch.device("cpu")}, dev


# Random draws run on the host from torch's generator and are sent to the devices whole (every rank draws the whole
# tensor, rules/pointwise.py): the masks one device draws. XLA's own generator would draw others.
def native_dropout(x, p, train):
    if train is not None and not train:
        return aten.native_dropout.default(x, p, train)
    _, keep = aten.native_dropout.default(_host(x), p, train)      # the host kernel's draw: eager dropout's
    keep = keep.to(x.device)
    return x * keep * (0.0 if p == 1 else 1.0 / (1.0 - p)), keep


def rand(size, **kwargs):
    kwargs, dev = _on_host(kwargs)
    return aten.rand.default(size, **kwargs).to(dev)


def randn(size, **kwargs):
    kwargs, dev = _on_host(kwargs)
    return aten.randn.default(size, **kwargs).to(dev)


def rand_like(x, **kwargs):
    kwargs, _ = _on_host(kwargs)
    return aten.rand_like.default(_host(x), **kwargs).to(x.device)


def randn_like(x, **kwargs):
    kwargs, _ = _on_host(kwargs)
    return aten.randn_like.default(_host(x), **kwargs).to(x.device)


def bernoulli_p(x, p=0.5, *, generator=None):
    return aten.bernoulli.p(_host(x), p, generator=generator).to(x.device)


# added by xla_target as they are met
OVERRIDES = linked("xla", "xla.kernels", globals())


def xla_target(target):
    """The op to run for `target` on XLA: its override, or for a view op its `_copy` form. torch-xla regenerates a
    view from its base when it is used, which can drop a sharding annotation placed on the view; the copy is a
    value of its own that keeps it (the captured graph is functional: nothing writes through views)."""
    if target in OVERRIDES:
        return OVERRIDES[target]
    if isinstance(target, torch._ops.OpOverload) and target.is_view and target.namespace == "aten":
        packet = getattr(aten, target._schema.name.split("::")[1] + "_copy", None)
        copy = getattr(packet, target._overloadname, None) if packet is not None else None
        if copy is not None:
            OVERRIDES[target] = copy
            return copy
    return target
