"""Prompt-lookup continuations (vllm_clover/lookup.py) are exactly vLLM's ngram drafts."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_clover.lookup import lookup_continuation


def test_equals_vllm_ngram_proposer_function() -> None:
    """Same tokens as vLLM's own n-gram matcher on 5,000 random sequences over small
    alphabets (many repeats, overlapping matches, several n-gram sizes)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_ngram

    rng = np.random.default_rng(0)
    found = 0
    for _ in range(5000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 40))).astype(np.int32)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        ours = lookup_continuation(tokens, min_n, max_n, k)
        np.testing.assert_array_equal(ours, vllm_ngram(tokens, min_n, max_n, 1 << 20, k))
        found += ours.size > 0
    assert found > 2500  # the comparison is not all empty continuations


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
