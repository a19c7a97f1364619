"""The Clover-2 training loss with its backward, computed cheaply, and the loss's settings.

:func:`clover_loss_backward` has the value of the official Clover-2 loss
(:func:`vllm_clover.model.drafter.clover_loss`), computed in a mathematically identical but
cheaper way: the LM-head products (which dominate the cost on CPU) are done only on
loss-masked rows, the target's soft labels are computed once per position and shared by all
heads (head i at position t and head 0 at position t+i have the same target h-bar), and the
vocabulary dimension is processed in row chunks so memory stays bounded. ``--train-vocab``
restricts both softmaxes to a token subset (:func:`batch_vocab`, docs/training.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from vllm_clover.training.baselines import loss_weights

if TYPE_CHECKING:
    from vllm_clover.training.args import TrainArgs

Tensor = torch.Tensor


# ============================================================================ the loss
def clover_loss_backward(outputs: Sequence[Tensor], target_hidden: Tensor, lm_head: Tensor,
                         loss_mask: Tensor, decay: float = 0.7, v_w: float = 10.0, p_w: float = 1.0,
                         vocab: Tensor | None = None, chunk_rows: int = 1024,
                         backward: bool = True, denoms: Sequence[float] | None = None
                         ) -> tuple[float, dict[str, Tensor]]:
    """Clover-2 loss (same value as :func:`vllm_clover.model.drafter.clover_loss`) + its backward.

    outputs: ``forward_train`` result, o_i [B, T-i, H]; target_hidden [B, T, H] float32
    (h-bar_{t+1} at t); lm_head [V, H] (its dtype sets the product dtype, bf16 for speed);
    loss_mask [B, T]. ``vocab`` (long [V']) restricts both softmaxes to a token subset
    (an approximation, see docs/training.md); None = full vocabulary = the exact loss.

    Why it is cheaper: a trained position u (loss_mask[b, u] = 1) is the target h-bar_{u+1}
    of head i at t = u - i for every i <= u, so the target soft labels are computed once per
    u and shared by all heads; LM-head products run only on those rows, ``chunk_rows`` at a
    time, each chunk's cross-entropy is back-propagated to a detached copy of o_i at once
    (freeing the [rows, V] tensors), and one final backward through
    ``sum_i (o_i * dL/do_i)`` + the regression terms finishes the graph.

    ``denoms`` (K floats) replaces each head's denominator sum(mask) + 1: data-parallel
    ranks pass the whole batch's (:func:`head_row_counts` summed over the ranks, + 1), so
    their losses on disjoint shares of a batch add up to the loss of the whole batch.

    Returns (loss value, metrics) with metrics as in ``clover_loss`` (``vloss``, ``ploss``,
    ``correct``, ``total``, ``acc``; tensors [K]). With ``backward=False`` no gradient is
    computed (evaluation).
    """
    k = len(outputs)
    weight = lm_head if vocab is None else lm_head[vocab]
    bu, uu = (loss_mask > 0).nonzero(as_tuple=True)  # trained positions, sorted by (b, u)
    tgt_rows = target_hidden[bu, uu]  # [n, H]
    heads, vloss_total, vlosses = _regression_terms(outputs, tgt_rows, bu, uu, decay, v_w, backward, denoms)
    plosses, correct = _soft_label_cross_entropy(heads, tgt_rows, weight, chunk_rows, backward)
    if backward:
        _backward_through_heads(heads, vloss_total, decay, p_w)
    loss = float(vloss_total.detach()) + sum(decay ** i * p_w * plosses[i] for i in range(k))
    total = torch.tensor([len(h.idx) for h in heads], dtype=torch.float32)
    correct_t = torch.tensor(correct, dtype=torch.float32)
    metrics = {"vloss": torch.stack(vlosses), "ploss": torch.tensor(plosses), "correct": correct_t,
               "total": total, "acc": correct_t / total.clamp(min=1.0)}
    return loss, metrics


@dataclass
class _HeadRows:
    """Head i's share of the trained positions u (those with u >= i)."""

    idx: Tensor  # long [n_i]: indices into the trained positions, ascending
    rows: Tensor  # [n_i, H] float32: o_i at (b, u - i), in the autograd graph
    leaf: Tensor  # [n_i, H]: detached copy of ``rows``; collects dL/d rows chunk by chunk
    denom: float  # official: sum(mask) + 1


def _regression_terms(outputs: Sequence[Tensor], tgt_rows: Tensor, bu: Tensor, uu: Tensor, decay: float,
                      v_w: float, backward: bool, denoms: Sequence[float] | None = None
                      ) -> tuple[list[_HeadRows], Tensor, list[Tensor]]:
    """Each head's trained rows and SmoothL1 regression term; returns (heads, the weighted
    sum of the terms [] (in the graph), each head's unweighted term [] detached)."""
    heads: list[_HeadRows] = []
    vloss_total = tgt_rows.new_zeros(())
    vlosses = []
    for i, o in enumerate(outputs):
        idx = (uu >= i).nonzero(as_tuple=True)[0]  # indices into the trained rows
        rows = o[bu[idx], uu[idx] - i].float()  # [n_i, H]
        denom = float(len(idx)) + 1.0 if denoms is None else float(denoms[i])  # official: sum(mask) + 1
        vloss = F.smooth_l1_loss(rows, tgt_rows[idx], reduction="none").mean(-1).sum() / denom
        vloss_total = vloss_total + decay ** i * v_w * vloss
        vlosses.append(vloss.detach())
        heads.append(_HeadRows(idx, rows, rows.detach().requires_grad_(backward), denom))
    return heads, vloss_total, vlosses


def _soft_label_cross_entropy(heads: list[_HeadRows], tgt_rows: Tensor, weight: Tensor, chunk_rows: int,
                              backward: bool) -> tuple[list[float], list[int]]:
    """Each head's cross-entropy against the target's soft labels, ``chunk_rows`` trained rows
    at a time; with ``backward``, each chunk's gradient lands in the heads' ``leaf.grad``.
    Returns (unweighted cross-entropy per head, top-1 hits per head)."""
    k = len(heads)
    plosses = [0.0] * k
    correct = [0] * k
    n = len(tgt_rows)
    for r0 in range(0, n, chunk_rows):
        r1 = min(r0 + chunk_rows, n)
        with torch.no_grad():
            t_logits = F.linear(tgt_rows[r0:r1].to(weight.dtype), weight).float()
            t_prob = torch.softmax(t_logits, dim=-1)
            t_arg = t_logits.argmax(-1)
            del t_logits
        for i, head in enumerate(heads):
            idx = head.idx
            lo, hi = (int(v) for v in torch.searchsorted(idx, torch.tensor([r0, r1], device=idx.device)))
            if hi <= lo:
                continue
            sel = idx[lo:hi] - r0
            with torch.set_grad_enabled(backward):
                logits = F.linear(head.leaf[lo:hi].to(weight.dtype), weight).float()
                ce = -(t_prob[sel] * torch.log_softmax(logits, dim=-1)).sum() / head.denom
                if backward:
                    ce.backward()
            plosses[i] += float(ce.detach())
            correct[i] += int((logits.detach().argmax(-1) == t_arg[sel]).sum())
            del logits, ce
    return plosses, correct


def _backward_through_heads(heads: list[_HeadRows], vloss_total: Tensor, decay: float, p_w: float) -> None:
    """One backward through ``sum_i decay^i p_w (o_i * dL/do_i)`` + the regression terms."""
    surrogate = vloss_total
    for i, head in enumerate(heads):
        if head.leaf.grad is not None:
            surrogate = surrogate + decay ** i * p_w * (head.rows * head.leaf.grad).sum()
    if surrogate.requires_grad:
        surrogate.backward()


def head_row_counts(loss_mask: Tensor, k: int) -> Tensor:
    """Trained rows of each of ``k`` heads in a batch, float64 [k]: head i trains at the
    positions u >= i with loss_mask [B, T] set (the rows :func:`clover_loss_backward` uses)."""
    uu = (loss_mask > 0).nonzero(as_tuple=True)[1]
    return torch.stack([(uu >= i).sum() for i in range(k)]).to(torch.float64)


def loss_chunk_rows(device: torch.device) -> int:
    """Rows per LM-head chunk in :func:`clover_loss_backward`: small on CPU (bounded memory,
    no speed cost), large on a GPU where each chunk's kernel launches and syncs dominate."""
    return 1024 if device.type == "cpu" else 16384


def loss_settings(args: "TrainArgs") -> tuple[float, float, float]:
    """(decay, v_w, p_w): Clover's from the arguments, the baselines' fixed (baselines.LOSS_WEIGHTS)."""
    return (args.decay, args.v_w, args.p_w) if args.method == "clover" else loss_weights(args.method)


# ============================================================================ vocabulary subset
def frequent_vocab(dataset, size: int, vocab_size: int) -> Tensor:
    """The first ``size`` ids of the dataset's draft-vocabulary ranking (long [size], sorted):
    its most frequent response tokens (``dataset.token_ranking``)."""
    return torch.sort(dataset.token_ranking(vocab_size)[:size]).values


@torch.no_grad()
def batch_vocab(base: Tensor, target_hidden: Tensor, loss_mask: Tensor, input_ids: Tensor,
                lm_head: Tensor, topk: int = 32, chunk_rows: int = 2048) -> Tensor:
    """Token subset for one batch's loss (``--train-vocab``): sorted unique long [V'].

    The union of ``base`` (the most frequent response tokens), every token of the batch
    (``input_ids`` [B, T]: a small model copies names and code from its prompt) and the
    target's ``topk`` tokens at each trained position (target_hidden [B, T, H] rows where
    loss_mask [B, T] is set), so the target's greedy token, and nearly all of its
    probability mass, is always inside the subset. One full-vocabulary product per trained
    row (shared by all heads) instead of eleven.
    """
    rows = target_hidden[loss_mask > 0]
    tops = [F.linear(rows[r:r + chunk_rows].to(lm_head.dtype), lm_head).topk(topk, dim=-1).indices.flatten()
            for r in range(0, len(rows), chunk_rows)]
    return torch.unique(torch.cat([base, input_ids.flatten(), *tops]))
