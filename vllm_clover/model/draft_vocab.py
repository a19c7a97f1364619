"""Reduced draft vocabulary: the heads score only the N most frequent response tokens.

Why: at batch 1 each Clover head ends in a product with the target's LM head, [V, H] =
49,152 x 576 for SmolLM2: 28 M multiply-adds and a 113 MB (float32) weight read per head
and per step, about a fifth of the whole target's weights. K heads would cost about as
much as the target step they try to save. Restricting the heads' LM head to the N most
frequent tokens of the training responses (EAGLE-3's "draft vocabulary") divides that
by V / N; a token outside the subset simply cannot be drafted.

Losslessness is untouched: greedy verification compares drafts with the target's argmax,
and rejection sampling is exact for any draft distribution q (here q is zero outside the
subset, and the returned q [B, K, V] says so).

File: ``<checkpoint>/draft_vocab.json`` = ``{"token_ids": [...], "source": "..."}``, token
ids ranked by frequency (most frequent first), written by ``vllm-clover train`` from its
training responses. Inference takes the first ``draft_vocab_size`` ids (a Clover option).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor
DRAFT_VOCAB_FILE = "draft_vocab.json"
# Ranked ids kept in the file: more than any useful draft vocabulary, ~100 KB of JSON.
MAX_STORED = 16384


class DraftVocabError(ValueError):
    """A missing, malformed or too-small draft vocabulary (one line, names the file)."""


def rank_tokens(tokens: np.ndarray, mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids ranked for a draft vocabulary (int32 [V]): by count as a response token
    (mask set), then count anywhere, then low id first. ``tokens`` [N], ``mask`` [N] (unpacked)."""
    ids = tokens.astype(np.int64)
    resp = np.bincount(ids[mask.astype(bool)], minlength=vocab_size)
    allc = np.bincount(ids, minlength=vocab_size)
    return np.lexsort((np.arange(vocab_size), -allc, -resp)).astype(np.int32)


def token_ranking(dataset: Any, vocab_size: int) -> Tensor:
    """All token ids ranked for a draft vocabulary (long [vocab_size], best first).

    Rank: count as a response token y_{u+1} of a trained position, then count anywhere in
    the sequences, then low id first. ``dataset`` is a FeatureDataset (reads its files'
    ``input_ids`` and ``loss_mask``).
    """
    from safetensors import safe_open

    ids, mask = [], []
    for path in dataset.files:
        with safe_open(str(path), "np") as f:
            ids.append(f.get_tensor("input_ids"))
            mask.append(f.get_tensor("loss_mask"))
    return torch.from_numpy(rank_tokens(np.concatenate(ids), np.concatenate(mask), vocab_size).astype(np.int64))


def save_draft_vocab(out: str | Path, ranking: Tensor, source: str) -> Path:
    """Write the first :data:`MAX_STORED` ids of ``ranking`` to ``out/draft_vocab.json``."""
    path = Path(out) / DRAFT_VOCAB_FILE
    payload = {"source": source, "token_ids": [int(t) for t in ranking[:MAX_STORED]]}
    path.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    return path


def load_draft_vocab(checkpoint: str | Path, size: int, vocab_size: int) -> Tensor:
    """The ``size`` top-ranked ids of ``checkpoint``'s draft vocabulary (long [size]).

    Raises DraftVocabError naming the file when it is missing, malformed, holds ids
    outside [0, vocab_size) or repeated ids, or has fewer than ``size`` ids.
    """
    path = Path(checkpoint) / DRAFT_VOCAB_FILE
    if not path.is_file():
        raise DraftVocabError(f"draft_vocab_size={size} needs {path}, which does not exist "
                              "(checkpoints trained before draft vocabularies: use 0, the full vocabulary)")
    try:
        ids = json.loads(path.read_text())["token_ids"]
        ids = torch.tensor(ids, dtype=torch.long)
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftVocabError(f"{path} is not a draft vocabulary file ({exc})") from None
    if ids.ndim != 1 or ids.numel() < size:
        raise DraftVocabError(f"{path} holds {ids.numel()} token ids; draft_vocab_size={size} is too large")
    ids = ids[:size]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DraftVocabError(f"{path} has token ids outside the target vocabulary [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise DraftVocabError(f"{path} repeats token ids")
    return ids


def subset_logits_fn(weight: Tensor, ids: Tensor):
    """LMHead restricted to ``ids``, as full-width logits (-inf outside): for evaluation,
    where the [.., V] shape matters more than speed. weight [V, H]; returns f([.., H]) -> [.., V]."""
    rows = weight[ids]

    def logits(h: Tensor) -> Tensor:
        out = torch.full((*h.shape[:-1], weight.shape[0]), float("-inf"), dtype=torch.float32,
                         device=h.device)
        out[..., ids] = torch.nn.functional.linear(h.to(rows.dtype), rows).float()
        return out

    return logits
