"""CTC at static shapes (issue 26): the loss of Hugging Face's CTC heads (Wav2Vec2ForCTC and its kin) traced as a
fixed recursion over the frames.

`F.ctc_loss` with tensor lengths has outputs whose sizes are data (aten's `log_alpha` is sized by the longest
target), which fake tensors cannot trace; HF feeds it `labels.masked_select(labels != -100)`, a selection whose
count changes with every batch. counts.py traces that selection padded (all B x S label positions); its rule for
`ctc_loss` (`padrules.Rules._ctc`) calls `ctc_loss_static` here with the targets back in their (B, S) rows, each
row's labels moved to its front in order (a stable sort of the mask), and the user's target lengths (checked to be
the mask's row counts, which the concatenated form then equals).

The recursion is the CTC forward algorithm in log space (Graves et al. 2006), as aten's CPU kernel computes it:
the extended target (blank, l1, blank, l2, ..., blank) of 2S + 1 states, alpha over the frames, a state reachable
from itself, the state before it, and the one two before when that is a label other than the label two before;
frames beyond a sample's input length leave its alpha as it is. Autograd differentiates it: the gradient is the
analytic one (alpha-beta), computed in another order, equal within rounding. Unreachable states hold a large
negative number instead of -inf (-inf minus -inf would be NaN in logsumexp's backward); a loss that is not
finite in eager (an input shorter than its target) is therefore +inf here only by the final check, and
`zero_infinity` zeroes it as eager does. The program grows with the frames: about 12 ops per frame.
"""
from __future__ import annotations

import torch

_UNREACHABLE = -1e30


def ctc_loss_static(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
                    zero_infinity=False):
    """log_probs (T, B, C) (or (T, C)), targets (B, S) with each row's labels first, lengths (B,): as F.ctc_loss."""
    if log_probs.dim() == 2:
        return ctc_loss_static(log_probs[:, None], targets[None], input_lengths.reshape(1),
                               target_lengths.reshape(1), blank, reduction, zero_infinity)[0] \
            if reduction == "none" else ctc_loss_static(log_probs[:, None], targets[None], input_lengths.reshape(1),
                                                        target_lengths.reshape(1), blank, reduction, zero_infinity)
    T, B, _ = log_probs.shape
    S = targets.shape[1]
    ext = torch.full((B, 2 * S + 1), blank, dtype=torch.long, device=targets.device)
    ext[:, 1::2] = targets.long().clamp(min=0)
    skip = torch.zeros_like(ext, dtype=torch.bool)
    skip[:, 2:] = (ext[:, 2:] != blank) & (ext[:, 2:] != ext[:, :-2])
    lp = log_probs.gather(2, ext[None].expand(T, B, 2 * S + 1))           # (T, B, 2S + 1)
    none = torch.full((B, 1), _UNREACHABLE, dtype=lp.dtype, device=lp.device)
    state = torch.arange(2 * S + 1, device=lp.device)[None]
    alpha = torch.where(state < 2, lp[0], torch.full_like(lp[0], _UNREACHABLE))
    alpha = torch.where((state == 1) & (target_lengths[:, None] == 0), _UNREACHABLE, alpha)
    live = input_lengths[:, None]
    for t in range(1, T):
        one = torch.cat([none, alpha[:, :-1]], 1)
        two = torch.where(skip, torch.cat([none, none, alpha[:, :-2]], 1), _UNREACHABLE)
        step = torch.logsumexp(torch.stack([alpha, one, two]), 0) + lp[t]
        alpha = torch.where(t < live, step, alpha)
    last = (2 * target_lengths.long())[:, None]                            # the final blank; the last label before it
    ends = torch.cat([alpha.gather(1, last), torch.where(last > 0, alpha.gather(1, (last - 1).clamp(min=0)),
                                                         _UNREACHABLE)], 1)
    loss = -torch.logsumexp(ends, 1)
    loss = torch.where(loss > -_UNREACHABLE / 2, torch.inf, loss)
    if zero_infinity:
        loss = torch.where(torch.isinf(loss), torch.zeros_like(loss), loss)
    if reduction == "mean":
        return (loss / target_lengths.clamp(min=1).to(loss.dtype)).mean()
    if reduction == "sum":
        return loss.sum()
    return loss
