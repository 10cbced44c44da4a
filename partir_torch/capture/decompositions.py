"""The op set: ATen as dispatched after autograd, functionalised (no in-place ops, no core-aten decompositions),
plus these few decompositions, chosen so that tiling falls out of the rules instead of special cases:

- addmm -> mm + add: with the contracted dim tiled, the product is partial(sum) and the bias is added once, after
  the reduction (as Megatron's row-parallel linear does), instead of once per rank.
- convolution with a bias -> convolution + add, for the same reason (input channels tiled -> partial(sum)).
- mean -> sum / N: sum over a tiled dim is partial(sum); the constant N is the global count, so no correction.
- mse_loss and its backward -> elementwise ops and a sum, with the global element count as a constant.
- nll_loss_forward(reduction=mean) -> nll_loss_forward(sum) / total_weight: both partial under data parallelism,
  reduced before the division, which stays exact with ignore_index and class weights.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _mean_dim(x, dim=None, keepdim=False, dtype=None):
    dims = range(x.dim()) if dim is None or len(dim) == 0 else [d % max(x.dim(), 1) for d in dim]
    n = math.prod(x.shape[d] for d in dims)
    s = aten.sum.dim_IntList(x, list(dims), keepdim, dtype=dtype)
    return aten.div.Scalar(s, n)


def _mean(x, dtype=None):
    return aten.div.Scalar(aten.sum.default(x, dtype=dtype), x.numel())


def _nll_loss_forward(self, target, weight, reduction, ignore_index):
    if reduction != 1:
        return NotImplemented
    out, total = aten.nll_loss_forward.default(self, target, weight, 2, ignore_index)
    return aten.div.Tensor(out, total), total


def _mse_loss(x, target, reduction=1):
    sq = aten.pow.Tensor_Scalar(aten.sub.Tensor(x, target), 2)
    if reduction == 0:
        return sq
    s = aten.sum.default(sq)
    return s if reduction == 2 else aten.div.Scalar(s, sq.numel())


def _mse_loss_backward(grad, x, target, reduction):
    scale = 2.0 / x.numel() if reduction == 1 else 2.0
    return aten.mul.Tensor(aten.mul.Scalar(aten.sub.Tensor(x, target), scale), grad)


def _addmm(bias, m1, m2, beta=1, alpha=1):
    out = aten.mm.default(m1, m2)
    if alpha != 1:
        out = aten.mul.Scalar(out, alpha)
    if beta != 1:
        bias = aten.mul.Scalar(bias, beta)
    return aten.add.Tensor(out, bias)


def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    if bias is None:
        return NotImplemented
    out = aten.convolution.default(x, w, None, stride, padding, dilation, transposed, output_padding, groups)
    return aten.add.Tensor(out, aten.view.default(bias, [1, -1] + [1] * (out.dim() - 2)))


def capture_decompositions() -> dict:
    return {
        aten.mean.dim: _mean_dim,
        aten.mean.default: _mean,
        aten.nll_loss_forward.default: _nll_loss_forward,
        aten.addmm.default: _addmm,
        aten.convolution.default: _convolution,
        aten.mse_loss.default: _mse_loss,
        aten.mse_loss_backward.default: _mse_loss_backward,
    }


def _log_softmax(x, dim, half_to_float=False):
    """x - max - log(sum(exp(x - max))): over a tiled dim, amax is partial(max) and sum partial(sum), each
    reduced by one scalar-per-row all_reduce (Megatron's vocabulary-parallel cross-entropy)."""
    m = aten.amax.default(x, [dim], True)
    shifted = aten.sub.Tensor(x, m)
    lse = aten.log.default(aten.sum.dim_IntList(aten.exp.default(shifted), [dim], True))
    return aten.sub.Tensor(shifted, lse)


def _log_softmax_backward_data(grad, out, dim, input_dtype):
    s = aten.sum.dim_IntList(grad, [dim], True)
    return aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), s))


def softmax_decompositions() -> dict:
    """Used when a tactic tiles a softmax dim (vocabulary parallelism): log_softmax as reductions the rules tile."""
    return {aten._log_softmax.default: _log_softmax,
            aten._log_softmax_backward_data.default: _log_softmax_backward_data}
