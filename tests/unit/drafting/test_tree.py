"""Tree structure, drafting, acceptance and compaction plan (vllm_clover/drafting/tree.py)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_clover.drafting.presets import MC_SIM_7B_63
from vllm_clover.drafting.tree import (PRESETS, StaticTree, accepted_kv_moves, buffers_from_parents,
                                       build_dynamic_tree, drafter_head_step_fn, dynamic_budget,
                                       expand_static_tree, get_tree, graft_chain, greedy_accept, greedy_topk,
                                       leaf_paths, positions_to_slots, sample_accept, sampling_topk,
                                       single_tree_buffers, tree_for_batch_size)

# The list from the brief, written out independently of the module's constant.
BRIEF_MC_SIM = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
ALL_TREES = ["mc_sim_7b_63", "small_10", "small_3", "small_4", "small_5", "wide_9", "chain1", "chain5"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ============================================================================ structure
def test_mc_sim_7b_63_shape():
    t = get_tree()
    assert t.name == "mc_sim_7b_63"
    assert [list(p) for p in t.paths] == BRIEF_MC_SIM  # already BFS-sorted
    assert list(MC_SIM_7B_63) == [tuple(p) for p in BRIEF_MC_SIM]
    assert t.num_nodes == 25
    assert t.nodes_per_depth == [1, 4, 8, 8, 3, 2]
    assert t.max_depth == 5
    assert [len(e) for e in t.expand_nodes] == [1, 4, 4, 1, 1]
    assert t.num_expanded == 11
    assert t.retrieve_paths.shape == (15, 6)
    assert t.ancestor_mask.shape == (26, 26)
    assert t.children.shape == (26, 4)  # the root has 4 children
    assert torch.equal(t.position_offsets, t.depth)


def test_presets_and_chain():
    assert set(PRESETS) == {"mc_sim_7b_63", "small_10", "small_3", "small_4", "small_5", "wide_9"}
    assert get_tree("small_4").nodes_per_depth == [1, 2, 2]
    assert get_tree("small_3").parent.tolist() == [-1, 0, 0, 1]
    assert get_tree("small_5").parent.tolist() == [-1, 0, 0, 0, 1, 2]
    assert get_tree("wide_9").nodes_per_depth == [1, 4, 5]
    assert get_tree("wide_9").parent.tolist() == [-1, 0, 0, 0, 0, 1, 1, 2, 3, 4]
    assert get_tree("small_10").nodes_per_depth == [1, 2, 3, 2, 2, 1]
    c = get_tree("chain3")
    assert c.paths == ((0,), (0, 0), (0, 0, 0))
    assert c.parent.tolist() == [-1, 0, 1, 2]
    assert c.retrieve_paths.tolist() == [[0, 1, 2, 3]]
    with pytest.raises(KeyError):
        get_tree("nope")
    with pytest.raises(ValueError):
        get_tree("chain0")


@pytest.mark.parametrize("paths, msg", [
    ([[0], [0, 1]], "contiguous"),
    ([[0], [1, 0]], "no parent"),
    ([[0], [0]], "duplicate"),
    ([[]], "empty"),
    ([[1]], "contiguous"),
])
def test_path_validation(paths, msg):
    with pytest.raises(ValueError, match=msg):
        StaticTree(paths)


def test_unsorted_paths_are_put_in_bfs_order():
    t = StaticTree([[1, 0], [0, 0], [1], [0]])
    assert t.paths == ((0,), (1,), (0, 0), (1, 0))
    assert t.parent.tolist() == [-1, 0, 0, 1, 2]
    assert t.rank.tolist() == [-1, 0, 1, 0, 0]


@pytest.mark.parametrize("name", ALL_TREES)
def test_bfs_order_every_prefix_is_ancestor_closed(name):
    t = get_tree(name)
    n1 = t.num_nodes + 1
    assert (t.depth[1:] - t.depth[:-1] >= 0).all()
    for n in range(1, n1):
        assert 0 <= t.parent[n] < n
    for prefix in range(1, n1 + 1):
        keep = set(range(prefix))
        for n in keep:
            anc = t.ancestor_mask[n].nonzero().flatten().tolist()
            assert set(anc) <= keep
    # Siblings contiguous and in rank order.
    for p in range(n1):
        kids = (t.parent == p).nonzero().flatten().tolist()
        if kids:
            assert kids == list(range(kids[0], kids[0] + len(kids)))
            assert t.rank[kids].tolist() == list(range(len(kids)))


@pytest.mark.parametrize("name", ALL_TREES)
def test_ancestor_mask_brute_force(name):
    t = get_tree(name)
    paths = [()] + list(t.paths)  # node 0 = root = empty path
    n1 = len(paths)
    for i in range(n1):
        for j in range(n1):
            expect = paths[i][: len(paths[j])] == paths[j]  # j's path is a prefix of i's
            assert bool(t.ancestor_mask[i, j]) == expect, (i, j)
    assert t.depth.tolist() == [len(p) for p in paths]
    assert t.rank.tolist() == [-1] + [p[-1] for p in t.paths]


@pytest.mark.parametrize("name", ALL_TREES)
def test_retrieve_paths_cover_every_leaf(name):
    t = get_tree(name)
    leaves = set(range(t.num_nodes + 1)) - set(t.parent[1:].tolist())
    rp = t.retrieve_paths
    assert rp.shape == (len(leaves), t.max_depth + 1)
    ends = []
    for row in rp.tolist():
        path = [n for n in row if n >= 0]
        assert row[len(path):] == [-1] * (len(row) - len(path))
        assert path[0] == 0
        for a, b in zip(path, path[1:]):
            assert t.parent[b] == a
        ends.append(path[-1])
    assert sorted(ends) == sorted(leaves)
    assert torch.equal(leaf_paths(t.parent), rp)


def test_buffers_from_parents_with_padding():
    # Two trees: request 0 has 4 draft nodes, request 1 has 2 (columns 3, 4 padded).
    parent = torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 1, 7, 7]])
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    b = buffers_from_parents(parent, valid)
    assert b.num_nodes.tolist() == [5, 3]
    assert b.parent[1].tolist() == [-1, 0, 1, -1, -1]
    assert b.depth.tolist() == [[0, 1, 1, 2, 2], [0, 1, 2, 0, 0]]
    assert b.rank.tolist() == [[-1, 0, 1, 0, 1], [-1, 0, 0, -1, -1]]
    assert b.children[0, 0].tolist() == [1, 2] and b.children[0, 1].tolist() == [3, 4]
    assert b.children[1, 0].tolist() == [1, -1]
    # Padded rows see only themselves; real rows never see padding.
    assert b.ancestor_mask[1, 3].tolist() == [False, False, False, True, False]
    assert not b.ancestor_mask[1, :3, 3:].any()
    assert b.ancestor_mask[1, 2].tolist() == [True, True, True, False, False]
    assert b.positions(torch.tensor([10, 20])).tolist() == [[10, 11, 11, 12, 12], [20, 21, 22, 20, 20]]
    with pytest.raises(ValueError, match="BFS"):
        buffers_from_parents(torch.tensor([[-1, 2, 0]]))


def test_single_tree_buffers_equal_the_batched_builder():
    rng = torch.Generator().manual_seed(5)
    for n1 in [1, 2, 5, 17, 40] * 20:
        parent = [-1] + [int(torch.randint(0, n, (1,), generator=rng)) for n in range(1, n1)]
        a, b = buffers_from_parents(torch.tensor([parent])), single_tree_buffers(parent)
        for field in ("parent", "depth", "rank", "valid", "ancestor_mask", "children", "num_nodes"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and torch.equal(x, y), (field, parent)
    for bad in ([-1, 2, 0], [0, 0], [-1, -1]):
        with pytest.raises(ValueError, match="BFS|root"):
            single_tree_buffers(bad)


def test_static_buffers_broadcast():
    t = get_tree()
    b = t.buffers(3)
    assert b.parent.shape == (3, 26) and b.ancestor_mask.shape == (3, 26, 26)
    assert torch.equal(b.ancestor_mask[2], t.ancestor_mask)
    assert b.max_depth == 5 and b.width == 26


# ============================================================================ budget schedule
def test_tree_for_batch_size_schedule():
    names = {bs: tree_for_batch_size(bs).name for bs in (1, 2, 4, 8, 16, 32, 64, 256)}
    assert names[1] == names[2] == "mc_sim_7b_63"
    assert names[4] == names[8] == "small_10"
    assert names[16] == "chain5" and names[64] == "chain1" and names[256] == "chain1"
    sizes = [tree_for_batch_size(bs).num_nodes for bs in range(1, 100)]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # never grows with the batch
    for bs in range(1, 33):  # within the token budget whenever a chain can fit
        assert bs * (tree_for_batch_size(bs).num_nodes + 1) <= 96
    assert tree_for_batch_size(4, num_heads=3).name == "chain3"  # deeper trees need more heads
    assert [dynamic_budget(bs) for bs in (1, 4, 16, 96, 500)] == [25, 23, 5, 1, 1]
    with pytest.raises(ValueError):
        tree_for_batch_size(0)


# ============================================================================ static drafting
V = 50


class FakeHeads:
    """Deterministic heads: the state is a running hash of the path, the top-1 token is
    (hash + depth) mod V and rank r is r steps further. Records every call."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    @staticmethod
    def new_state(state: float, tok: int) -> float:
        return (state * 31 + tok + 1) % 9973

    def __call__(self, state, prev_token, d):
        self.calls.append((d, state.shape[0]))
        s = (state * 31 + prev_token[:, None].double() + 1) % 9973
        base = (s[:, 0].long() + d) % V
        v = torch.arange(V)
        logits = -((v[None, :] - base[:, None]) % V).double()  # rank r token = base + r
        return s, logits


def expected_tokens(tree: StaticTree, z: float, root: int) -> list[int]:
    """Plain-Python recursion over the paths: what the fake heads must produce."""
    tok = {(): root}
    state_in = {(): z}  # the state the node is expanded with (its parent's head output)
    out = [root]
    for p in tree.paths:
        par = p[:-1]
        s = FakeHeads.new_state(state_in[par], tok[par])
        d = len(par)
        tok[p] = (int(s) + d + p[-1]) % V
        state_in[p] = s
        out.append(tok[p])
    return out


@pytest.mark.parametrize("name", ["mc_sim_7b_63", "small_10", "chain4"])
def test_expand_static_tree_fake_heads(name):
    tree = get_tree(name)
    z = torch.tensor([[3.0], [17.0], [123.0]], dtype=torch.float64)
    root = torch.tensor([5, 0, 49])
    heads = FakeHeads()
    dt = expand_static_tree(heads, z, root, tree)
    assert dt.tokens.shape == (3, tree.num_nodes + 1)
    assert dt.draft_probs is None
    for b in range(3):
        assert dt.tokens[b].tolist() == expected_tokens(tree, float(z[b]), int(root[b]))
    # One batched call per depth, over B x (expanded nodes of that depth) rows.
    assert heads.calls == [(d, 3 * len(e)) for d, e in enumerate(tree.expand_nodes)]


def test_expand_static_tree_sampling_probs():
    tree = get_tree()
    g = torch.Generator().manual_seed(0)
    heads = FakeHeads()
    dt = expand_static_tree(heads, torch.ones(2, 1, dtype=torch.float64), torch.tensor([1, 2]), tree,
                            topk_fn=sampling_topk(0.7, g))
    q = dt.draft_probs
    assert q.shape == (2, 26, V) and q.dtype == torch.float32
    has_kids = tree.children[:, 0] >= 0
    assert torch.allclose(q[:, has_kids].sum(-1), torch.ones(2, int(has_kids.sum())))
    assert (q[:, ~has_kids] == 0).all()
    for p in range(26):  # sampled without replacement: siblings distinct
        kids = (tree.parent == p).nonzero().flatten()
        for b in range(2):
            assert len(set(dt.tokens[b, kids].tolist())) == len(kids)


def test_sampling_topk_is_ordered_sampling_without_replacement():
    # P(first = i) = q_i; P(second = j | first = i) = q_j / (1 - q_i).
    q = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(1)
    n = 20000
    tok, qq = sampling_topk(1.0, g)(q.log().expand(n, 3), 2)
    assert torch.allclose(qq[0], q)
    assert (tok[:, 0] != tok[:, 1]).all()
    first = torch.bincount(tok[:, 0], minlength=3).float() / n
    assert (first - q).abs().sum() / 2 < 0.02
    sel = tok[:, 0] == 0
    second = torch.bincount(tok[sel, 1], minlength=3).float() / sel.sum()
    assert (second - torch.tensor([0.0, 0.6, 0.4])).abs().sum() / 2 < 0.02


def _tiny_drafter(num_heads: int = 5):
    from vllm_clover.model.config import CloverConfig
    from vllm_clover.model.drafter import CloverDrafter

    torch.manual_seed(0)
    cfg = CloverConfig(hidden_size=32, vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=48, num_heads=num_heads, num_layers=1)
    d = CloverDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return d.bind_target(torch.randn(64, 32)).eval()


def test_expand_static_tree_with_clover_drafter():
    d = _tiny_drafter()
    step = drafter_head_step_fn(d)
    z = torch.randn(3, 32)
    root = torch.tensor([1, 7, 9])
    chain, _ = d.draft_chain(z, root, 5)
    # A chain tree is exactly draft_chain.
    assert torch.equal(expand_static_tree(step, z, root, "chain5").tokens[:, 1:], chain)
    # The full tree: its top-1 spine is the chain, and the root's children are head 0's top-4.
    t = get_tree()
    dt = expand_static_tree(step, z, root, t)
    spine = [t.paths.index((0,) * k) + 1 for k in range(1, 6)]
    assert torch.equal(dt.tokens[:, spine], chain)
    _, o = d.head_step(z, root, 0)
    assert torch.equal(dt.tokens[:, 1:5], d.logits(o).topk(4).indices)
    # Node (1, 0): head 1 on the root's 2nd child, fed the state head 0 returned for z.
    s0, _ = d.head_step(z, root, 0)
    _, o1 = d.head_step(s0, dt.tokens[:, 2], 1)
    assert torch.equal(dt.tokens[:, t.paths.index((1, 0)) + 1], d.logits(o1).argmax(-1))


# ============================================================================ dynamic tree
def table_heads(tables: dict[tuple[int, int], list[float]], vocab: int = 8):
    """Heads whose distribution depends on (depth, previous token) via a table; the rest of
    the mass is spread thinly over the other tokens."""
    def step(state, prev_token, d):
        rows = []
        for t in prev_token.tolist():
            p = torch.full((vocab,), 1e-4)
            head = torch.tensor(tables.get((d, t), [1.0]))
            p[: len(head)] = head
            rows.append((p / p.sum()).log())
        return state + 1, torch.stack(rows)
    return step


def test_dynamic_tree_budget_and_joint_ranking():
    # The Clover-1 figure: budget 4, top_p 0.8. Depth 1: a=0.5, b=0.35 kept (c would start
    # past 0.8). Depth 2 candidates (joint): a->0 0.35, b->0 0.315, a->1 0.10: keep 2.
    step = table_heads({(0, 7): [0.5, 0.35, 0.1, 0.05], (1, 0): [0.7, 0.2, 0.1], (1, 1): [0.9, 0.05, 0.05]})
    dt = build_dynamic_tree(step, torch.zeros(1, 4), torch.tensor([7]), budget=4, max_depth=5, top_p=0.8)
    b = dt.buffers
    assert dt.tokens[0].tolist() == [7, 0, 1, 0, 0]
    assert b.parent[0].tolist() == [-1, 0, 0, 1, 2]
    assert b.depth[0].tolist() == [0, 1, 1, 2, 2]
    assert b.num_nodes.tolist() == [5]
    assert dt.draft_probs is None


def test_dynamic_tree_token_level_rules():
    # Depth 1 only (max_depth=1), big budget: isolates the per-parent rules.
    table = {(0, 3): [0.6, 0.14, 0.13, 0.13]}  # 0.14 < 0.6/4: every sibling after a is cut
    dt = build_dynamic_tree(table_heads(table), torch.zeros(1, 4), torch.tensor([3]), budget=8,
                            max_depth=1, top_p=0.95)
    assert dt.buffers.num_nodes.tolist() == [2] and dt.tokens[0, :2].tolist() == [3, 0]
    table = {(0, 3): [0.4, 0.3, 0.2, 0.1]}  # ratio ok (0.1 = 0.4/4); top_p 0.85 stops after 0.2
    dt = build_dynamic_tree(table_heads(table), torch.zeros(1, 4), torch.tensor([3]), budget=8,
                            max_depth=1, top_p=0.85)
    assert dt.tokens[0, : int(dt.buffers.num_nodes[0])].tolist() == [3, 0, 1, 2]
    dt = build_dynamic_tree(table_heads(table), torch.zeros(1, 4), torch.tensor([3]), budget=8,
                            max_depth=1, top_p=0.99, max_children=2)
    assert dt.buffers.num_nodes.tolist() == [3]


def test_dynamic_tree_over_a_reduced_vocabulary_equals_the_masked_full_one():
    """Heads scoring a draft vocabulary (columns = vocab_ids) build the same tree as heads
    scoring the whole vocabulary with -inf outside it."""
    g = torch.Generator().manual_seed(3)
    vocab, ids = 50, torch.tensor([4, 9, 17, 23, 31, 40, 44, 49])
    weights = [torch.randn(vocab, generator=g) * 3 for _ in range(4)]

    def sub(state, prev, d):
        return state + 1, torch.stack([weights[d][ids] + 0.1 * float(t % 7) for t in prev.tolist()])

    def full(state, prev, d):
        state, logits = sub(state, prev, d)
        out = torch.full((logits.shape[0], vocab), float("-inf"))
        out[:, ids] = logits
        return state, out

    z, roots = torch.zeros(2, 4), torch.tensor([1, 2])
    a = build_dynamic_tree(sub, z, roots, budget=6, max_depth=4, top_p=0.95, vocab_ids=ids)
    b = build_dynamic_tree(full, z, roots, budget=6, max_depth=4, top_p=0.95)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.buffers.parent, b.buffers.parent)
    assert int(a.buffers.num_nodes.min()) > 2  # a real tree, not just the root and one child


def test_dynamic_tree_batched_padding_matches_single():
    step = table_heads({(0, 1): [0.5, 0.35, 0.1, 0.05], (1, 0): [0.7, 0.2, 0.1], (1, 1): [0.9, 0.05, 0.05],
                        (0, 2): [0.97], (2, 0): [0.6, 0.4]})
    roots = torch.tensor([1, 2])
    z = torch.zeros(2, 4)
    both = build_dynamic_tree(step, z, roots, budget=6, max_depth=5, top_p=0.9)
    assert both.tokens.shape == (2, 7)
    for i in range(2):
        one = build_dynamic_tree(step, z[i : i + 1], roots[i : i + 1], budget=6, max_depth=5, top_p=0.9)
        n = int(one.buffers.num_nodes[0])
        assert int(both.buffers.num_nodes[i]) == n
        assert torch.equal(both.tokens[i, :n], one.tokens[0, :n])
        assert torch.equal(both.buffers.parent[i, :n], one.buffers.parent[0, :n])
        assert (both.buffers.parent[i, n:] == -1).all() and not both.buffers.valid[i, n:].any()
    assert int(both.buffers.num_nodes.max()) <= 7
    # Per-depth budget: no tree exceeds the budget, and BFS order holds.
    for i in range(2):
        d = both.buffers.depth[i, : int(both.buffers.num_nodes[i])]
        assert (d[1:] >= d[:-1]).all()


# ============================================================================ greedy acceptance
def _mc_tokens(b: int = 1) -> torch.Tensor:
    return (100 + torch.arange(26)).expand(b, 26).clone()  # distinct token per node


def _argmax_along(path: list[int], end_token: int) -> torch.Tensor:
    """Target argmax that follows ``path`` (node indices after the root) then emits end_token."""
    am = torch.full((26,), 999)
    nodes = [0] + path
    for a, b in zip(nodes, nodes[1:]):
        am[a] = 100 + b
    am[nodes[-1]] = end_token
    return am


@pytest.mark.parametrize("path, expect_nodes", [
    ([], [0, -1, -1, -1, -1, -1]),                   # nothing matches
    ([1, 5, 13], [0, 1, 5, 13, -1, -1]),
    ([3, 10], [0, 3, 10, -1, -1, -1]),               # through a rank-2 child
    ([1, 5, 13, 21, 25], [0, 1, 5, 13, 21, 25]),     # full depth
])
def test_greedy_accept_hand_cases(path, expect_nodes):
    t = get_tree()
    am = _argmax_along(path, 7)[None]
    r = greedy_accept(_mc_tokens(), am, t.buffers(1))
    assert r.accepted_nodes[0].tolist() == expect_nodes
    assert r.num_accepted.tolist() == [len(path)]
    assert r.bonus.tolist() == [7]
    assert r.output_tokens[0].tolist() == [100 + n for n in path] + [7] + [-1] * (5 - len(path))


def test_greedy_accept_matches_python_walk():
    # Random tokens over a 3-token vocab so that matches (and sibling ties) are common.
    t = get_tree()
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 3, (200, 26), generator=g)
    am = torch.randint(0, 3, (200, 26), generator=g)
    r = greedy_accept(tok, am, t.buffers(200))
    kids = [[c for c in range(26) if t.parent[c] == p] for p in range(26)]
    for b in range(200):
        # Deepest reachable node, lowest index on ties (BFS search).
        best, frontier = 0, [0]
        while frontier:
            nxt = [c for n in frontier for c in kids[n] if tok[b, c] == am[b, n]]
            if nxt:
                best = min(nxt)
            frontier = nxt
        assert int(r.accepted_nodes[b, int(t.depth[best])]) == best
        assert int(r.num_accepted[b]) == int(t.depth[best])
        assert int(r.bonus[b]) == int(am[b, best])


def test_greedy_accept_never_takes_padding():
    parent = torch.tensor([[-1, 0, 0, 0]])
    valid = torch.tensor([[True, True, False, False]])
    buf = buffers_from_parents(parent, valid)
    tok = torch.tensor([[5, 8, 9, 9]])
    am = torch.tensor([[9, 4, 4, 4]])  # would match padded node 2
    r = greedy_accept(tok, am, buf)
    assert r.num_accepted.tolist() == [0] and r.bonus.tolist() == [9]
    s = sample_accept(tok, torch.nn.functional.one_hot(am, 10).float(), buf)
    assert s.num_accepted.tolist() == [0] and s.bonus.tolist() == [9]
    assert s.output_tokens.tolist() == [[9, -1]]


# ============================================================================ lossless sampling
VS = 6
SMALL_TREE = StaticTree([[0], [1], [2], [0, 0], [0, 1], [1, 0]])  # root: 3 candidates


def _dists(seed: int):
    g = torch.Generator().manual_seed(seed)
    def d(*shape):
        x = torch.rand(*shape, VS, generator=g) ** 2 + 0.02
        return x / x.sum(-1, keepdim=True)
    return d(), d(VS), d(), d(VS)  # P1 target root, P2[a] target after a, Q1, Q2[a]


def _run_lossless(n: int, sampled: bool, seed: int = 0):
    """n independent trials in one batch: draft a tree, then sample_accept."""
    p1, p2, q1, q2 = _dists(seed)
    p3 = torch.full((VS,), 1.0 / VS)

    def heads(state, prev, d):
        logits = q1.log().expand(state.shape[0], VS) if d == 0 else q2[prev].log()
        return state, logits

    g = torch.Generator().manual_seed(seed + 1)
    topk = sampling_topk(1.0, g) if sampled else greedy_topk
    dt = expand_static_tree(heads, torch.zeros(n, 1), torch.zeros(n, dtype=torch.long), SMALL_TREE, topk)
    depth = SMALL_TREE.depth
    tp = torch.empty(n, 7, VS)
    tp[:, 0] = p1
    tp[:, depth == 1] = p2[dt.tokens[:, depth == 1]]
    tp[:, depth == 2] = p3
    r = sample_accept(dt.tokens, tp, dt.buffers, dt.draft_probs, generator=g)
    return r, dt, p1, p2


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=VS).float() / len(samples)
    return float((freq - p).abs().sum() / 2)


@pytest.mark.parametrize("sampled", [True, False], ids=["q-sampled", "one-hot-topk"])
def test_sample_accept_is_lossless(sampled):
    """First token ~ P1 and, when the first token was an accepted draft a, the second ~ P2[a].
    Bound: TV < 0.02 over 20k trials (the sampling noise is ~0.007 for 6 tokens)."""
    n = 20000
    r, dt, p1, p2 = _run_lossless(n, sampled)
    out = r.output_tokens
    assert ((out >= 0).sum(-1) == r.num_accepted + 1).all()
    assert _tv(out[:, 0], p1) < 0.02
    # Power check: the drafts themselves are far from P1, so the bound is meaningful.
    assert _tv(dt.tokens[:, 1], p1) > 0.1
    assert 0.2 < r.num_accepted.float().mean() < 2.0
    checked = 0
    for a in range(VS):
        sel = (r.num_accepted >= 1) & (out[:, 0] == a)
        if int(sel.sum()) >= 2000:
            bound = 3 * math.sqrt(VS / int(sel.sum()))  # ~3x the expected TV noise
            assert _tv(out[sel, 1], p2[a]) < bound, a
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize("sampled", [True, False], ids=["q-sampled", "one-hot-topk"])
def test_sample_accept_lossless_peaked_draft(sampled):
    """A draft peaked where the target is low: the renormalisation of q after each rejected
    sibling matters most here (skipping it biases the first token by TV ~0.17).
    100k trials, TV < 0.01 (expected sampling noise ~0.002)."""
    n = 100000
    q1 = torch.tensor([0.6, 0.25, 0.1, 0.03, 0.01, 0.01])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.1, 0.1])

    def heads(state, prev, d):
        return state, q1.log().expand(state.shape[0], VS)

    g = torch.Generator().manual_seed(0)
    dt = expand_static_tree(heads, torch.zeros(n, 1), torch.zeros(n, dtype=torch.long), SMALL_TREE,
                            sampling_topk(1.0, g) if sampled else greedy_topk)
    tp = torch.full((n, 7, VS), 1.0 / VS)
    tp[:, 0] = p1
    r = sample_accept(dt.tokens, tp, dt.buffers, dt.draft_probs, generator=g)
    assert _tv(r.output_tokens[:, 0], p1) < 0.01


def test_sample_accept_wrong_q_is_detected():
    """Negative control: telling sample_accept the wrong q (uniform) for q-sampled drafts
    must break losslessness visibly, so the bound above has power."""
    n = 20000
    p1, _, q1, q2 = _dists(0)
    r, dt, p1, _ = _run_lossless(n, True)
    wrong = torch.full_like(dt.draft_probs, 1.0 / VS)
    tp = torch.empty(n, 7, VS)
    tp[:] = p1  # only the first token matters here
    g = torch.Generator().manual_seed(5)
    bad = sample_accept(dt.tokens, tp, dt.buffers, wrong, generator=g)
    assert _tv(bad.output_tokens[:, 0], p1) > 0.04


def test_sample_accept_identical_draft_always_accepts_and_is_deterministic():
    n = 500
    _, _, q1, q2 = _dists(3)

    def heads(state, prev, d):
        return state, (q1.log().expand(state.shape[0], VS) if d == 0 else q2[prev].log())

    g = torch.Generator().manual_seed(0)
    dt = expand_static_tree(heads, torch.zeros(n, 1), torch.zeros(n, dtype=torch.long), SMALL_TREE,
                            sampling_topk(1.0, g))
    tp = torch.empty(n, 7, VS)
    tp[:, 0] = q1
    d1 = SMALL_TREE.depth == 1
    tp[:, d1] = q2[dt.tokens[:, d1]]
    tp[:, SMALL_TREE.depth == 2] = 1.0 / VS
    r = sample_accept(dt.tokens, tp, dt.buffers, dt.draft_probs, generator=torch.Generator().manual_seed(9))
    # p == q at the root: the first candidate is always accepted.
    assert (r.accepted_nodes[:, 1] == 1).all()
    again = sample_accept(dt.tokens, tp, dt.buffers, dt.draft_probs, generator=torch.Generator().manual_seed(9))
    assert torch.equal(r.output_tokens, again.output_tokens)


def test_sample_accept_one_hot_target_matches_greedy():
    # A one-hot target makes sampling deterministic: it must agree with greedy_accept.
    # Sibling tokens are distinct, as top-k / without-replacement drafting guarantees
    # (with duplicates greedy picks the deepest path, sampling the first sibling).
    t = get_tree()
    g = torch.Generator().manual_seed(0)
    offset = torch.randint(0, 4, (100, 26), generator=g)
    tok = (offset[:, t.parent.clamp(min=0)] + t.rank.clamp(min=0)) % 4
    am = torch.randint(0, 4, (100, 26), generator=g)
    tp = torch.nn.functional.one_hot(am, 4).float()
    s = sample_accept(tok, tp, t.buffers(100), generator=g)
    gr = greedy_accept(tok, am, t.buffers(100))
    assert torch.equal(s.output_tokens, gr.output_tokens)
    assert torch.equal(s.accepted_nodes, gr.accepted_nodes)


# ============================================================================ compaction plan
def test_accepted_kv_moves_examples():
    acc = torch.tensor([[0, 2, 8, 20, -1, -1],   # root -> 2 -> 8 -> 20 (dst of one = src of next)
                        [0, 1, 5, 13, 21, 25],
                        [0, -1, -1, -1, -1, -1],  # nothing accepted: nothing moves
                        [0, 1, 2, -1, -1, -1]])   # already contiguous (a chain)
    src, dst = accepted_kv_moves(acc, torch.tensor([14, 3, 7, 0]))
    assert src.tolist() == [[16, 22, 34, -1, -1], [-1, 8, 16, 24, 28], [-1] * 5, [-1] * 5]
    assert dst.tolist() == [[15, 16, 17, -1, -1], [-1, 5, 6, 7, 8], [-1] * 5, [-1] * 5]


def test_positions_to_slots():
    bt = torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32)
    pos = torch.tensor([[0, 15, 16, 40, -1], [5, 17, 33, -1, -1]])
    assert positions_to_slots(pos, bt, 16).tolist() == [[48, 63, 0, 88, -1], [21, 33, 65, -1, -1]]


def test_compaction_plan_applied_to_a_list():
    """Simulate a flat cache of node ids: after the moves, positions root..root+a read the
    accepted path in depth order, whatever the order the (gather-then-scatter) copy uses."""
    t = get_tree()
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        leaf = t.retrieve_paths[int(torch.randint(0, 15, (1,), generator=g))]
        a = int(torch.randint(0, int((leaf >= 0).sum()), (1,), generator=g))
        acc = torch.cat((leaf[: a + 1], torch.full((5 - a,), -1)))[None]
        root = int(torch.randint(0, 40, (1,), generator=g))
        cache = torch.arange(100)
        cache[root : root + 26] = 1000 + torch.arange(26)
        src, dst = accepted_kv_moves(acc, torch.tensor([root]))
        ok = src >= 0
        cache[dst[ok]] = cache[src[ok]].clone()
        assert cache[root : root + a + 1].tolist() == [1000 + int(n) for n in leaf[: a + 1]]
        assert cache[:root].tolist() == list(range(root))


# ============================================================================ grafting
SMALL_4_TOKENS = [10, 11, 12, 13]  # node 1 = 10 (rank 0), 2 = 11 (rank 1), 3 = 12 (child of 1), 4 = 13 (of 2)


@pytest.mark.parametrize("chain,tokens,parent", [
    ([10, 12, 14], [10, 11, 12, 13, 14], (-1, 0, 0, 1, 2, 3)),       # follows the spine, adds depth 3
    ([11, 20], [10, 11, 12, 13, 20], (-1, 0, 0, 1, 2, 2)),           # second child of node 2
    ([30, 31], [10, 11, 30, 12, 13, 31], (-1, 0, 0, 0, 1, 2, 3)),    # new root branch, relabelled BFS
    ([10, 12], SMALL_4_TOKENS, (-1, 0, 0, 1, 2)),                    # already in the tree
    ([], SMALL_4_TOKENS, (-1, 0, 0, 1, 2)),
])
def test_graft_chain_hand_cases(chain, tokens, parent) -> None:
    small4 = tuple(get_tree("small_4").parent.tolist())
    assert graft_chain(SMALL_4_TOKENS, small4, chain) == (tokens, parent)


def _root_paths(tokens: list[int], parent: tuple[int, ...]) -> set[tuple[int, ...]]:
    paths = {0: ()}
    for n in range(1, len(parent)):
        paths[n] = paths[parent[n]] + (tokens[n - 1],)
    return set(paths.values())


@pytest.mark.parametrize("name", ALL_TREES)
def test_graft_chain_properties(name) -> None:
    """Random trees and chains over a 3-token alphabet: the result is in BFS order, holds
    the chain as a root path and every path of the tree, adds only the missing nodes, and
    keeps the tree's top-1 spine as a prefix of the new one (the lookup branch ranks
    last among its siblings)."""
    from vllm_clover.engine.tree_verify import spine

    tree = get_tree(name)
    parent = tuple(tree.parent.tolist())
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens = torch.randint(0, 3, (tree.num_nodes,), generator=g).tolist()
        chain = torch.randint(0, 3, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
        new_tokens, new_parent = graft_chain(tokens, parent, chain)
        buffers = buffers_from_parents(torch.tensor([new_parent]))  # raises unless parent[n] < n
        depth = buffers.depth[0].tolist()
        assert depth == sorted(depth)
        before, after = _root_paths(tokens, parent), _root_paths(new_tokens, new_parent)
        assert before | {tuple(chain[:i]) for i in range(len(chain) + 1)} == after
        # A node per new path at least (more only below duplicate siblings, which real top-k
        # children never are: the chain follows the first match), never more than the chain.
        assert len(after - before) <= len(new_tokens) - len(tokens) <= len(chain)
        old_spine = [tokens[n - 1] for n in spine(list(parent))]
        assert [new_tokens[n - 1] for n in spine(list(new_parent))][: len(old_spine)] == old_spine


def test_grafted_branch_is_accepted_by_greedy_verification() -> None:
    """A target that follows the grafted chain accepts all of it (and its bonus)."""
    small4 = tuple(get_tree("small_4").parent.tolist())
    tokens, parent = graft_chain(SMALL_4_TOKENS, small4, [30, 31, 32])
    n1 = len(parent)
    argmax = torch.zeros(1, n1, dtype=torch.long)
    walk = {0: 30}
    for n in range(1, n1):  # at each node of the chain the target predicts the next chain token
        if tokens[n - 1] in (30, 31):
            walk[n] = tokens[n - 1] + 1
    for n, t in walk.items():
        argmax[0, n] = t
    argmax[0, [n for n in range(1, n1) if tokens[n - 1] == 32]] = 99
    result = greedy_accept(torch.tensor([[0, *tokens]]), argmax, buffers_from_parents(torch.tensor([parent])))
    assert result.num_accepted.tolist() == [3] and result.bonus.tolist() == [99]
