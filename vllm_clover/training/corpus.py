"""A tokenized training corpus on disk: every turn of ShareGPT's training split, tokenized once.

``vllm-clover corpus --out DIR`` renders each conversation of the fixed training split
(:func:`~vllm_clover.training.inputs.split_sharegpt`; the held-out slice is never read) with
the target's chat template, all turns, with the dataset's answers, and stores the token ids
and the assistant loss mask as flat arrays. Training reads them through
:class:`~vllm_clover.training.stream.CorpusSlice` and computes the target's features on the
fly, so no feature cache is ever written.

Layout of ``DIR`` (all arrays ``.npy``)::

    tokens.npy    uint16 [N]       token ids of all sequences, concatenated (uint32 if the
                                   vocabulary has more than 65,536 ids)
    mask.npy      uint8  [ceil(N/8)] np.packbits of the loss mask: 1 where the token is part
                                   of an assistant response (docs/feature-cache.md, section 3)
    offsets.npy   int64  [S+1]     sequence s is tokens[offsets[s]:offsets[s+1]]
    source.npy    uint8  [S]       0: dataset answers (ShareGPT), 1: self-distilled answers
    ranking.npy   int32  [V]       token ids ranked for the draft vocabulary (response
                                   count, then count anywhere, then low id first)
    corpus.json   what built it: target and tokenizer fingerprints, settings, counts

Sequences are in a seeded random order, so any prefix of the corpus is a random sample of
it: a run that trains on tokens [0, 1M) and a later one on [1M, 2M) see distinct data
(``--token-range``, docs/training.md). A conversation longer than ``max_len`` tokens is cut
into windows at user-turn boundaries, each rendered as a conversation of its own (the chat
template adds its system prompt again), so long chats are used whole instead of truncated;
a single exchange longer than ``max_len`` is truncated.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from vllm_clover.model.draft_vocab import rank_tokens
from vllm_clover.training.args import TrainingError, log
from vllm_clover.training.data import Conversation, tokenize_conversation

CORPUS_FILE = "corpus.json"
# Bump when the layout or the tokenization changes: an older corpus is refused, not misread.
CORPUS_VERSION = 1
ARRAYS = ("tokens", "mask", "offsets", "source", "ranking")


def is_corpus(path: str | os.PathLike) -> bool:
    """True when ``path`` is a corpus directory (holds ``corpus.json``)."""
    return (Path(path) / CORPUS_FILE).is_file()


# ============================================================================ windows
def message_token_starts(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token index where each message starts in the rendering of the whole conversation
    (message 0 at 0, with the template's preamble), plus the total length at the end."""
    from vllm_clover.training.data import _render

    full = _render(tokenizer, messages, add_generation_prompt=False)
    offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    ends = [e for _s, e in offsets]
    return [0] + [bisect.bisect_right(ends, len(_render(tokenizer, messages[:i], add_generation_prompt=False)))
                  for i in range(1, len(messages))] + [len(offsets)]


def preamble_tokens(tokenizer) -> int:
    """An upper bound on the tokens the chat template puts before a conversation's first
    message (SmolLM2's default system prompt): the length of a one-word conversation."""
    from vllm_clover.training.data import _render

    return len(tokenizer(_render(tokenizer, [{"role": "user", "content": "x"}], False),
                         add_special_tokens=False)["input_ids"])


def turn_windows(tokenizer, messages: Sequence[dict[str, str]], max_len: int,
                 preamble: int) -> list[list[dict[str, str]]]:
    """``messages`` (user/assistant pairs) cut into windows of whole pairs that fit ``max_len``.

    Sizes come from the whole conversation's tokenization; a window that does not start the
    conversation adds ``preamble`` (:func:`preamble_tokens`). The caller tokenizes each window
    again and truncates, so an estimate a few tokens off costs a few tokens at a window's end.
    """
    starts = message_token_starts(tokenizer, messages)
    pairs = list(range(0, len(messages) - 1, 2))
    windows, first = [], 0
    for k, p in enumerate(pairs):
        size = starts[p + 2] - starts[pairs[first]] + (preamble if first else 0)
        if size > max_len and k > first:
            windows.append(list(messages[pairs[first]:p]))
            first = k
    windows.append(list(messages[pairs[first]:]))
    return windows


def tokenize_windows(tokenizer, conv: Conversation, max_len: int,
                     preamble: int) -> Iterator[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each window of ``conv`` that has a trained position."""
    if len(conv.messages) % 2:
        raise TrainingError(f"conversation {conv.id} does not end with an assistant turn")
    for window in turn_windows(tokenizer, conv.messages, max_len, preamble):
        ids, mask = tokenize_conversation(tokenizer, window, max_len)
        # Position t trains on mask[t+1]; a window with no such bit set teaches nothing.
        if sum(mask[1:]):
            yield ids, mask


# ============================================================================ build
def build_corpus(out: str | os.PathLike, target: str | os.PathLike | None = None, max_len: int = 2048,
                 seed: int = 0, selfdistill: int = 0, limit: int | None = None,
                 distill_max_new_tokens: int = 256) -> dict[str, Any]:
    """Tokenize the training split into ``out`` (layout: module docstring); returns corpus.json.

    ``selfdistill``: also answer the first turns of the first N training conversations with
    the target (vLLM, greedy float32, cached: :func:`inputs.self_distill_cached`) and add
    them as sequences of source 1. ``limit``: only the first N training conversations (tests).
    """
    from transformers import AutoTokenizer

    from vllm_clover.training.features import target_fingerprint, tokenizer_fingerprint
    from vllm_clover.training.inputs import check_target, resolve_target, self_distill_cached, split_sharegpt

    out = Path(out).expanduser()
    if is_corpus(out):
        raise TrainingError(f"{out} already holds a corpus; remove it or choose another --out")
    t0 = time.perf_counter()
    model_dir = resolve_target(target)
    config = check_target(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    train, _held = split_sharegpt()
    convs = train if limit is None else train[:limit]
    pre = preamble_tokens(tokenizer)
    parts: list[tuple[int, list[int], list[int]]] = [
        (0, ids, mask) for c in convs for ids, mask in tokenize_windows(tokenizer, c, max_len, pre)]
    if selfdistill:
        answers = self_distill_cached(model_dir, train[:selfdistill], "train", distill_max_new_tokens, "float32")
        parts += [(1, ids, mask) for c in answers for ids, mask in tokenize_windows(tokenizer, c, max_len, pre)]
    if not parts:
        raise TrainingError("the corpus would be empty: no conversation has an assistant token")
    random.Random(seed).shuffle(parts)
    arrays = _pack(parts, int(config["vocab_size"]))
    info = {
        "version": CORPUS_VERSION,
        "target": target_fingerprint(model_dir),
        "tokenizer": tokenizer_fingerprint(model_dir, tokenizer),
        "vocab_size": int(config["vocab_size"]),
        "settings": {"max_len": max_len, "seed": seed, "selfdistill": selfdistill, "limit": limit,
                     "distill_max_new_tokens": distill_max_new_tokens},
        "source": f"sharegpt_v3:train[:{len(convs)}] all turns"
                  + (f" + selfdistill(train[:{selfdistill}])" if selfdistill else ""),
        "counts": {"conversations": len(convs), "sequences": len(parts),
                   "tokens": int(arrays["offsets"][-1]), "loss_tokens": int(sum(sum(m) for _s, _i, m in parts)),
                   "selfdistill_sequences": int(arrays["source"].sum()),
                   "selfdistill_tokens": int(sum(len(i) for s, i, _m in parts if s == 1))},
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    _write(out, arrays, info)
    log(f"corpus {out}: {info['counts']['sequences']:,} sequences, {info['counts']['tokens']:,} tokens "
        f"({info['counts']['loss_tokens']:,} response tokens) in {info['build_seconds']} s")
    return info


def _pack(parts: Sequence[tuple[int, list[int], list[int]]], vocab_size: int) -> dict[str, np.ndarray]:
    id_dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    lengths = np.array([len(ids) for _s, ids, _m in parts], dtype=np.int64)
    tokens = np.concatenate([np.asarray(ids, dtype=id_dtype) for _s, ids, _m in parts])
    mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _s, _i, m in parts])
    return {"tokens": tokens, "mask": np.packbits(mask),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "source": np.array([s for s, _i, _m in parts], dtype=np.uint8),
            "ranking": rank_tokens(tokens, mask, vocab_size)}


def _write(out: Path, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """Arrays first, corpus.json last (atomically): a directory with corpus.json is complete."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ARRAYS:
        np.save(out / f"{name}.npy", arrays[name], allow_pickle=False)
    tmp = out / f".{CORPUS_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / CORPUS_FILE)


# ============================================================================ read
class Corpus:
    """A corpus directory, memory-mapped: sequence ``s`` is :meth:`sequence` (ids, mask)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()
        if not is_corpus(self.path):
            raise TrainingError(f"{self.path} is not a corpus directory (no {CORPUS_FILE}; "
                                "build one with `vllm-clover corpus --out DIR`)")
        try:
            self.info = json.loads((self.path / CORPUS_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainingError(f"{self.path / CORPUS_FILE} is unreadable: {exc}") from None
        if self.info.get("version") != CORPUS_VERSION:
            raise TrainingError(f"{self.path} is a version {self.info.get('version')} corpus; this "
                                f"vllm-clover reads version {CORPUS_VERSION}: rebuild it")
        arrays = {name: self._load(name) for name in ARRAYS}
        self.tokens, self.offsets, self.source, self.ranking = (
            arrays["tokens"], arrays["offsets"], arrays["source"], arrays["ranking"])
        self._mask_bits = arrays["mask"]
        n = int(self.offsets[-1]) if len(self.offsets) else -1
        if (len(self.tokens) != n or len(self.source) != len(self.offsets) - 1
                or len(self._mask_bits) != (n + 7) // 8 or len(self.ranking) != self.info["vocab_size"]):
            raise TrainingError(f"{self.path}: array sizes disagree with each other (a truncated or "
                                "mixed corpus): rebuild it")

    def _load(self, name: str) -> np.ndarray:
        path = self.path / f"{name}.npy"
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise TrainingError(f"corpus array {path} is missing or corrupt: {exc}") from None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequence(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64 [L], loss_mask uint8 [L]) of sequence ``s``."""
        a, b = int(self.offsets[s]), int(self.offsets[s + 1])
        # packbits is big-endian within a byte: token k is bit 7 - k % 8 of byte k // 8.
        bits = np.unpackbits(self._mask_bits[a // 8:(b + 7) // 8])[a % 8:a % 8 + (b - a)]
        return self.tokens[a:b].astype(np.int64), bits.astype(np.uint8)

    def token_range(self, start: int, end: int) -> range:
        """Sequences that lie wholly inside corpus tokens [start, end)."""
        if not 0 <= start < end:
            raise TrainingError(f"--token-range {start}:{end} is empty or negative")
        total = int(self.offsets[-1])
        if start >= total:
            raise TrainingError(f"--token-range {start}:{end} starts past the corpus's {total:,} tokens")
        first = int(np.searchsorted(self.offsets, start, side="left"))
        last = int(np.searchsorted(self.offsets, min(end, total), side="right")) - 1
        if last <= first:
            raise TrainingError(f"--token-range {start}:{end} holds no whole sequence")
        return range(first, last)
