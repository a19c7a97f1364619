"""Prompt-lookup candidates grafted into Clover's token tree (``prompt_lookup_tokens``).

Why: a small model's answers repeat their prompt and themselves (on MT-Bench with
SmolLM2-135M vLLM's ngram drafter finds a match on about a quarter of the steps and then
accepts 2.2 drafts), while the heads guess at every step, where nothing repeats too. Both
kinds of candidates are chosen without the target, so one tree can hold both and the
target verifies them in the same pass, with the same lossless acceptance rule (one-hot
drafts). The continuation below is the one vLLM's ``NgramProposer`` drafts (same n-gram rule,
tested against its function), so a user gets "ngram and Clover at once" for the cost of a few more verified tokens, which is
nearly free while the target streams its weights (batch 1 on CPU; small batches on GPU).
The same idea as ArcticInference's suffix decoding next to its speculator.

Pure numpy (and tree.graft_chain), no vLLM import.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from vllm_clover.drafting.tree import graft_chain


def lookup_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest
    suffix n-gram of ``tokens`` (``min_n <= n <= max_n``); empty when none occurs.

    tokens [L] int: a request's committed tokens (prompt + output, the root token last).
    The occurrence must end before the last token (it is not the suffix itself); the
    continuation starts right after it and may run into the suffix. Same rule as vLLM's
    ``ngram_proposer._find_longest_matched_ngram_and_propose_tokens`` (KMP there). Here:
    the candidate occurrences end where the last token recurs; each is extended backwards
    token by token, so one pass over ``tokens`` and then work per candidate (about a third
    of the cost of a window comparison per n; it runs 6 times a step with leaf lookups).
    """
    length = int(tokens.shape[0])
    top = min(max_n, length - 1)
    if k <= 0 or length < max(min_n, 2) or top < min_n:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C] candidate last positions
    matched = np.ones(ends.size, dtype=np.int64)  # [C] suffix tokens matched, backwards from each end
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, top):
        alive &= ends >= j
        alive[alive] = tokens[ends[alive] - j] == tokens[length - 1 - j]
        matched += alive
    for n in range(top, min_n - 1, -1):
        hits = np.flatnonzero(matched >= n)
        if hits.size:
            start = int(ends[hits[0]]) + 1
            return tokens[start:start + k]
    return tokens[:0]


def retrieval_chain(tokens: np.ndarray, k: int, min_n: int, max_n: int, datastore=None,
                    min_confidence: float = 0.0) -> np.ndarray:
    """The proposer's retrieval draft after ``tokens`` [L]: up to ``k`` tokens of the prompt
    lookup (:func:`lookup_continuation`), else of ``datastore`` (a ``datastore.NgramDatastore``
    or None) while its confidence is at least ``min_confidence``."""
    chain = lookup_continuation(tokens, min_n, max_n, k)
    if not chain.size and datastore is not None:
        chain = datastore.continuation(tokens, k, min_confidence)
    return chain


def leaf_token_paths(tokens: Sequence[int], parent: Sequence[int]) -> list[list[int]]:
    """The token path from the root to each leaf of a tree, leaves in node order.

    tokens [N]: nodes 1..N; parent [N+1]: BFS parent pointers (root -1, parents first).
    ``tree.leaf_paths`` is its node-index twin (verification's retrieve indices, a padded
    tensor); this one works on the per-request Python lists of the drafting hot path."""
    paths: list[list[int]] = [[]]
    for n in range(1, len(parent)):
        paths.append(paths[parent[n]] + [int(tokens[n - 1])])
    inner = set(int(p) for p in parent[1:])
    return [paths[n] for n in range(1, len(parent)) if n not in inner]


def graft_retrieval(tokens: Sequence[int], parent: Sequence[int], committed: np.ndarray,
                    retrieve: Callable[[np.ndarray, int], np.ndarray], root_tokens: int,
                    leaf_tokens: int = 0) -> tuple[list[int], tuple[int, ...]]:
    """A request's heads tree with retrieval chains grafted in (``tree.graft_chain``).

    tokens [N], parent [N+1]: the heads' tree, siblings distinct (top-k children are: a leaf's
    path then names one node); committed [L]: the request's tokens, the root last; ``retrieve(context, k)``: up to k draft tokens after ``context`` (e.g.
    :func:`retrieval_chain`). Grafts the chain after ``committed`` (up to ``root_tokens``)
    from the root, then under each leaf of the heads' tree the chain after ``committed`` +
    the leaf's path (up to ``leaf_tokens`` each).

    Why the leaves: where the heads guess the next tokens right, the retrieval that follows
    them often guesses further; the heads' tree is two tokens deep and the lookup from the
    root alone cannot continue a path it did not start (docs/tree-verification.md, "Leaf
    lookup"). At most ``root_tokens + leaf_tokens * leaves`` nodes are added."""
    leaves = leaf_token_paths(tokens, parent) if leaf_tokens > 0 else []
    out_tokens, out_parent = list(tokens), tuple(parent)
    if root_tokens > 0:
        out_tokens, out_parent = graft_chain(out_tokens, out_parent, retrieve(committed, root_tokens).tolist())
    for path in leaves:
        chain = retrieve(np.concatenate([committed, np.asarray(path, dtype=committed.dtype)]), leaf_tokens)
        if chain.size:
            out_tokens, out_parent = graft_chain(out_tokens, out_parent, path + chain.tolist())
    return out_tokens, out_parent
