"""Prompt-lookup candidates grafted into Clover's token tree (``prompt_lookup_tokens``).

Why: a small model's answers repeat their prompt and themselves (on MT-Bench with
SmolLM2-135M vLLM's ngram drafter finds a match on about a quarter of the steps and then
accepts 2.2 drafts), while the heads guess at every step, where nothing repeats too. Both
kinds of candidates are chosen without the target, so one tree can hold both and the
target verifies them in the same pass, with the same lossless acceptance rule (one-hot drafts). The continuation below is
the one vLLM's ``NgramProposer`` drafts (same n-gram rule, tested against its function), so
a user gets "ngram and Clover at once" for the cost of a few more verified tokens, which is
nearly free while the target streams its weights (batch 1 on CPU; small batches on GPU).
The same idea as ArcticInference's suffix decoding next to its speculator.

Pure numpy, no vLLM import.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest
    suffix n-gram of ``tokens`` (``min_n <= n <= max_n``); empty when none occurs.

    tokens [L] int: a request's committed tokens (prompt + output, the root token last).
    The occurrence must end before the last token (it is not the suffix itself); the
    continuation starts right after it and may run into the suffix. Same rule as vLLM's
    ``ngram_proposer._find_longest_matched_ngram_and_propose_tokens`` (KMP there; a
    window comparison here: O(L * n) per n, microseconds for a few thousand tokens).
    """
    length = int(tokens.shape[0])
    if k <= 0 or length < max(min_n, 2):
        return tokens[:0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]: starts 0 .. L-1-n
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k]
    return tokens[:0]
