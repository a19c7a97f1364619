"""Retrieval drafts from an n-gram datastore (the ``datastore`` option).

Why: on MT-Bench with SmolLM2-135M the prompt lookup (lookup.py) finds a repeated n-gram
on only about a quarter of the steps; the rest of its verify slots go unused. Answers of
chat models share a lot of phrasing ("Here are some tips", "it is important to"), so a
table built once from a corpus of answers (REST, He et al. 2024, with an n-gram table in
place of a suffix array) guesses the next few tokens at every step, without the target.
Replayed on the default model's greedy answers: 1.66 tokens per step with prompt lookup
alone, 2.07 with prompt lookup else this datastore (docs/datastore.md).
The datastore's chain fills the lookup's slots in Clover's tree when the prompt lookup
finds nothing (proposer ``_draft_tree``); verification is the same one-hot rule, lossless.

The table: for every context length n in 1..max_order, each n-token context seen in the
corpus maps to the token that most often followed it (ties: the smaller id), kept when it
followed at least ``min_count`` times, with its confidence (the share of the context's
occurrences it followed, in 1/255). A context is a uint64 key, ``bits`` bits per token
(exact, no hashing: ``max_order * bits <= 64``). Drafting is greedy with back-off: the next
token after the longest suffix found, repeated while its confidence reaches
``min_confidence`` (each drafted token costs a verified row; uncertain ones rarely pay).
Pure numpy, no vLLM import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

FORMAT = "vllm-clover-ngram-datastore"
VERSION = 1


class DatastoreError(ValueError):
    """A datastore file is missing, unreadable, or does not fit the target; one line."""


@dataclass(frozen=True)
class NgramDatastore:
    """keys[n - 1] [M_n] uint64 (sorted): the n-token contexts; next_tokens[n - 1] [M_n]
    int32: the token that most often followed each; confidence[n - 1] [M_n] uint8: the
    share of the context's occurrences that token followed, x 255. ``vocab_size``: the
    tokenizer's."""

    keys: tuple[np.ndarray, ...]
    next_tokens: tuple[np.ndarray, ...]
    confidence: tuple[np.ndarray, ...]
    vocab_size: int
    bits: int
    source: str = ""

    @property
    def max_order(self) -> int:
        return len(self.keys)

    @property
    def num_entries(self) -> int:
        return sum(int(k.size) for k in self.keys)

    def continuation(self, tokens: np.ndarray, k: int, min_confidence: float = 0.0) -> np.ndarray:
        """Up to ``k`` draft tokens after ``tokens`` [L] (a request's committed tokens, the
        root last): each the most frequent follower of the longest suffix (<= max_order
        tokens) in the table; stops early when not even the last token is there, or when
        that follower's confidence is below ``min_confidence`` (0..1)."""
        context = [int(t) for t in tokens[-self.max_order:]] if k > 0 else []
        threshold = min_confidence * 255
        out: list[int] = []
        for _ in range(k):
            hit = self._next(context)
            if hit is None or hit[1] < threshold:
                break
            nxt = hit[0]
            out.append(nxt)
            context = (context + [nxt])[-self.max_order:]
        return np.asarray(out, dtype=np.int64)

    def _next(self, context: list[int]) -> tuple[int, int] | None:
        """(follower, confidence x 255) of the longest suffix of ``context`` in the table."""
        for n in range(min(self.max_order, len(context)), 0, -1):
            suffix = context[-n:]
            if any(t < 0 or t >= self.vocab_size for t in suffix):
                continue  # e.g. a special token beyond the tokenizer's base vocabulary
            key = np.uint64(_pack(suffix, self.bits))
            keys = self.keys[n - 1]
            i = int(np.searchsorted(keys, key))
            if i < keys.size and keys[i] == key:
                return int(self.next_tokens[n - 1][i]), int(self.confidence[n - 1][i])
        return None


def _pack(tokens: Sequence[int], bits: int) -> int:
    key = 0
    for t in tokens:
        key = (key << bits) | t
    return key


def key_bits(vocab_size: int, max_order: int) -> int:
    """Bits per token so that ``max_order`` tokens fit one uint64 key exactly."""
    bits = max(1, int(vocab_size - 1).bit_length())
    if bits * max_order > 64:
        raise DatastoreError(f"max_order {max_order} with a {vocab_size}-token vocabulary needs "
                             f"{bits * max_order} bits per key (> 64); use max_order <= {64 // bits}")
    return bits


def build_datastore(sequences: Iterable[Sequence[int]], vocab_size: int, max_order: int = 4,
                    min_count: int = 5, source: str = "") -> NgramDatastore:
    """The table of ``sequences`` (token id lists; n-grams never cross two of them)."""
    if max_order < 1 or min_count < 1:
        raise DatastoreError(f"max_order and min_count must be >= 1, got {max_order}, {min_count}")
    bits = key_bits(vocab_size, max_order)
    stream = np.concatenate([np.asarray(list(s) + [-1], dtype=np.int64) for s in sequences] or
                            [np.zeros(0, dtype=np.int64)])
    if stream.size and (stream.max() >= vocab_size):
        raise DatastoreError(f"token id {int(stream.max())} is outside the {vocab_size}-token vocabulary")
    tables = [_most_frequent_followers(stream, n, bits, min_count) for n in range(1, max_order + 1)]
    return NgramDatastore(*(tuple(t[i] for t in tables) for i in range(3)), vocab_size, bits, source)


def _most_frequent_followers(stream: np.ndarray, n: int, bits: int,
                             min_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted context keys [M] uint64, their most frequent follower [M] int32, its share of
    the context's occurrences x 255 [M] uint8) over every window of n + 1 tokens of
    ``stream`` without a separator (-1) in it."""
    empty = (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint8))
    if stream.size < n + 1:
        return empty
    windows = sliding_window_view(stream, n + 1)
    windows = windows[(windows >= 0).all(axis=1)]
    key = np.zeros(windows.shape[0], dtype=np.uint64)
    for j in range(n):
        key = (key << np.uint64(bits)) | windows[:, j].astype(np.uint64)
    nxt = windows[:, n]
    order = np.lexsort((nxt, key))
    key, nxt = key[order], nxt[order]
    if key.size == 0:
        return empty
    new_pair = np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])]
    starts = np.flatnonzero(new_pair)
    counts = np.diff(np.r_[starts, key.size])
    pair_key, pair_next = key[starts], nxt[starts]
    group = np.cumsum(np.r_[True, pair_key[1:] != pair_key[:-1]]) - 1
    # Per context the highest count; lexsort is stable, so ties keep the smaller token id.
    by_count = np.lexsort((-counts, group))
    first = by_count[np.r_[True, group[by_count][1:] != group[by_count][:-1]]]
    keep = first[counts[first] >= min_count]
    totals = np.bincount(group, weights=counts)[group[keep]]
    share = np.floor(255 * counts[keep] / totals).astype(np.uint8)
    return pair_key[keep], pair_next[keep].astype(np.int32), share


def save_datastore(store: NgramDatastore, path: str | Path) -> None:
    meta = {"format": FORMAT, "version": VERSION, "vocab_size": store.vocab_size, "bits": store.bits,
            "max_order": store.max_order, "source": store.source}
    arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    for n in range(1, store.max_order + 1):
        arrays[f"keys{n}"] = store.keys[n - 1]
        arrays[f"next{n}"] = store.next_tokens[n - 1]
        arrays[f"conf{n}"] = store.confidence[n - 1]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to other names
        np.savez_compressed(f, **arrays)


def load_datastore(path: str | Path, vocab_size: int | None = None) -> NgramDatastore:
    """Read a datastore; ``vocab_size``: the target's, which the datastore's must equal.
    Raises DatastoreError naming the path and the problem."""
    path = Path(path)
    if not path.is_file():
        raise DatastoreError(f"datastore {path} does not exist (build one with `vllm-clover build-datastore`)")
    try:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(bytes(f["meta"]).decode())
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise DatastoreError(f"datastore {path} is not a {FORMAT} v{VERSION} file "
                                     f"(format {meta.get('format')!r}, version {meta.get('version')!r})")
            order = int(meta["max_order"])
            keys = tuple(np.asarray(f[f"keys{n}"], dtype=np.uint64) for n in range(1, order + 1))
            nexts = tuple(np.asarray(f[f"next{n}"], dtype=np.int32) for n in range(1, order + 1))
            conf = tuple(np.asarray(f[f"conf{n}"], dtype=np.uint8) for n in range(1, order + 1))
            store = NgramDatastore(keys, nexts, conf, int(meta["vocab_size"]), int(meta["bits"]),
                                   str(meta.get("source", "")))
    except DatastoreError:
        raise
    except Exception as exc:  # zip, json, missing arrays: all mean a corrupt file
        raise DatastoreError(f"datastore {path} is unreadable or corrupt: {type(exc).__name__}: {exc}") from None
    for n, (k, v, c) in enumerate(zip(store.keys, store.next_tokens, store.confidence), 1):
        if k.shape != v.shape or k.shape != c.shape or (k.size > 1 and bool((k[1:] <= k[:-1]).any())):
            raise DatastoreError(f"datastore {path} is corrupt: order-{n} keys unsorted or not matching their tokens")
    if store.bits * store.max_order > 64 or store.vocab_size > (1 << store.bits):
        raise DatastoreError(f"datastore {path} is corrupt: {store.bits} bits per token for "
                             f"order {store.max_order} and vocabulary {store.vocab_size}")
    if vocab_size is not None and store.vocab_size != vocab_size:
        raise DatastoreError(f"datastore {path} was built for a {store.vocab_size}-token vocabulary, "
                             f"the target has {vocab_size}: build one with the target's tokenizer")
    return store


def corpus_answers(tokenizer, num_conversations: int | None = None) -> tuple[list[list[int]], str]:
    """Token ids of every assistant answer of the ShareGPT training split (never the
    held-out slice, ``data.split_heldout``), and a description of that source."""
    from vllm_clover.training import data
    train, _ = data.split_heldout(data.load_sharegpt())
    if num_conversations is not None:
        train = train[:num_conversations]
    texts = [m["content"] for c in train for m in c.messages if m["role"] == "assistant"]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return ids, f"sharegpt_v3:train[:{len(train)}] assistant answers ({sum(map(len, ids))} tokens)"
