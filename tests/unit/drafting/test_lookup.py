"""Prompt-lookup continuations (vllm_clover/drafting/lookup.py) are exactly vLLM's ngram drafts."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from vllm_clover.drafting.lookup import graft_retrieval, leaf_token_paths, lookup_continuation, retrieval_chain


# Random cases over small alphabets (many repeats, overlapping matches, several n-gram
# sizes), answered by vLLM's own matcher in a subprocess: importing numba here would load
# llvmlite, whose lazy library wrapper then breaks vLLM's triton kernel dispatcher
# (triton_utils/dispatcher.py:_rebind_kernels scans every module's objects) for later
# tests in this process. Clover's engine never meets this: lookup.py does not use numba.
_VLLM_NGRAM = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as f
cases = json.load(sys.stdin)
print(json.dumps([f(np.array(t, dtype=np.int32), a, b, 1 << 20, k).tolist() for t, a, b, k in cases]))
"""


def test_equals_vllm_ngram_proposer_function() -> None:
    """Same tokens as vLLM's own n-gram matcher on 3,000 random sequences."""
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        cases.append((tokens, min_n, int(rng.integers(min_n, 6)), int(rng.integers(1, 6))))
    done = subprocess.run([sys.executable, "-c", _VLLM_NGRAM], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=600, check=True)
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [lookup_continuation(np.array(t, dtype=np.int32), a, b, k).tolist() for t, a, b, k in cases]
    assert ours == expected
    assert sum(bool(e) for e in expected) > 1500  # the comparison is not all empty continuations


@pytest.mark.parametrize("tokens,min_n,max_n,k,expected", [
    ([5, 6, 7, 8, 5, 6], 2, 4, 3, [7, 8, 5]),          # suffix "5 6" seen at 0: continue after it
    ([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 1, 3, 2, [9, 2]),  # longest n wins (3: "1 2 3" at 0)
    ([1, 2, 1, 2, 1, 2], 2, 2, 4, [1, 2, 1, 2]),        # earliest occurrence; may run into the suffix
    ([1, 2, 3, 4], 1, 3, 3, []),                        # nothing repeats
    ([7], 1, 3, 3, []),
    ([], 1, 3, 3, []),
    ([5, 6, 5, 6], 2, 4, 0, []),
])
def test_cases(tokens, min_n, max_n, k, expected) -> None:
    out = lookup_continuation(np.array(tokens, dtype=np.int64), min_n, max_n, k)
    assert out.tolist() == expected


def test_leaf_token_paths_in_node_order() -> None:
    # root -> 10, 2; 2 -> 3, 11; 3 -> 4: leaves 10, 11, 4
    assert leaf_token_paths([10, 2, 3, 11, 4], [-1, 0, 0, 2, 2, 3]) == [[10], [2, 11], [2, 3, 4]]
    assert leaf_token_paths([], [-1]) == []


def test_retrieval_chain_is_lookup_else_datastore(tmp_path) -> None:
    from vllm_clover.drafting.datastore import build_datastore

    store = build_datastore([[5, 6, 7]] * 5, vocab_size=16, max_order=2, min_count=5)
    assert retrieval_chain(np.array([5, 9, 3, 5, 9]), 3, 2, 4, store).tolist() == [3, 5, 9]  # the lookup
    assert retrieval_chain(np.array([1, 2, 5]), 3, 2, 4, store).tolist() == [6, 7]  # the datastore
    assert retrieval_chain(np.array([1, 2, 5]), 3, 2, 4, None).size == 0


def test_graft_retrieval_adds_at_most_its_budget_and_keeps_the_tree() -> None:
    """Random trees (siblings distinct, as top-k children are) and chains: the heads' paths
    stay, and at most root + leaf x leaves nodes are added."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 8))
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n + 1)]
        tokens: list[int] = []
        for i in range(1, n + 1):
            taken = {tokens[j - 1] for j in range(1, i) if parent[j] == parent[i]}
            tokens.append(int(rng.choice([t for t in range(8) if t not in taken])))
        committed = rng.integers(0, 6, 12)
        root_k, leaf_k = int(rng.integers(0, 5)), int(rng.integers(0, 3))

        def retrieve(context: np.ndarray, k: int) -> np.ndarray:
            return np.random.default_rng(int(context.sum()) + len(context)).integers(0, 6, int(rng.integers(0, k + 1)))

        out_tokens, out_parent = graft_retrieval(tokens, parent, committed, retrieve, root_k, leaf_k)
        before = leaf_token_paths(tokens, parent)
        assert len(out_tokens) - len(tokens) <= root_k + leaf_k * len(before)
        paths = {tuple(p) for p in _all_paths(out_tokens, out_parent)}
        assert {tuple(p) for p in _all_paths(tokens, parent)} <= paths
        assert all(p < i for i, p in enumerate(out_parent) if i)  # parents first (BFS)


def _all_paths(tokens, parent) -> list[list[int]]:
    paths: list[list[int]] = [[]]
    for n in range(1, len(parent)):
        paths.append(paths[parent[n]] + [int(tokens[n - 1])])
    return paths[1:]
