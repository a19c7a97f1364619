"""Static tree presets, as plain data.

Each preset lists its draft nodes as top-k paths from the root: ``(0, 2)`` is the 3rd child
of the top-1 child (the root is implicit). ``tree.StaticTree`` validates a list and sorts it
into BFS order; ``tree.get_tree(name)`` builds a preset by name, and also ``chain<K>`` (the
top-1 chain of K drafts), which is not listed here. Which preset serves where:
vllm_clover/serve_defaults.py.
"""

from __future__ import annotations

Paths = tuple[tuple[int, ...], ...]

PRESETS: dict[str, Paths] = {
    # EAGLE-1's sparse tree, reused by Clover-2 (arXiv 2408.00264): 25 nodes + root,
    # 4/8/8/3/2 nodes per depth, 15 leaves, 11 expanded nodes (1/4/4/1/1 per depth).
    "mc_sim_7b_63": (
        (0,), (1,), (2,), (3,),
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
        (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
    ),
    # 10 nodes for medium batches (not from a paper): the top-1 spine to depth 5 plus the
    # most useful second choices near the root; 2/3/2/2/1 nodes per depth.
    "small_10": (
        (0,), (1,),
        (0, 0), (0, 1), (1, 0),
        (0, 0, 0), (0, 0, 1),
        (0, 0, 0, 0), (0, 0, 0, 1),
        (0, 0, 0, 0, 0),
    ),
    # Trees for compute-bound targets (CPUs), where every verified row costs real compute and
    # the depth-1 alternatives carry most of a tree's gain (docs/tree-verification.md).
    # small_4: the top-2 first tokens, each followed by its top-1 child; small_3: small_4 less
    # the second first token's child; small_5: small_4 plus the third first token. In float32
    # each row costs its FMAs (~0.8 ms, docs/cpu-linear.md) and 14 rows fit one register tile
    # of the linear kernel, so the rows a smaller tree saves go to lookup tokens. Replayed:
    # small_3 + 10 and small_5 + 8 lookup tokens 2.74 / 2.77 tokens per step against 2.54 for
    # small_4 + 5 (docs/results/*-fp32-14-rows.md).
    "small_3": ((0,), (1,), (0, 0)),
    "small_4": ((0,), (1,), (0, 0), (1, 0)),
    "small_5": ((0,), (1,), (2,), (0, 0), (1, 0)),
    # wide_9, two heads deep: the top-4 first tokens, each with its top-1 child, and the top-1
    # first token's second child; 4/5 nodes per depth. Drafting costs the same two batched head
    # calls as small_4 (depth, not width, sets their number); it pays where verified rows are
    # cheap (bf16 on AMX). Replayed: 3.05 tokens per step against small_4's 2.84 with 16 lookup
    # tokens (docs/results/*-wide-tree-leaf-lookup.md).
    "wide_9": ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (2, 0), (3, 0)),
}
DEFAULT_TREE = "mc_sim_7b_63"
MC_SIM_7B_63: Paths = PRESETS[DEFAULT_TREE]
