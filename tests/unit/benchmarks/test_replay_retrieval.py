"""The offline retrieval replay (vllm_clover/benchmarks/replay_retrieval.py): step counting by hand."""

from __future__ import annotations

import numpy as np

from vllm_clover.benchmarks.replay_retrieval import make_drafter, replay
from vllm_clover.drafting.datastore import build_datastore, save_datastore

PROMPT = np.array([7, 8, 9])
ANSWER = np.array([1, 2, 3, 4, 5, 6, 7])  # answer[0] comes from prefill: 6 decode tokens


def test_no_drafts_is_one_token_per_step() -> None:
    s = replay(PROMPT, ANSWER, lambda committed: committed[:0])
    assert (s.steps, s.tokens, s.drafted, s.accepted) == (6, 6, 0, 0)
    assert s.tokens_per_step == 1.0


def test_oracle_drafts_of_k_tokens_give_k_plus_one_per_step() -> None:
    seq = np.concatenate([PROMPT, ANSWER])
    k = 2
    s = replay(PROMPT, ANSWER, lambda c: seq[c.size:c.size + k])
    # steps commit 3 + 3 tokens: [2, 3, 4] then [5, 6, 7]
    assert (s.steps, s.tokens, s.accepted) == (2, 6, 4)
    assert s.tokens_per_step == 3.0


def test_partial_match_accepts_the_prefix_and_adds_the_bonus() -> None:
    def drafter(committed: np.ndarray) -> np.ndarray:
        # right first guess, wrong second guess, on the first step only
        return np.array([2, 99, 4]) if committed.size == PROMPT.size + 1 else committed[:0]

    s = replay(PROMPT, ANSWER, drafter)
    # step 1 commits [2, 3] (1 accepted + bonus), then 4 single-token steps
    assert (s.steps, s.tokens, s.drafted, s.accepted) == (5, 6, 3, 1)


def test_drafts_past_the_answer_end_are_not_counted() -> None:
    seq = np.concatenate([PROMPT, ANSWER])
    s = replay(PROMPT, ANSWER, lambda c: np.concatenate([seq[c.size:], [0, 0, 0]]))
    assert (s.steps, s.tokens, s.drafted, s.accepted) == (1, 6, 6, 6)


def test_lookup_else_datastore_drafter(tmp_path) -> None:
    # The datastore knows 5 -> 6 -> 7; the prompt lookup finds nothing in [7, 8, 9, 1, ...].
    path = tmp_path / "ds.npz"
    save_datastore(build_datastore([[5, 6, 7]] * 5, vocab_size=16, max_order=2, min_count=5), path)
    both = make_drafter(f"lookup+{path}", 3, 2, 4, 0.2, 16)
    assert both(np.array([1, 2, 5])).tolist() == [6, 7]
    # A repeated bigram: the lookup's continuation wins over the datastore.
    assert both(np.array([5, 9, 3, 5, 9])).tolist() == [3, 5, 9]
    assert make_drafter("lookup", 3, 2, 4, 0.2, 16)(np.array([1, 2, 5])).size == 0
    assert make_drafter(str(path), 3, 2, 4, 0.2, 16)(np.array([5, 9, 3, 5, 6])).tolist() == [7]
