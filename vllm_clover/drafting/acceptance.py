"""Acceptance over a drafted token tree, and the KV moves that make the accepted path contiguous.

Pure PyTorch, no vLLM import; the conventions (node order, buffers, padding) are those of
vllm_clover/drafting/tree.py, which re-exports every public name here. The rules, as in
SpecInfer / EAGLE:
  greedy    the longest root-to-node path whose every token is the target's argmax at its parent;
  sampled   walk from the root; accept a child x with prob min(1, p(x) / q(x)), else try its next
            sibling against the residual norm(max(0, p - q)); the bonus token comes from what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_clover.drafting.tree import TreeBuffers

Tensor = torch.Tensor


# ============================================================================ acceptance
@dataclass
class AcceptResult:
    """Per request, B rows; D = max depth of the tree.

    accepted_nodes  [B, D+1] long: node indices of the accepted path, root (0) first, -1 pad
    num_accepted    [B] long: accepted draft tokens (root excluded), 0..D
    bonus           [B] long: the token the target emits after the path (argmax / sample)
    output_tokens   [B, D+1] long: accepted draft tokens then the bonus, -1 padded; exactly
                    ``num_accepted + 1`` entries (the vLLM sampler-output row)
    """

    accepted_nodes: Tensor
    num_accepted: Tensor
    bonus: Tensor
    output_tokens: Tensor


def _path_to_nodes(ancestor_row: Tensor, depth: Tensor, max_depth: int) -> Tensor:
    """ancestor_row [B, N+1] bool (a node's ancestors + itself), depth [B, N+1] -> [B, D+1]."""
    b, n1 = ancestor_row.shape
    out = torch.full((b, max_depth + 2), -1, dtype=torch.long, device=depth.device)
    col = torch.where(ancestor_row, depth, torch.full_like(depth, max_depth + 1))
    # Non-ancestors all land in the spare last column, which is then dropped.
    out.scatter_(1, col, torch.arange(n1, device=depth.device).expand(b, -1).contiguous())
    return out[:, : max_depth + 1]


def _finish(tokens: Tensor, accepted: Tensor, num_acc: Tensor, bonus: Tensor) -> AcceptResult:
    b, w = accepted.shape
    out = torch.full((b, w), -1, dtype=torch.long, device=tokens.device)
    drafts = accepted[:, 1:]
    out[:, : w - 1] = torch.where(drafts >= 0, tokens.gather(1, drafts.clamp(min=0)), -1)
    out.scatter_(1, num_acc[:, None], bonus[:, None])
    return AcceptResult(accepted_nodes=accepted, num_accepted=num_acc, bonus=bonus, output_tokens=out)


def greedy_accept(tree_tokens: Tensor, target_argmax: Tensor, buffers: TreeBuffers) -> AcceptResult:
    """Greedy (T = 0) acceptance: the longest root-to-node path whose every draft token
    equals the target's argmax at its parent; the bonus is the argmax at the path's end.

    tree_tokens [B, N+1] (column 0 = root), target_argmax [B, N+1]: the target's argmax at
    each tree row (row n predicts the token after node n). Ties between equally deep paths
    (possible only with duplicate sibling tokens) go to the lower node index.
    """
    b, n1 = tree_tokens.shape
    par = buffers.parent.clamp(min=0)
    match = (tree_tokens == target_argmax.gather(1, par)) & buffers.valid
    match[:, 0] = True
    # A node is reachable iff it and all its ancestors match.
    path_ok = ~(buffers.ancestor_mask & ~match[:, None, :]).any(-1)
    idx = torch.arange(n1, device=tree_tokens.device)
    score = torch.where(path_ok, buffers.depth * (n1 + 1) + (n1 - idx), torch.full_like(buffers.depth, -1))
    best = score.argmax(-1)
    rows = torch.arange(b, device=tree_tokens.device)
    d = buffers.max_depth
    accepted = _path_to_nodes(buffers.ancestor_mask[rows, best], buffers.depth, d)
    bonus = target_argmax[rows, best]
    return _finish(tree_tokens, accepted, buffers.depth[rows, best], bonus)


def sample_accept(tree_tokens: Tensor, target_probs: Tensor, buffers: TreeBuffers,
                  draft_probs: Tensor | None = None, generator: torch.Generator | None = None,
                  eps: float = 1e-12) -> AcceptResult:
    """Lossless multi-candidate speculative sampling over a tree (SpecInfer / EAGLE, i.e.
    recursive rejection sampling), vectorised over the batch.

    tree_tokens [B, N+1]; target_probs [B, N+1, V]: the target's (temperature / top-p
    processed) distribution at each tree row; draft_probs [B, N+1, V] or None (see
    :class:`DraftTree`); generator: explicit RNG (the same generator + inputs give the same
    result).

    Walk from the root. At node n with residual target p (initially target_probs[n]) try
    its children in rank order. Child x (drawn from q_i = draft_probs[n] with the already
    tried siblings removed and renormalised) is accepted with prob min(1, p(x) / q_i(x));
    on rejection p <- norm(max(0, p - q_i)). With ``draft_probs=None`` q_i is one-hot at x:
    accept with prob p(x), else zero p(x) and renormalise (lossless for any candidates
    chosen without looking at the target). Children with q_i(x) = 0 are skipped. After an
    acceptance, continue at the child with p = target_probs[child]; when a node has no
    children left, the bonus token is sampled from the current p (the final residual, or
    the target distribution at the last accepted node).

    Lossless when the candidates were drawn as stated (sampling without replacement from
    draft_probs, or any target-independent choice for the one-hot rule): the emitted
    tokens have exactly the target's distribution.
    """
    b, n1 = tree_tokens.shape
    dev = tree_tokens.device
    rows = torch.arange(b, device=dev)
    tp = target_probs.float()
    d_max = buffers.max_depth
    c_max = buffers.children.shape[-1]
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    p = tp[:, 0]
    q_rem = draft_probs[:, 0].float() if draft_probs is not None else None
    walking = torch.ones(b, dtype=torch.bool, device=dev)
    accepted = torch.full((b, d_max + 1), -1, dtype=torch.long, device=dev)
    accepted[:, 0] = 0
    num_acc = torch.zeros(b, dtype=torch.long, device=dev)
    for d in range(d_max):
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        for c in range(c_max):
            child = buffers.children[rows, cur, c]
            x = tree_tokens[rows, child.clamp(min=0)]
            acc, p, q_rem = _try_child(x, walking & ~moved & (child >= 0), p, q_rem, generator, eps)
            cur = torch.where(acc, child, cur)
            moved |= acc
        walking &= moved
        p = torch.where(moved[:, None], tp[rows, cur], p)
        if q_rem is not None:
            q_rem = torch.where(moved[:, None], draft_probs[rows, cur].float(), q_rem)
        accepted[:, d + 1] = torch.where(moved, cur, -1)
        num_acc += moved.long()
        if not bool(walking.any()):
            break
    bonus = torch.multinomial(p, 1, generator=generator).squeeze(1)
    return _finish(tree_tokens, accepted, num_acc, bonus)


def _try_child(x: Tensor, trying: Tensor, p: Tensor, q_rem: Tensor | None,
               generator: torch.Generator | None, eps: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """One trial of :func:`sample_accept` at each request's current node: its child token
    x [B], tried where ``trying`` [B] holds, against the residual target p [B, V] and the
    untried draft mass q_rem [B, V] (None: the one-hot rule). Returns (accepted [B] bool,
    p, q_rem) after the trial.

    Accept x with probability min(1, p(x) / q(x)); on rejection the residual becomes
    norm(max(0, p - q)) and x leaves the draft mass, so the next sibling is tried against
    what the target still owes.
    """
    b = x.shape[0]
    rows = torch.arange(b, device=x.device)
    if q_rem is None:
        qvec = torch.nn.functional.one_hot(x, p.shape[-1]).float()
    else:
        qvec = q_rem / q_rem.sum(-1, keepdim=True).clamp(min=eps)
    qx = qvec[rows, x]
    trying = trying & (qx > 0)
    px = p[rows, x]
    u = torch.rand(b, generator=generator, device=x.device)
    acc = trying & (u * qx < px)  # u < p/q, i.e. prob min(1, p/q)
    rej = trying & ~acc
    resid = (p - qvec).clamp(min=0)
    s = resid.sum(-1, keepdim=True)
    # p == q_i makes rejection impossible in exact arithmetic; if rounding still
    # rejects, fall back to zeroing x (keeps p a distribution).
    fallback = p.scatter(1, x[:, None], 0.0)
    fallback = fallback / fallback.sum(-1, keepdim=True).clamp(min=eps)
    resid = torch.where(s > eps, resid / s.clamp(min=eps), fallback)
    p = torch.where(rej[:, None], resid, p)
    if q_rem is not None:
        q_rem = torch.where(rej[:, None], q_rem.scatter(1, x[:, None], 0.0), q_rem)
    return acc, p, q_rem


# ============================================================================ KV compaction
def accepted_kv_moves(accepted_nodes: Tensor, root_positions: Tensor) -> tuple[Tensor, Tensor]:
    """Which KV rows to move so that the accepted path becomes contiguous.

    accepted_nodes [B, D+1] (from :class:`AcceptResult`, root first, -1 pad); root_positions
    [B]: the root's sequence position (= prefix length before the tree = the KV row of
    node 0). Node n was written at row ``root + n``; the accepted node at depth j must end
    at row ``root + j``. Returns (src, dst) logical positions, each [B, D], -1 where nothing
    moves (padding, or ``n == j``). Since BFS gives ``n_j >= j`` and ``n`` increases along
    the path, no destination is a later source *of the same step in ascending order*; a
    parallel copy must still read all sources before writing (the kernels do).
    """
    drafts = accepted_nodes[:, 1:]
    j = torch.arange(1, accepted_nodes.shape[1], device=drafts.device)
    move = (drafts >= 0) & (drafts != j)
    root = root_positions.long()[:, None]
    src = torch.where(move, root + drafts, -1)
    dst = torch.where(move, root + j, -1)
    return src, dst


def positions_to_slots(positions: Tensor, block_table: Tensor, block_size: int) -> Tensor:
    """Logical positions [B, M] -> flat cache slots ``block * block_size + offset`` (vLLM's
    slot_mapping convention), via block_table [B, max_blocks]; -1 entries stay -1."""
    pos = positions.long()
    safe = pos.clamp(min=0)
    blk = block_table.long().gather(1, safe // block_size)
    return torch.where(pos >= 0, blk * block_size + safe % block_size, -1)
