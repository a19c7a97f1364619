"""Token trees for Clover speculative decoding: structure, drafting, acceptance, compaction.

Pure PyTorch, no vLLM import. Docs: docs/trees-and-kernels.md; method:
/work/shared/docs/clover-method.md sections 1.4, 4.1, 4.2; vLLM constraints:
/work/shared/docs/vllm-internals.md section 3.

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
from typing import Callable, Sequence

import numpy as np
import torch

Tensor = torch.Tensor

# (state [M, H], prev_token [M], head index) -> (new_state [M, H], logits [M, V])
HeadStepFn = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]
# (logits [M, V], k) -> (child tokens [M, k] in rank order, q [M, V] sampled from, or None)
TopkFn = Callable[[Tensor, int], tuple[Tensor, Tensor | None]]

# EAGLE-1's sparse tree, reused by Clover-2 (clover-method.md 4.1): 25 nodes + root,
# 4/8/8/3/2 nodes per depth, 15 leaves, 11 expanded nodes (1/4/4/1/1 per depth).
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)
# A 10-node tree for medium batches (ours, not from a paper): the top-1 spine to depth 5
# plus the most useful second choices near the root; 2/3/2/2/1 nodes per depth.
SMALL_10: tuple[tuple[int, ...], ...] = (
    (0,), (1,),
    (0, 0), (0, 1), (1, 0),
    (0, 0, 0), (0, 0, 1),
    (0, 0, 0, 0), (0, 0, 0, 1),
    (0, 0, 0, 0, 0),
)
# A 4-node tree for compute-bound targets (ours; this 2-core CPU): the top-2 tokens at
# depth 1, each followed by its top-1 child. Every extra verified token costs real compute
# there, and depth-1 alternatives carry most of a tree's gain (docs/tree-verification.md).
SMALL_4: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 0), (1, 0))
# A 9-node tree, two heads deep (ours): the top-4 first tokens, each with its top-1 child, and
# the top-1 first token's second child; 4/5 nodes per depth. Drafting costs the same two batched
# head calls as small_4 (depth, not width, sets their number), and the heads' depth-1 ranks 3
# and 4 still hold the target's token often enough to pay where verified rows are cheap: on
# the target's greedy float32 answers to 80 MT-Bench questions, with 16 retrieval tokens,
# 3.05 tokens per step against small_4's 2.84 (vllm_clover/benchmarks/replay_tree.py).
WIDE_9: tuple[tuple[int, ...], ...] = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (2, 0), (3, 0))
# small_4 less the second first token's child (small_3), or plus the third first token
# (small_5): trees for float32 on CPUs, where each verified row costs its FMAs (~0.8 ms for the
# default model, docs/cpu-linear.md) and up to 14 rows fit one register tile of the float32
# linear kernel, so the rows a smaller tree saves go to prompt-lookup tokens. Replayed on the
# target's float32 answers to 20 MT-Bench questions with 14 verify rows at most (small_3 + 10
# retrieval tokens, small_4 + 9, small_5 + 8): 2.74, 2.72 and 2.77 tokens per step over 6.9, 7.6
# and 8.4 rows per step on average, against 2.54 over 6.3 for small_4 + 5 (10 rows).
SMALL_3: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 0))
SMALL_5: tuple[tuple[int, ...], ...] = ((0,), (1,), (2,), (0, 0), (1, 0))
PRESETS: dict[str, tuple[tuple[int, ...], ...]] = {"mc_sim_7b_63": MC_SIM_7B_63, "small_10": SMALL_10,
                                                   "small_3": SMALL_3, "small_4": SMALL_4, "small_5": SMALL_5,
                                                   "wide_9": WIDE_9}
DEFAULT_TREE = "mc_sim_7b_63"


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
    over nodes (0.7 ms for 30 nodes on a 2-core Xeon), this takes about 0.05 ms.

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


def greedy_topk(logits: Tensor, k: int) -> tuple[Tensor, None]:
    """Deterministic top-k children (T = 0 drafting): logits [M, V] -> tokens [M, k], None."""
    return logits.topk(k, dim=-1).indices, None


def sampling_topk(temperature: float = 1.0, generator: torch.Generator | None = None) -> TopkFn:
    """k samples without replacement from softmax(logits / T), in draw order (EAGLE T > 0).

    Uses the exponential race: key_v = q_v / Exp(1); the descending order of the keys is
    distributed exactly like sequential draws without replacement. Returns (tokens [M, k],
    q [M, V] float32). If fewer than k tokens have q > 0, the extra picks have q = 0 and
    acceptance skips them.
    """
    if temperature <= 0:
        raise ValueError("sampling_topk needs temperature > 0; use greedy_topk for T = 0")

    def topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        q = torch.softmax(logits.float() / temperature, dim=-1)
        e = torch.empty_like(q).exponential_(1.0, generator=generator)
        return (q / e).topk(k, dim=-1).indices, q

    return topk


def drafter_head_step_fn(drafter, lm_head=None) -> HeadStepFn:
    """Adapter: a ``CloverDrafter`` (vllm_clover.model.drafter) as a :data:`HeadStepFn`.

    ``drafter.head_step(state, prev_token, i)`` returns (s_i, o_i); logits = LMHead(o_i).
    Duck-typed so this module does not import the model.
    """
    def step(state: Tensor, prev_token: Tensor, i: int) -> tuple[Tensor, Tensor]:
        s, o = drafter.head_step(state, prev_token, i)
        return s, drafter.logits(o, lm_head)
    return step


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
    b, h = z_last.shape
    dev = z_last.device
    n1 = budget + 1
    tokens = torch.zeros(b, n1, dtype=torch.long, device=dev)
    tokens[:, 0] = root_tokens
    parent = torch.full((b, n1), -1, dtype=torch.long, device=dev)
    count = torch.ones(b, dtype=torch.long, device=dev)  # nodes so far, root included
    # Frontier: nodes of the current depth, as [B, F] node indices (-1 pad) + states.
    front = torch.zeros(b, 1, dtype=torch.long, device=dev)
    front_joint = torch.ones(b, 1, device=dev)
    front_state = z_last[:, None, :]
    for d in range(max_depth):
        live = front >= 0
        remaining = budget - (count - 1)
        if not bool(live.any()) or int(remaining.max()) <= 0:
            break
        f = front.shape[1]
        bi, fi = live.nonzero(as_tuple=True)
        states, logits = head_step_fn(front_state[bi, fi], tokens[bi, front[bi, fi]], d)
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
        joint = joint.view(b, f * k)
        order = joint.argsort(dim=-1, descending=True, stable=True)
        pos = torch.empty_like(order)
        pos.scatter_(1, order, torch.arange(f * k, device=dev).expand(b, -1))  # rank by joint
        sel = (pos < remaining[:, None]) & (joint > 0)  # [B, F*k], flatten order = BFS order
        n_sel = sel.sum(-1)
        if int(n_sel.max()) == 0:
            break
        new_idx = count[:, None] + sel.long().cumsum(-1) - 1  # node index of each selected
        sb, sc = sel.nonzero(as_tuple=True)
        sf, sk = sc // k, sc % k
        tgt = new_idx[sb, sc]
        parent[sb, tgt] = front[sb, sf]
        tokens[sb, tgt] = cand_tok.view(b, f * k)[sb, sc]
        # Next frontier: the selected nodes, with their own state (= head d's output on
        # their parent) and joint probability.
        state_full = torch.zeros(b, f, h, dtype=states.dtype, device=dev)
        state_full[bi, fi] = states
        g = int(n_sel.max())
        slot = sel.long().cumsum(-1) - 1
        front = torch.full((b, g), -1, dtype=torch.long, device=dev)
        front[sb, slot[sb, sc]] = tgt
        front_joint = torch.zeros(b, g, device=dev)
        front_joint[sb, slot[sb, sc]] = joint[sb, sc]
        front_state = torch.zeros(b, g, h, dtype=states.dtype, device=dev)
        front_state[sb, slot[sb, sc]] = state_full[sb, sf]
        count = count + n_sel
    valid = torch.arange(n1, device=dev)[None, :] < count[:, None]
    return DraftTree(tokens=tokens, draft_probs=None, buffers=buffers_from_parents(parent, valid))


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
            trying = walking & ~moved & (child >= 0)
            x = tree_tokens[rows, child.clamp(min=0)]
            if q_rem is None:
                qvec = torch.nn.functional.one_hot(x, p.shape[-1]).float()
            else:
                qvec = q_rem / q_rem.sum(-1, keepdim=True).clamp(min=eps)
            qx = qvec[rows, x]
            trying &= qx > 0
            px = p[rows, x]
            u = torch.rand(b, generator=generator, device=dev)
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
