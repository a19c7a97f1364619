"""Token trees for Clover speculative decoding: structure, static trees, drafting.

Pure PyTorch, no vLLM import. Docs: docs/trees-and-kernels.md; method: the Clover papers
(arXiv 2405.00263: heads, dynamic tree; arXiv 2408.00264: Clover-2, static tree); vLLM
constraints: docs/vllm-internals.md section 4. Beside this module, under the same
conventions, and re-exported here: the static tree presets as plain data (presets.py), the
head-step and child-choice callables (head_steps.py), acceptance and the KV compaction plan
(acceptance.py).

Conventions used everywhere in this module
------------------------------------------
* A tree has ``N`` draft nodes plus the **root**. Node index 0 is the root: the token the
  target sampled at the previous step (already emitted, its KV not yet computed). Draft
  nodes are 1..N. Every per-node tensor therefore has ``N + 1`` columns.
* Nodes are in **BFS order**: depth is non-decreasing with the index, siblings are
  contiguous and in rank order, and children of an earlier parent come first. Any prefix
  ``0..n`` is ancestor-closed, so vLLM's scheduler may truncate the drafts to a prefix.
* ``parent[0] = -1`` (the root has no parent); ``depth[0] = 0``; ``rank[0] = -1``.
  ``rank`` of a draft node is its top-k index among its siblings (0 = most likely).
* ``ancestor_mask[i, j]`` is True when node j is an ancestor of node i **or i itself**;
  column 0 (root) is True on every real row. It is the tree-attention mask over the
  tree part of the sequence (the prefix before the root is visible to every node).
* Position of node n = ``root_position + depth[n]`` (RoPE); its KV *slot* is
  ``root_position + n`` (every node gets its own row, in BFS order, after the prefix).
* Batched per-request buffers (:class:`TreeBuffers`) have a leading ``[B]`` axis. Trees of
  different size (dynamic trees) are **right-padded** to a common ``N + 1``: a padded
  column has ``valid = False``, ``parent = -1``, ``depth = 0``, ``rank = -1``, token 0, and
  an ancestor-mask row with only itself set (so attention rows stay well defined); it is
  never anyone's child, so it can never be accepted.
* Acceptance results use ``-1`` for padding (as vLLM's ``[B, num_spec + 1]`` output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from vllm_clover.drafting.acceptance import (AcceptResult, accepted_kv_moves, greedy_accept, positions_to_slots,
                                             sample_accept)
from vllm_clover.drafting.head_steps import HeadStepFn, TopkFn, drafter_head_step_fn, greedy_topk, sampling_topk
from vllm_clover.drafting.presets import DEFAULT_TREE, PRESETS

__all__ = [  # with the names re-exported from acceptance.py, head_steps.py and presets.py
    "DEFAULT_TREE", "PRESETS", "AcceptResult", "DraftTree", "HeadStepFn", "StaticTree", "TopkFn", "TreeBuffers",
    "accepted_kv_moves", "buffers_from_parents", "build_dynamic_tree", "chain_paths", "drafter_head_step_fn",
    "dynamic_budget", "expand_static_tree", "get_tree", "graft_chain", "greedy_accept", "greedy_topk",
    "leaf_paths", "positions_to_slots", "sample_accept", "sampling_topk", "single_tree_buffers",
    "tree_for_batch_size"]

Tensor = torch.Tensor



# ============================================================================ buffers
@dataclass(frozen=True)
class TreeBuffers:
    """Per-request tree structure, batched. Shapes use B requests, N+1 nodes (root = 0).

    parent         [B, N+1] long   parent index; -1 for the root and padded nodes
    depth          [B, N+1] long   0 for the root (and padding)
    rank           [B, N+1] long   top-k index among siblings; -1 for root/padding
    valid          [B, N+1] bool   real node (root included)
    ancestor_mask  [B, N+1, N+1] bool   [b, i, j]: j is an ancestor of i or i itself
    children       [B, N+1, C] long     child index by rank, -1 where absent (C = max children)
    num_nodes      [B] long        real nodes including the root

    Tensors may be stride-0 expansions of one static tree (see :meth:`StaticTree.buffers`):
    treat them as read-only.
    """

    parent: Tensor
    depth: Tensor
    rank: Tensor
    valid: Tensor
    ancestor_mask: Tensor
    children: Tensor
    num_nodes: Tensor

    @property
    def batch_size(self) -> int:
        return self.parent.shape[0]

    @property
    def width(self) -> int:
        """N + 1: number of node columns (root included, padding included)."""
        return self.parent.shape[1]

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.depth.numel() else 0

    def positions(self, root_positions: Tensor) -> Tensor:
        """RoPE positions of the tree rows: root_positions [B] -> [B, N+1] = root + depth."""
        return root_positions.to(self.depth.dtype)[:, None] + self.depth


def buffers_from_parents(parent: Tensor, valid: Tensor | None = None) -> TreeBuffers:
    """Build :class:`TreeBuffers` from parent pointers.

    parent [B, N+1] long, BFS order (``parent[b, n] < n`` for real n >= 1, -1 at the root
    and at padding); valid [B, N+1] bool (default: every column real). Ranks are the order
    of siblings by index, so siblings must be listed in rank order (BFS order guarantees it).
    Cost O(N^2) per request, vectorised over the batch; N is at most a few dozen.
    """
    parent = parent.long()
    b, n1 = parent.shape
    dev = parent.device
    if valid is None:
        valid = torch.ones(b, n1, dtype=torch.bool, device=dev)
    valid = valid.clone()
    valid[:, 0] = True
    parent = torch.where(valid, parent, torch.full_like(parent, -1))
    parent[:, 0] = -1
    idx = torch.arange(n1, device=dev)
    if bool(((parent >= idx) & (idx > 0) & valid).any()):
        raise ValueError("parent pointers are not in BFS order (parent[n] must be < n)")
    if bool(((parent < 0) & (idx > 0) & valid).any()):
        raise ValueError("a real non-root node has no parent")
    depth = torch.zeros(b, n1, dtype=torch.long, device=dev)
    anc = torch.zeros(b, n1, n1, dtype=torch.bool, device=dev)
    anc[:, idx, idx] = True
    rows = torch.arange(b, device=dev)
    # Parents come first, so one left-to-right sweep settles depth and ancestors.
    for n in range(1, n1):
        p = parent[:, n]
        real = valid[:, n]
        pc = p.clamp(min=0)
        depth[:, n] = torch.where(real, depth[rows, pc] + 1, 0)
        anc[:, n] |= anc[rows, pc] & real[:, None]
    same_parent = (parent[:, :, None] == parent[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = idx[None, :] < idx[:, None]  # [i, j]: j < i
    rank = (same_parent & earlier).sum(-1)
    rank = torch.where(valid & (idx > 0), rank, torch.full_like(rank, -1))
    c = max(int(rank.max()) + 1, 1)
    children = torch.full((b, n1, c), -1, dtype=torch.long, device=dev)
    has_parent = parent >= 0
    bi, ni = has_parent.nonzero(as_tuple=True)
    children[bi, parent[bi, ni], rank[bi, ni]] = ni
    return TreeBuffers(parent=parent, depth=depth, rank=rank, valid=valid, ancestor_mask=anc,
                       children=children, num_nodes=valid.sum(-1))


def single_tree_buffers(parent: Sequence[int]) -> TreeBuffers:
    """:func:`buffers_from_parents` of one tree given as a list, every column real: the same
    tensors (batch of one), built in numpy. Why: the verifier builds one per request and
    step, and retrieval grafts make most trees new; the batched builder loops torch ops
    over nodes, ~14x slower than this for 30 nodes.

    parent [N+1]: BFS parent pointers, -1 at the root (``parent[n] < n`` for n >= 1)."""
    par = np.asarray(parent, dtype=np.int64)
    n1 = par.shape[0]
    if n1 == 0 or par[0] != -1:
        raise ValueError("the root (column 0) must have parent -1")
    idx = np.arange(n1)
    if ((par[1:] >= idx[1:]) | (par[1:] < 0)).any():
        raise ValueError("parent pointers are not in BFS order (parent[n] must be < n)")
    depth = np.zeros(n1, dtype=np.int64)
    anc = np.eye(n1, dtype=bool)
    rank = np.full(n1, -1, dtype=np.int64)
    kids: list[list[int]] = [[] for _ in range(n1)]
    for n in range(1, n1):
        p = int(par[n])
        depth[n] = depth[p] + 1
        anc[n] |= anc[p]
        rank[n] = len(kids[p])
        kids[p].append(n)
    children = np.full((n1, max(max(len(k) for k in kids), 1)), -1, dtype=np.int64)
    for n, k in enumerate(kids):
        children[n, : len(k)] = k
    t = torch.from_numpy
    return TreeBuffers(parent=t(par)[None], depth=t(depth)[None], rank=t(rank)[None],
                       valid=torch.ones(1, n1, dtype=torch.bool), ancestor_mask=t(anc)[None],
                       children=t(children)[None], num_nodes=torch.tensor([n1]))


def leaf_paths(parent: Tensor) -> Tensor:
    """Medusa's ``retrieve_indices`` for one tree: parent [N+1] -> [L, D+1] long.

    Row l is the root-to-leaf path of the l-th leaf (leaves in BFS order), node indices
    starting with the root 0, right-padded with -1. A leaf is a node with no children.
    """
    parent = parent.long().tolist()
    n1 = len(parent)
    has_child = [False] * n1
    for p in parent[1:]:
        if p >= 0:
            has_child[p] = True
    paths = []
    for n in range(n1):
        if has_child[n] or (n > 0 and parent[n] < 0):
            continue
        path = [n]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        paths.append(path[::-1])
    width = max(len(p) for p in paths)
    return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)


# ============================================================================ static trees
class StaticTree:
    """A fixed sparse tree given by top-k paths, with Medusa-style buffers.

    ``paths``: each draft node is the tuple of ranks from the root, e.g. ``(0, 2)`` is the
    3rd child of the top-1 child. Validation: every proper prefix is present, no
    duplicates, and the ranks of each node's children are contiguous from 0.

    Attributes (single tree; N draft nodes, D = max depth, C = max children):
      paths            tuple of N paths in BFS order (node n = paths[n - 1])
      parent/depth/rank [N+1] long   (root: -1 / 0 / -1)
      ancestor_mask    [N+1, N+1] bool (root column set on every row)
      position_offsets [N+1] long = depth
      retrieve_paths   [L, D+1] long, root-to-leaf node indices, -1 padded (L leaves)
      children         [N+1, C] long, -1 padded
      expand_nodes     list of D tensors: the nodes of depth d that have children, i.e. the
                       rows head d runs on; ``sum(len) = `` LM-head rows per draft step
      nodes_per_depth  list of D+1 ints (depth 0 = root)
    """

    def __init__(self, paths: Sequence[Sequence[int]], name: str = "custom") -> None:
        self.name = name
        self.paths = _validate_paths(paths)
        n1 = len(self.paths) + 1
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        parent = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in self.paths]
        b = buffers_from_parents(torch.tensor([parent]))
        self.parent = b.parent[0]
        self.depth = b.depth[0]
        self.rank = b.rank[0]
        self.ancestor_mask = b.ancestor_mask[0]
        self.children = b.children[0]
        self.position_offsets = self.depth
        self.retrieve_paths = leaf_paths(self.parent)
        self.max_depth = int(self.depth.max()) if n1 > 1 else 0
        self.nodes_per_depth = [int((self.depth == d).sum()) for d in range(self.max_depth + 1)]
        has_child = self.children[:, 0] >= 0
        self.expand_nodes = [((self.depth == d) & has_child).nonzero().flatten()
                             for d in range(self.max_depth)]
        # For drafting: nodes of depth d+1, the column of their parent in expand_nodes[d].
        self._child_nodes = [(self.depth == d + 1).nonzero().flatten() for d in range(self.max_depth)]
        col = torch.full((n1,), -1, dtype=torch.long)
        for e in self.expand_nodes:
            col[e] = torch.arange(len(e))
        self._expand_col = col
        self._buffers = b

    @property
    def num_nodes(self) -> int:
        """N: draft nodes, root excluded (the value for ``num_speculative_tokens``)."""
        return len(self.paths)

    @property
    def num_expanded(self) -> int:
        """LM-head rows per draft step (11 for mc_sim_7b_63)."""
        return sum(len(e) for e in self.expand_nodes)

    def buffers(self, batch_size: int, device: torch.device | str | None = None) -> TreeBuffers:
        """The tree as :class:`TreeBuffers` for ``batch_size`` requests (stride-0 views)."""
        b = self._buffers
        def ex(t: Tensor) -> Tensor:
            t = t.to(device) if device is not None else t
            return t.expand(batch_size, *t.shape[1:])
        return TreeBuffers(*(ex(getattr(b, f)) for f in
                             ("parent", "depth", "rank", "valid", "ancestor_mask", "children", "num_nodes")))

    def __repr__(self) -> str:
        return f"StaticTree({self.name!r}, nodes={self.num_nodes}, per_depth={self.nodes_per_depth[1:]})"


def _validate_paths(paths: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Check a top-k path list and return it sorted in BFS order (depth, then lexicographic)."""
    tps = [tuple(int(r) for r in p) for p in paths]
    if any(len(p) == 0 for p in tps):
        raise ValueError("empty path: the root is implicit, list draft nodes only")
    if any(r < 0 for p in tps for r in p):
        raise ValueError("negative rank in a tree path")
    seen = set(tps)
    if len(seen) != len(tps):
        raise ValueError("duplicate path in tree")
    for p in tps:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"path {list(p)} has no parent {list(p[:-1])}")
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in seen:
            raise ValueError(f"path {list(p)}: ranks of siblings must be contiguous from 0")
    # Lexicographic order within a depth groups children by parent in parent order and
    # lists siblings by rank: exactly BFS order.
    return tuple(sorted(tps, key=lambda p: (len(p), p)))


def chain_paths(k: int) -> tuple[tuple[int, ...], ...]:
    """The top-1 chain of k drafts: [[0], [0, 0], ...]."""
    if k < 1:
        raise ValueError("a chain needs k >= 1")
    return tuple((0,) * d for d in range(1, k + 1))


@lru_cache(maxsize=None)
def get_tree(name: str = DEFAULT_TREE) -> StaticTree:
    """A named preset (``PRESETS``: ``"mc_sim_7b_63"``, the default, ``"small_10"``, ``"small_3"``,
    ``"small_4"``, ``"small_5"``, ``"wide_9"``) or ``"chain<K>"``."""
    m = re.fullmatch(r"chain(\d+)", name)
    if m:
        return StaticTree(chain_paths(int(m.group(1))), name)
    if name not in PRESETS:
        raise KeyError(f"unknown tree {name!r}; presets: {sorted(PRESETS)} or chain<K>")
    return StaticTree(PRESETS[name], name)


# ============================================================================ budget schedule
def tree_for_batch_size(batch_size: int, token_budget: int = 96, num_heads: int = 5,
                        ladder: Sequence[str] = ("mc_sim_7b_63", "small_10")) -> StaticTree:
    """The static tree to use at a given decode batch size.

    Why: verifying a tree costs ``B * (N + 1)`` target tokens per step. While that stays
    small the target forward is memory-bound (weights are read once whatever the token
    count), so extra tree nodes are almost free and raise the accepted length. Once the
    batch fills the GPU the step becomes compute-bound and every rejected node costs real
    time, so the tree must shrink, down to a chain (Clover-1 served large batches with a
    4-token budget). ``token_budget`` is the per-step verify-token count we allow; 96 is a
    placeholder to be tuned from benchmarks on the serving GPU.

    Rule: the largest tree in ``ladder`` (biggest first) with ``B * (N+1) <= token_budget``;
    else ``chain<K>`` with the largest ``K <= num_heads`` that fits, at least ``chain1``.
    With the defaults: B 1-3 -> mc_sim_7b_63 (26 tokens), B 4-8 -> small_10 (11), B 9-16 ->
    chain5, B 17-19 -> chain4, B 20-24 -> chain3, B 25-32 -> chain2, B > 32 -> chain1.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    for name in ladder:
        tree = get_tree(name)
        if tree.max_depth <= num_heads and batch_size * (tree.num_nodes + 1) <= token_budget:
            return tree
    k = max(1, min(num_heads, token_budget // batch_size - 1))
    return get_tree(f"chain{k}")


def dynamic_budget(batch_size: int, token_budget: int = 96, max_nodes: int = 25) -> int:
    """Draft-node budget per request for :func:`build_dynamic_tree` (same rationale as
    :func:`tree_for_batch_size`): ``clamp(token_budget // B - 1, 1, max_nodes)``."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    return max(1, min(max_nodes, token_budget // batch_size - 1))


# ============================================================================ drafting
@dataclass
class DraftTree:
    """Output of tree drafting, per request.

    tokens       [B, N+1] long: node tokens in BFS order, column 0 = root token
                 (drafts for vLLM = ``tokens[:, 1:]``); padding columns hold 0
    draft_probs  [B, N+1, V] float32 or None: row n = the distribution node n's children
                 were *sampled* from (without replacement, in rank order); zero rows for
                 nodes without children. None when children are deterministic (top-k):
                 acceptance then uses the one-hot rule, which is lossless too
    buffers      the tree structure (:class:`TreeBuffers`)
    """

    tokens: Tensor
    draft_probs: Tensor | None
    buffers: TreeBuffers


@torch.no_grad()
def expand_static_tree(head_step_fn: HeadStepFn, z_last: Tensor, root_tokens: Tensor,
                       tree: StaticTree | str = DEFAULT_TREE, topk_fn: TopkFn = greedy_topk) -> DraftTree:
    """Draft a static tree for B requests with one batched head call per depth.

    z_last [B, H]: trunk output at each request's last position (the head-0 state);
    root_tokens [B] long: the target-sampled token there (the root). Head d runs on the
    ``B * len(tree.expand_nodes[d])`` expanded nodes of depth d at once: its input state is
    the state head d-1 returned for the node's parent (z_last for the root), its input token
    the node's own token (Clover heads have no draft-side attention, clover-method.md 1.4,
    so "repeat the parent state per child" is all a tree needs). Children take the top-k
    token of rank ``rank[child]``. Returns a :class:`DraftTree` (tokens [B, N+1]).
    """
    tree = get_tree(tree) if isinstance(tree, str) else tree
    b, h = z_last.shape
    dev = z_last.device
    n1 = tree.num_nodes + 1
    tokens = torch.zeros(b, n1, dtype=torch.long, device=dev)
    tokens[:, 0] = root_tokens
    draft_probs: Tensor | None = None
    prev_states = z_last[:, None, :]  # states head d-1 returned, by expanded column (root: z)
    for d, nodes in enumerate(tree.expand_nodes):
        e = len(nodes)
        if e == 0:
            break
        # Column of each expanded node's parent among the nodes expanded at depth d-1.
        par_col = tree._expand_col[tree.parent[nodes]] if d > 0 else torch.zeros(e, dtype=torch.long)
        in_states = prev_states[:, par_col.to(dev)].reshape(b * e, h)
        in_tokens = tokens[:, nodes.to(dev)].reshape(b * e)
        states, logits = head_step_fn(in_states, in_tokens, d)
        k = int(tree.children[nodes, :].ge(0).sum(-1).max())
        child_tok, q = topk_fn(logits, k)
        child_tok = child_tok.view(b, e, k)
        kids = tree._child_nodes[d]
        kid_col = tree._expand_col[tree.parent[kids]]
        tokens[:, kids.to(dev)] = child_tok[:, kid_col.to(dev), tree.rank[kids].to(dev)]
        if q is not None:
            if draft_probs is None:
                draft_probs = torch.zeros(b, n1, q.shape[-1], dtype=torch.float32, device=dev)
            draft_probs[:, nodes.to(dev)] = q.view(b, e, -1).float()
        prev_states = states.view(b, e, h)
    return DraftTree(tokens=tokens, draft_probs=draft_probs, buffers=tree.buffers(b, dev))


@torch.no_grad()
def build_dynamic_tree(head_step_fn: HeadStepFn, z_last: Tensor, root_tokens: Tensor, budget: int,
                       max_depth: int, top_p: float = 0.8, sibling_ratio: float = 0.25,
                       max_children: int = 10, vocab_ids: Tensor | None = None) -> DraftTree:
    """Clover-1's dynamic tree (clover-method.md 4.2), batched over B requests.

    Per depth d (head d runs once on all nodes of depth d of all requests):
      * token level: each node keeps its most likely children while the cumulative
        probability *before* a child is < top_p (so the child crossing top_p is kept), at
        most ``max_children``, and drops any child with prob < sibling_ratio * top-1 prob;
      * tree level: candidates are ranked by joint probability (product along the path);
        each request keeps its best ``remaining`` ones (stable on ties, so kept siblings are
        always a rank prefix);
      * head level: ``remaining = budget - nodes kept so far``; expansion stops at 0, at
        ``max_depth`` (number of heads) or when no candidate survives.
    Probabilities are softmax(logits) (T = 1) and children are deterministic, so
    ``draft_probs`` is None and acceptance uses the one-hot rule.

    z_last [B, H], root_tokens [B]. ``vocab_ids`` [V'] long: the token id of each logits
    column when the heads score a reduced draft vocabulary (softmax over it equals softmax
    over the full vocabulary with -inf elsewhere, at a twelfth of the cost for 4,096 of
    49,152); None: column = token id. Returns tokens/buffers of width ``budget + 1``;
    requests with fewer nodes are right-padded (module docstring).
    """
    grow = _GrowingTree.start(z_last, root_tokens, budget)
    for d in range(max_depth):
        live = grow.front >= 0
        remaining = budget - (grow.count - 1)
        if not bool(live.any()) or int(remaining.max()) <= 0:
            break
        bi, fi = live.nonzero(as_tuple=True)
        states, logits = head_step_fn(grow.front_state[bi, fi], grow.tokens[bi, grow.front[bi, fi]], d)
        joint, cand_tok = _child_candidates(logits, grow.front_joint, bi, fi, top_p, sibling_ratio,
                                            max_children, vocab_ids)
        sel = _best_candidates(joint.flatten(1), remaining)
        if int(sel.sum(-1).max()) == 0:
            break
        child_state = torch.zeros(*grow.front.shape, states.shape[-1], dtype=states.dtype, device=states.device)
        child_state[bi, fi] = states
        grow.add_children(sel, joint, cand_tok, child_state)
    return grow.finish()


@dataclass
class _GrowingTree:
    """A dynamic tree while :func:`build_dynamic_tree` grows it, depth by depth; B requests,
    N+1 = budget + 1 columns, F frontier slots (the nodes of the depth being expanded)."""

    tokens: Tensor       # [B, N+1] long: node tokens, column 0 = root, 0 where unfilled
    parent: Tensor       # [B, N+1] long: -1 at the root and where unfilled
    count: Tensor        # [B] long: nodes so far, root included
    front: Tensor        # [B, F] long: frontier node indices, -1 pad
    front_joint: Tensor  # [B, F] float32: joint probability of each frontier node's path
    front_state: Tensor  # [B, F, H]: the state head d takes for a frontier node's children

    @classmethod
    def start(cls, z_last: Tensor, root_tokens: Tensor, budget: int) -> "_GrowingTree":
        """The root alone: z_last [B, H], root_tokens [B]."""
        b = z_last.shape[0]
        dev = z_last.device
        tokens = torch.zeros(b, budget + 1, dtype=torch.long, device=dev)
        tokens[:, 0] = root_tokens
        return cls(tokens=tokens, parent=torch.full((b, budget + 1), -1, dtype=torch.long, device=dev),
                   count=torch.ones(b, dtype=torch.long, device=dev),
                   front=torch.zeros(b, 1, dtype=torch.long, device=dev),
                   front_joint=torch.ones(b, 1, device=dev), front_state=z_last[:, None, :])

    def add_children(self, sel: Tensor, joint: Tensor, cand_tok: Tensor, child_state: Tensor) -> None:
        """Append the selected candidates as nodes and make them the next frontier.

        sel [B, F*k] bool (from :func:`_best_candidates`); joint, cand_tok [B, F, k] (from
        :func:`_child_candidates`); child_state [B, F, H]: head d's output on each frontier
        node, the state its children take to the next head. Column ``f * k + r`` of the
        flattened candidates is the rank-r child of frontier node f, so numbering the selected
        ones in that order keeps the nodes in BFS order.
        """
        b, f, k = joint.shape
        dev = sel.device
        slot = sel.long().cumsum(-1) - 1  # [B, F*k]: place of each selected one among its request's
        sb, sc = sel.nonzero(as_tuple=True)
        sf = sc // k
        tgt = (self.count[:, None] + slot)[sb, sc]  # node index of each selected one
        self.parent[sb, tgt] = self.front[sb, sf]
        self.tokens[sb, tgt] = cand_tok.view(b, f * k)[sb, sc]
        g = int(sel.sum(-1).max())
        front = torch.full((b, g), -1, dtype=torch.long, device=dev)
        front[sb, slot[sb, sc]] = tgt
        front_joint = torch.zeros(b, g, device=dev)
        front_joint[sb, slot[sb, sc]] = joint.view(b, f * k)[sb, sc]
        front_state = torch.zeros(b, g, child_state.shape[-1], dtype=child_state.dtype, device=dev)
        front_state[sb, slot[sb, sc]] = child_state[sb, sf]
        self.front, self.front_joint, self.front_state = front, front_joint, front_state
        self.count = self.count + sel.sum(-1)

    def finish(self) -> DraftTree:
        """The grown tree; columns past a request's node count are padding."""
        valid = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :] < self.count[:, None]
        return DraftTree(tokens=self.tokens, draft_probs=None, buffers=buffers_from_parents(self.parent, valid))


def _child_candidates(logits: Tensor, front_joint: Tensor, bi: Tensor, fi: Tensor, top_p: float,
                      sibling_ratio: float, max_children: int,
                      vocab_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Token level: the children each live frontier node keeps, with their joint probability.

    logits [M, V']: the head's output on the M live frontier nodes ``(bi, fi)`` of
    front_joint [B, F]. A node keeps its most likely children while the cumulative probability
    before a child is < top_p, at most ``max_children``, none below sibling_ratio * its top-1.
    Returns joint [B, F, k] float32 (-1: no candidate) and tokens [B, F, k] long, in rank order.
    """
    b, f = front_joint.shape
    dev = front_joint.device
    k = min(max_children, logits.shape[-1])
    probs, cand = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [M, k] sorted
    if vocab_ids is not None:
        cand = vocab_ids[cand]
    before = probs.cumsum(-1) - probs
    keep = (before < top_p) & (probs >= sibling_ratio * probs[:, :1])
    joint = torch.full((b, f, k), -1.0, device=dev)
    joint[bi, fi] = torch.where(keep, front_joint[bi, fi][:, None] * probs, -1.0)
    cand_tok = torch.zeros(b, f, k, dtype=torch.long, device=dev)
    cand_tok[bi, fi] = cand
    return joint, cand_tok


def _best_candidates(joint: Tensor, remaining: Tensor) -> Tensor:
    """Tree level: each request's ``remaining`` [B] candidates of highest joint probability.

    joint [B, C] (-1: no candidate) -> selected [B, C] bool. The sort is stable, so on ties
    the lower-ranked sibling goes first and the kept siblings are always a rank prefix."""
    b, c = joint.shape
    order = joint.argsort(dim=-1, descending=True, stable=True)
    pos = torch.empty_like(order)
    pos.scatter_(1, order, torch.arange(c, device=joint.device).expand(b, -1))  # rank by joint
    return (pos < remaining[:, None]) & (joint > 0)


def graft_chain(tokens: Sequence[int], parent: Sequence[int],
                chain: Sequence[int]) -> tuple[list[int], tuple[int, ...]]:
    """Merge a chain of candidate tokens (e.g. a prompt-lookup continuation) into one
    request's tree, hanging from the root.

    tokens [N]: draft tokens of nodes 1..N; parent [N+1]: BFS parent pointers (root -1).
    The chain follows existing nodes while their tokens match (no duplicate siblings: a
    repeated sibling could never be accepted) and adds new nodes for the rest, each as
    the last-ranked child of its parent, so the tree's own top-1 spine stays the start of
    the merged tree's spine (which grows only where the chain extends a spine leaf).
    Returns (tokens, parent) of the merged tree, relabelled in BFS order (its prefixes
    stay ancestor-closed for vLLM's scheduler). Pure; O(N * len(chain)).
    """
    toks, par = [None, *tokens], list(parent)
    children: list[list[int]] = [[] for _ in toks]
    for n in range(1, len(toks)):
        children[par[n]].append(n)
    node = 0
    for t in chain:
        t = int(t)
        match = next((c for c in children[node] if toks[c] == t), None)
        if match is None:
            match = len(toks)
            toks.append(t)
            par.append(node)
            children.append([])
            children[node].append(match)
        node = match
    order, queue = [], [0]
    while queue:  # BFS, children in rank order: the original nodes keep their order
        n = queue.pop(0)
        order.append(n)
        queue.extend(children[n])
    new_index = {old: i for i, old in enumerate(order)}
    merged_parent = tuple([-1] + [new_index[par[old]] for old in order[1:]])
    return [toks[old] for old in order[1:]], merged_parent
