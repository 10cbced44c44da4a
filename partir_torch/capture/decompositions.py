"""The op set: ATen as dispatched after autograd, functionalised (no in-place ops, no core-aten decompositions),
plus these few decompositions, chosen so that tiling falls out of the rules instead of special cases:

- addmm -> mm + add: with the contracted dim tiled, the product is partial(sum) and the bias is added once, after
  the reduction (as Megatron's row-parallel linear does), instead of once per rank.
- convolution with a bias -> convolution + add, for the same reason (input channels tiled -> partial(sum)).
- mean -> sum / N: sum over a tiled dim is partial(sum); the constant N is the global count, so no correction.
- mse_loss and its backward -> elementwise ops and a sum, with the global element count as a constant.
- nll_loss_forward(reduction=mean) -> nll_loss_forward(sum) / total_weight: both partial under data parallelism,
  reduced before the division, which stays exact with ignore_index and class weights.
- batch norm (every forward variant) and its backward -> per-channel sums (the forward: the mean, then the centred
  second moment; the backward: dy and dy * (x - mean) stacked into one (2, C) tensor): with
  the batch tiled, that tensor is partial(sum) and one all_reduce per norm and pass gives the global statistics
  (SyncBatchNorm's semantics, without gathering the activations). Instance norm reaches batch norm with (N*C)
  channels, so its statistics stay local.
- var / std (and their _mean forms) -> two passes of sums: over a tiled dim, the mean and then the sum of squared
  deviations are partial(sum), each completed by one all_reduce of the reduced shape (exact, where one pass of
  sum and sum of squares would cancel), instead of gathering the operand.
- mkldnn_rnn_layer (an LSTM layer on CPU, one opaque kernel) and its backward -> matmuls over all time steps and
  per-step cell updates (the backward recomputes the gates and runs backpropagation through time), so the batch
  dim is an ordinary pass-through factor, as in GRU / RNN, which trace to such ops already.
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


# ---- variance ----------------------------------------------------------------------------------------------------
def _moments(x, dim, correction, keepdim):
    """(var, mean) over `dim` (all dims when None or empty) in two passes of sums, in fp32 for half inputs."""
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else [d % max(x.dim(), 1) for d in dim]
    n = math.prod(x.shape[d] for d in dims)
    xa = x.to(_acc_dtype(x.dtype))
    mean = aten.div.Scalar(aten.sum.dim_IntList(xa, dims, True), n)
    d = aten.sub.Tensor(xa, mean)
    corr = 1 if correction is None else correction
    var = aten.div.Scalar(aten.sum.dim_IntList(aten.mul.Tensor(d, d), dims, keepdim), max(n - corr, 0))
    return var, (mean if keepdim else aten.squeeze.dims(mean, dims))


def _var(x, dim=None, *, correction=None, keepdim=False):
    return _moments(x, dim, correction, keepdim)[0].to(x.dtype)


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _moments(x, dim, correction, keepdim)
    return var.to(x.dtype), mean.to(x.dtype)


def _std(x, dim=None, *, correction=None, keepdim=False):
    return aten.sqrt.default(_moments(x, dim, correction, keepdim)[0]).to(x.dtype)


def _std_mean(x, dim=None, *, correction=None, keepdim=False):
    var, mean = _moments(x, dim, correction, keepdim)
    return aten.sqrt.default(var).to(x.dtype), mean.to(x.dtype)


# ---- batch norm ------------------------------------------------------------------------------------------------
def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _per_channel(t, ndim):
    return aten.view.default(t, [1, -1] + [1] * (ndim - 2))   # (C,) -> (1, C, 1, ...)


def _stat_dtype(x):
    """Batch norm's sums accumulate as eager's kernels do: in double on CPU (at::acc_type<float, /*cuda=*/false>),
    in float on GPUs. The backward's dx is a difference of nearly equal terms wherever the next layer is
    insensitive to this one's scale, and fp32 sums there move it by tens of percent."""
    return torch.float64 if x.device.type == "cpu" and x.dtype == torch.float32 else x.dtype


def _stacked_sums(a, b, dims, n):
    """(sum(a) / n, sum(b) / n) over `dims`, through one (2, C) tensor: with the batch tiled both sums are
    partial(sum), and since the stacked tensor has two consumers it is all-reduced once, where it is made."""
    acc = _stat_dtype(a)
    s = aten.cat.default([aten.unsqueeze.default(aten.sum.dim_IntList(a, dims, dtype=acc), 0),
                          aten.unsqueeze.default(aten.sum.dim_IntList(b, dims, dtype=acc), 0)])
    s = aten.div.Scalar(s, n).to(a.dtype)
    return aten.select.int(s, 0, 0), aten.select.int(s, 0, 1)


def _bn_train(x, weight, bias, running_mean, running_var, momentum, eps):
    """Training-mode batch norm from one (2, C) tensor of per-channel moments (E[x], E[x^2]): with the batch tiled
    it is partial(sum), all-reduced once per norm (the count is static: the sums are divided by the global count).
    The sums are taken in float64 on every device: the one-pass E[x^2] - E[x]^2 in fp32 loses the variance to
    cancellation when the mean is large against the spread (6e-4 relative at mean 60x the spread); in float64 it
    keeps eager's two-pass precision.
    Returns (out, save_mean, save_rstd, new_running_mean, new_running_var)."""
    red = [0] + list(range(2, x.dim()))
    n = x.numel() // x.shape[1]
    xa = x.to(_acc_dtype(x.dtype))
    acc = _stat_dtype(xa)
    x64 = xa.to(torch.float64)
    moments = aten.div.Scalar(aten.cat.default([aten.unsqueeze.default(aten.sum.dim_IntList(x64, red), 0),
                                                aten.unsqueeze.default(
                                                    aten.sum.dim_IntList(aten.mul.Tensor(x64, x64), red), 0)]), n)
    m64 = aten.select.int(moments, 0, 0)                                                  # (C,) E[x]
    var = aten.clamp_min.default(aten.sub.Tensor(aten.select.int(moments, 0, 1), aten.mul.Tensor(m64, m64)), 0)
    mean, var = m64.to(acc), var.to(acc)
    # the output centred and scaled in the accumulation dtype before the cast, as eager's CPU kernel: a channel
    # whose spread is small against its mean (late layers at 1x1 resolution) loses its variance if the mean is
    # rounded first (spread 0.01 at mean 3, batch 8: out 4e-7 off float64, eager's fp32 x * alpha + beta 1e-4)
    xc = aten.sub.Tensor(xa.to(acc), _per_channel(mean, x.dim()))                        # (N, C, *) in acc
    rstd = aten.rsqrt.default(aten.add.Scalar(var, eps))
    out = _affine(aten.mul.Tensor(xc, _per_channel(rstd, x.dim())).to(xa.dtype), weight, bias)
    new_mean = new_var = None
    if running_mean is not None:
        new_mean = aten.add.Tensor(aten.mul.Scalar(mean, momentum), aten.mul.Scalar(running_mean, 1 - momentum))
    if running_var is not None:
        unbiased = aten.mul.Scalar(var, n / max(n - 1, 1))
        new_var = aten.add.Tensor(aten.mul.Scalar(unbiased, momentum), aten.mul.Scalar(running_var, 1 - momentum))
    save_dtype = x.dtype if x.device.type == "cpu" else xa.dtype      # as eager (CPU keeps the input's dtype)
    mean = mean.to(xa.dtype)
    return (out.to(x.dtype), mean.to(save_dtype), rstd.to(save_dtype),
            None if new_mean is None else new_mean.to(running_mean.dtype),
            None if new_var is None else new_var.to(running_var.dtype))


def _affine(out, weight, bias):
    if weight is not None:
        out = aten.mul.Tensor(out, _per_channel(weight, out.dim()))
    if bias is not None:
        out = aten.add.Tensor(out, _per_channel(bias, out.dim()))
    return out


def _bn_eval(x, weight, bias, running_mean, running_var, eps):
    """Inference batch norm: per-channel pointwise ops with the running statistics (no statistics to reduce)."""
    xa = x.to(_acc_dtype(x.dtype))
    rstd = aten.rsqrt.default(aten.add.Scalar(running_var.to(xa.dtype), eps))
    out = aten.mul.Tensor(aten.sub.Tensor(xa, _per_channel(running_mean.to(xa.dtype), x.dim())),
                          _per_channel(rstd, x.dim()))
    empty = x.new_zeros((0,)) if x.device.type == "cpu" else None
    return (_affine(out, weight, bias).to(x.dtype), running_mean if empty is None else empty,
            rstd if empty is None else empty)


def _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return _bn_eval(x, weight, bias, running_mean, running_var, eps)
    return _bn_train(x, weight, bias, running_mean, running_var, momentum, eps)[:3]


def _bn_legit_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        out, m, r = _bn_eval(x, weight, bias, running_mean, running_var, eps)
        return out, m, r, running_mean, running_var
    return _bn_train(x, weight, bias, running_mean, running_var, momentum, eps)


def _bn_legit_no_stats(x, weight, bias, training, momentum, eps):
    return _bn_train(x, weight, bias, None, None, momentum, eps)[:3]


def _bn_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    return _bn_eval(x, weight, bias, running_mean, running_var, eps)


def _bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    """Training: dx needs the global sums of dy and dy * (x - mean), taken as one stacked (2, C) tensor (one
    all_reduce with the batch tiled); the weight and bias gradients are those same sums, already reduced.
    Inference, or no dx wanted: the two sums are the (partial) weight and bias gradients."""
    acc = _acc_dtype(x.dtype)
    dy, xa = grad_out.to(acc), x.to(acc)
    red = [0] + list(range(2, x.dim()))
    n = x.numel() // x.shape[1]
    if train:
        mean, invstd = save_mean.to(acc), save_invstd.to(acc)
    else:
        mean = running_mean.to(acc)
        invstd = aten.rsqrt.default(aten.add.Scalar(running_var.to(acc), eps))
    xc = aten.sub.Tensor(xa, _per_channel(mean, x.dim()))                     # (N, C, *)
    dyxc = aten.mul.Tensor(dy, xc)
    if train and output_mask[0]:
        gmean, dmean = _stacked_sums(dy, dyxc, red, n)                         # E[dy], E[dy (x - mean)]
        gsum, dot = aten.mul.Scalar(gmean, n), aten.mul.Scalar(dmean, n)
        proj = aten.mul.Tensor(xc, _per_channel(aten.mul.Tensor(dmean, aten.mul.Tensor(invstd, invstd)), x.dim()))
        dx = aten.sub.Tensor(aten.sub.Tensor(dy, proj), _per_channel(gmean, x.dim()))
    else:
        acc64 = _stat_dtype(dy)
        gsum = aten.sum.dim_IntList(dy, red, dtype=acc64).to(dy.dtype)
        dot = aten.sum.dim_IntList(dyxc, red, dtype=acc64).to(dy.dtype)
        dx = dy
    scale = invstd if weight is None else aten.mul.Tensor(invstd, weight.to(acc))
    grad_input = aten.mul.Tensor(dx, _per_channel(scale, x.dim())).to(x.dtype) if output_mask[0] else None
    wdtype = x.dtype if weight is None else weight.dtype
    grad_weight = aten.mul.Tensor(dot, invstd).to(wdtype) if output_mask[1] else None
    grad_bias = gsum.to(wdtype) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


# ---- LSTM layer (CPU's mkldnn kernel) ---------------------------------------------------------------------------
_LSTM = 2      # mkldnn_rnn_layer's mode for LSTM (ideep::rnn_kind::LSTM)


def _flat_mm(x, w):
    """(T, B, K) @ w.T -> (T, B, N): one matmul over all steps."""
    t, b, k = x.shape
    return aten.view.default(aten.mm.default(aten.view.default(x, [t * b, k]), aten.t.default(w)), [t, b, -1])


def _state(t):
    """An initial / final state as the kernel gets it, (B, H) or (1, B, H), as (B, H)."""
    return t if t.dim() == 2 else aten.select.int(t, 0, 0)


def _like_state(t, ref):
    return t if ref.dim() == 2 else aten.unsqueeze.default(t, 0)


def _lstm_input_gates(x, w_ih, b_ih, b_hh, has_biases):
    g = _flat_mm(x, w_ih)                                                     # (T, B, 4H)
    return aten.add.Tensor(g, aten.add.Tensor(b_ih, b_hh)) if has_biases else g


def _lstm_cell(gates, c, hidden):
    """gates (B, 4H) in PyTorch's (input, forget, cell, output) order -> (h, c, activated gates)."""
    i, f, g, o = aten.split.Tensor(gates, hidden, 1)
    i, f, g, o = aten.sigmoid.default(i), aten.sigmoid.default(f), aten.tanh.default(g), aten.sigmoid.default(o)
    c = aten.add.Tensor(aten.mul.Tensor(f, c), aten.mul.Tensor(i, g))
    return aten.mul.Tensor(o, aten.tanh.default(c)), c, (i, f, g, o)


def _mkldnn_lstm_layer(x, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
                       has_biases, bidirectional, batch_first, train):
    """One direction of one LSTM layer: x (T, B, I) -> (y (T, B, H), hy, cy, workspace (unused)). `reverse` runs it
    backwards in time. The kernel is always called time-major: batch_first and bidirectional only describe the
    module it serves (measured: the kernel's result does not depend on them)."""
    if mode != _LSTM or batch_sizes:
        return NotImplemented
    gx = _lstm_input_gates(x, w_ih, b_ih, b_hh, has_biases)                   # (T, B, 4H)
    h, c = _state(hx), _state(cx)                                             # (B, H)
    n = x.shape[0]
    out = [None] * n
    for t in (range(n - 1, -1, -1) if reverse else range(n)):
        gates = aten.add.Tensor(aten.select.int(gx, 0, t), aten.mm.default(h, aten.t.default(w_hh)))
        h, c, _ = _lstm_cell(gates, c, hidden_size)
        out[t] = h
    workspace = aten.empty.memory_format([0], dtype=torch.uint8, device=x.device)
    return aten.stack.default(out), _like_state(h, hx), _like_state(c, cx), workspace


def _mkldnn_lstm_layer_backward(x, w_ih, w_hh, b_ih, b_hh, hx, cx, y, hy, cy, grad_y, grad_hy, grad_cy, reverse,
                                mode, hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes,
                                batch_first, workspace):
    """Backpropagation through time for _mkldnn_lstm_layer: the gates are recomputed from x and the previous hidden
    states (y shifted by one step), the cell states by the elementwise recurrence; then one backward sweep, and the
    weight gradients as matmuls over all steps (partial(sum) when the batch is tiled)."""
    if mode != _LSTM or batch_sizes:
        return NotImplemented
    n, hid = x.shape[0], hidden_size
    order = list(range(n - 1, -1, -1)) if reverse else list(range(n))
    h_prev = [_state(hx) if k == 0 else aten.select.int(y, 0, order[k - 1]) for k in range(n)]  # per step taken
    gx = _lstm_input_gates(x, w_ih, b_ih, b_hh, has_biases)
    c, cs, acts = _state(cx), [], []
    for k, t in enumerate(order):
        gates = aten.add.Tensor(aten.select.int(gx, 0, t), aten.mm.default(h_prev[k], aten.t.default(w_hh)))
        _, c_new, a = _lstm_cell(gates, c, hid)
        cs.append((c, c_new))
        acts.append(a)
        c = c_new
    dh = aten.zeros_like.default(h_prev[0]) if grad_hy is None else _state(grad_hy)
    dc = aten.zeros_like.default(c) if grad_cy is None else _state(grad_cy)
    dgates = [None] * n
    for k in range(n - 1, -1, -1):
        t = order[k]
        i, f, g, o = acts[k]
        c_prev, c_t = cs[k]
        if grad_y is not None:
            dh = aten.add.Tensor(dh, aten.select.int(grad_y, 0, t))
        tc = aten.tanh.default(c_t)
        do = aten.mul.Tensor(dh, tc)
        dc = aten.add.Tensor(dc, aten.tanh_backward.default(aten.mul.Tensor(dh, o), tc))
        di, dg, df = aten.mul.Tensor(dc, g), aten.mul.Tensor(dc, i), aten.mul.Tensor(dc, c_prev)
        dgates[t] = aten.cat.default([aten.sigmoid_backward.default(di, i), aten.sigmoid_backward.default(df, f),
                                      aten.tanh_backward.default(dg, g), aten.sigmoid_backward.default(do, o)], 1)
        dc = aten.mul.Tensor(dc, f)
        dh = aten.mm.default(dgates[t], w_hh)                                 # (B, H)
    dgx = aten.stack.default(dgates)                                          # (T, B, 4H), time order
    hp = aten.stack.default([h_prev[order.index(t)] for t in range(n)])       # (T, B, H), time order
    flat = aten.view.default(dgx, [-1, 4 * hid])
    d_x = _flat_mm(dgx, aten.t.default(w_ih))
    d_w_ih = aten.mm.default(aten.t.default(flat), aten.view.default(x, [-1, x.shape[2]]))
    d_w_hh = aten.mm.default(aten.t.default(flat), aten.view.default(hp, [-1, hid]))
    d_b = aten.sum.dim_IntList(dgx, [0, 1])
    return d_x, d_w_ih, d_w_hh, d_b, d_b, _like_state(dh, hx), _like_state(dc, cx)


def capture_decompositions() -> dict:
    from torch._decomp import decomposition_table as _torch_decomp

    return {
        aten.var.correction: _var, aten.var_mean.correction: _var_mean,
        aten.std.correction: _std, aten.std_mean.correction: _std_mean,
        aten.mkldnn_rnn_layer.default: _mkldnn_lstm_layer,
        aten.mkldnn_rnn_layer_backward.default: _mkldnn_lstm_layer_backward,
        aten.native_batch_norm.default: _native_batch_norm,
        aten._native_batch_norm_legit_functional.default: _bn_legit_functional,
        aten._native_batch_norm_legit.no_stats: _bn_legit_no_stats,
        aten._native_batch_norm_legit_no_training.default: _bn_legit_no_training,
        aten.native_batch_norm_backward.default: _bn_backward,
        aten.mean.dim: _mean_dim,
        aten.mean.default: _mean,
        aten.nll_loss_forward.default: _nll_loss_forward,
        aten.addmm.default: _addmm,
        aten.convolution.default: _convolution,
        aten.mse_loss.default: _mse_loss,
        aten.mse_loss_backward.default: _mse_loss_backward,
        # pointwise in math, not in their signature (a CPU-only buffer result; a weight broadcast by shape):
        # torch's own decompositions into pointwise ops that have rules
        **{op: _torch_decomp[op] for op in (aten.log_sigmoid_forward.default, aten.log_sigmoid_backward.default,
                                            aten._prelu_kernel.default, aten._prelu_kernel_backward.default)},
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
