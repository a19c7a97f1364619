"""The offline replay of tree drafts (vllm_clover/benchmarks/replay_tree.py, replay_retrieval.replay_tree):
acceptance in a tree by hand, and the heads' trees of a whole sequence equal the proposer's
drafting from each committed prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_clover.benchmarks.replay_retrieval import accepted_length, replay_tree
from vllm_clover.benchmarks.replay_tree import clover_drafter, head_tree_tokens
from tests.unit.model.test_drafter import H, V, make_drafter
from vllm_clover.drafting.tree import expand_static_tree, get_tree

PROMPT = np.array([7, 8, 9])
ANSWER = np.array([1, 2, 3, 4, 5, 6, 7])  # answer[0] comes from prefill: 6 decode tokens

# root -> 10 (node 1), 2 (node 2); 2 -> 3 (node 3), 11 (node 4); 3 -> 4 (node 5)
TOKENS = [10, 2, 3, 11, 4]
PARENT = [-1, 0, 0, 2, 2, 3]


def test_accepted_length_follows_the_matching_branch() -> None:
    assert accepted_length(TOKENS, PARENT, np.array([2, 3, 4, 5])) == 3
    assert accepted_length(TOKENS, PARENT, np.array([2, 11, 4])) == 2
    assert accepted_length(TOKENS, PARENT, np.array([10, 2])) == 1
    assert accepted_length(TOKENS, PARENT, np.array([5])) == 0
    assert accepted_length(TOKENS, PARENT, np.array([2, 3])) == 2  # the answer ends first
    assert accepted_length([], [-1], np.array([1])) == 0


def test_replay_tree_counts_steps_rows_and_the_bonus() -> None:
    def draft(committed: np.ndarray):
        # the tree above on the first step (committed: prompt + 1), a lone wrong node after
        return (TOKENS, PARENT) if committed.size == PROMPT.size + 1 else ([99], [-1, 0])

    s = replay_tree(PROMPT, ANSWER, draft)
    # step 1 accepts 2, 3, 4 + bonus 5; then 6 and 7 one step each
    assert (s.steps, s.tokens, s.drafted, s.accepted) == (3, 6, 5 + 1 + 1, 3)
    assert s.tokens_per_step == 2.0


def test_clover_drafter_grafts_the_retrieval_chains() -> None:
    rows = np.zeros((PROMPT.size + ANSWER.size, 3), dtype=np.int64)
    rows[PROMPT.size - 1] = [1, 10, 2]  # row of committed = prompt + answer[0]
    committed = np.concatenate([PROMPT, ANSWER[:1]])
    seen = []

    def retrieve(context: np.ndarray, k: int) -> np.ndarray:
        seen.append((context.tolist(), k))
        return np.array([2, 3, 4])[:k] if context.size == committed.size else np.array([5, 6, 7])[:k]

    tokens, parent = clover_drafter(rows, [-1, 0, 0], retrieve, 3)(committed)
    # the root chain follows node 2 (token 2), then adds 3 and 4 below it
    assert tokens == [10, 2, 3, 4] and parent == (-1, 0, 0, 2, 3)
    seen.clear()
    tokens, parent = clover_drafter(rows, [-1, 0, 0], retrieve, 3, 2)(committed)
    # then 2 tokens under each leaf of the heads' tree, looked up after the leaf's path
    assert seen == [(committed.tolist(), 3), (committed.tolist() + [10], 2), (committed.tolist() + [2], 2)]
    assert tokens == [10, 2, 5, 3, 5, 6, 4, 6] and parent == (-1, 0, 0, 1, 2, 2, 3, 4, 5)
    assert clover_drafter(rows, [-1, 0, 0])(committed) == ([10, 2], (-1, 0, 0))


@pytest.mark.parametrize("tree_name", ["small_4", "wide_9", "chain3"])
def test_head_trees_of_a_sequence_equal_drafting_from_each_prefix(tree_name: str) -> None:
    """Row t of the whole-sequence computation is what the heads draft when ids[:t+2] are
    committed: the trunk over that prefix alone, the tree from its last row (the trunk is
    causal, so later tokens must not change it)."""
    drafter = make_drafter()
    tree = get_tree(tree_name)
    g = torch.Generator().manual_seed(3)
    length = 9
    x, ids = torch.randn(length, H, generator=g), torch.randint(0, V, (length,), generator=g)
    draft_ids = torch.randperm(V, generator=g)[:40]
    (rows,) = head_tree_tokens(drafter, x, ids, [tree], drafter.lm_head_weight, draft_ids)
    assert rows.shape == (length, tree.num_nodes + 1)
    weight = drafter.lm_head_weight[draft_ids]
    for t in range(length - 1):
        prefix, nxt = x[: t + 1], ids[1: t + 2]
        with torch.no_grad():
            z, _ = drafter.trunk(prefix[None], nxt[None])

            def head(state, prev, i):
                state, o = drafter.head_step(state, prev, i)
                return state, torch.nn.functional.linear(o, weight)

            def topk(logits, n):
                return draft_ids[logits.topk(n, dim=-1).indices], None

            want = expand_static_tree(head, z[0, -1:], ids[t + 1: t + 2], tree, topk).tokens[0]
        assert rows[t].tolist() == want.tolist(), t
        assert set(rows[t, 1:].tolist()) <= set(draft_ids.tolist())
