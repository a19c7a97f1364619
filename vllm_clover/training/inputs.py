"""What a training run reads: the target, its conversations and their feature caches.

The target must be a Llama-family model (:func:`check_target`); the conversations come from
the packaged ShareGPT split, from the target's own answers to them (self-distillation, cached
per chunk) or from a JSON-lines file (:func:`select_conversations`); each chunk of
conversations gets one feature cache (:func:`build_feature_chunks`), and
:class:`FeatureChunks` reads the caches as one dataset. Evaluation reuses the same pieces for
the held-out split.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vllm_clover.model.config import read_json_dict
from vllm_clover.training.args import TrainingError, log
from vllm_clover.training.data import Conversation, load_conversations, save_conversations

Tensor = torch.Tensor

# Llama-family causal LMs whose decoder layers our Augmenting Block (a Llama layer without
# biases) can copy and whose ``model.model.norm`` the feature hook reads.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
DATA_SOURCES = ("sharegpt", "selfdistill")
# Self-distilled answers are cached per chunk of this many source conversations, so a
# long generation can be interrupted and resumed, and larger runs reuse smaller ones.
DISTILL_CHUNK = 250


# ============================================================================ self-distillation
def _config_sha(model_dir: Path) -> str:
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def distill_dir(model_dir: str | os.PathLike, max_new_tokens: int, dtype: str) -> Path:
    """Cache folder of self-distilled answers for one target and generation setting."""
    from vllm_clover.default_model import cache_dir

    model_dir = Path(model_dir).resolve()
    weights = sorted(model_dir.glob("*.safetensors"))
    ident = _config_sha(model_dir) + "".join(f"{p.name}:{p.stat().st_size}" for p in weights)
    tag = hashlib.sha256(ident.encode()).hexdigest()[:10]
    return cache_dir() / "selfdistill" / f"{model_dir.name}-{tag}-mnt{max_new_tokens}-{dtype}"


def _ids_sha(convs: Sequence[Conversation]) -> str:
    return hashlib.sha256("\n".join(c.id for c in convs).encode()).hexdigest()


def self_distill_cached(model_dir: str | os.PathLike, convs: Sequence[Conversation], name: str,
                        max_new_tokens: int = 256, dtype: str = "float32") -> list[Conversation]:
    """Self-distilled versions of ``convs`` (target's own greedy answer to the first turn).

    Generated with :func:`vllm_clover.training.data.self_distill` in chunks of ``DISTILL_CHUNK``
    conversations and cached as ``<distill_dir>/<name>_<k>.jsonl``; chunk k always holds
    the answers for ``convs[k*C:(k+1)*C]``, so callers must pass a stable order (the
    split order of :func:`vllm_clover.training.data.split_heldout`). Starts vLLM: call only under
    ``if __name__ == "__main__":``.
    """
    from vllm_clover.training.data import self_distill

    out_dir = distill_dir(model_dir, max_new_tokens, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: list[Conversation] = []
    for k in range(0, len(convs), DISTILL_CHUNK):
        chunk = list(convs[k:k + DISTILL_CHUNK])
        path = out_dir / f"{name}_{k // DISTILL_CHUNK:04d}.jsonl"
        # The sidecar names the exact source conversations; it is written after the
        # answers, so its presence means the chunk is complete and for these inputs.
        stamp = path.with_suffix(".ids")
        if path.is_file() and stamp.is_file() and stamp.read_text().strip() == _ids_sha(chunk):
            result.extend(load_conversations(path))
            continue
        start = time.perf_counter()
        answers = self_distill(model_dir, chunk, max_new_tokens=max_new_tokens, dtype=dtype)
        save_conversations(answers, path)
        stamp.write_text(_ids_sha(chunk) + "\n")
        toks = sum(len(a.messages[1]["content"]) for a in answers) / 4
        log(f"self-distilled {len(answers)}/{len(chunk)} conversations -> {path} "
             f"in {time.perf_counter() - start:.0f} s (~{toks:.0f} answer tokens)")
        result.extend(answers)
    return result


# ============================================================================ target
def check_target(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The target's HF ``config.json`` as a dict; :class:`TrainingError` if unusable."""
    model_dir = Path(model_dir)
    config = read_json_dict(model_dir, TrainingError, "target model")
    archs = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise TrainingError(
            f"target {model_dir} is {'/'.join(archs) or 'of unknown architecture'}; Clover heads "
            f"need a Llama-family target ({', '.join(SUPPORTED_ARCHITECTURES)})")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise TrainingError(f"target {model_dir} has attention/MLP biases; the Augmenting Block "
                            "copies bias-free Llama layers")
    if not list(model_dir.glob("*.safetensors")):
        raise TrainingError(f"target {model_dir} has no *.safetensors weights")
    return config


def resolve_target(target: str | os.PathLike | None) -> Path:
    """``target`` or, when None, the embedded default model (converted on first use)."""
    if target is None:
        from vllm_clover.default_model import ensure_default_model

        return ensure_default_model()
    return Path(target).expanduser().resolve()


# ============================================================================ conversations
def split_sharegpt(heldout_size: int = 200, seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """The fixed (train, held-out) split of the packaged ShareGPT (data.split_heldout)."""
    from vllm_clover.training.data import load_sharegpt, split_heldout

    return split_heldout(load_sharegpt(), heldout_size=heldout_size, seed=seed)


def select_conversations(source: str, num_conversations: int, target: Path,
                         distill_max_new_tokens: int = 256, distill_dtype: str = "float32"
                         ) -> tuple[list[list[Conversation]], str]:
    """Training conversations in chunks (one feature cache each) and a label for them.

    ``sharegpt``: the first N of the fixed training split (multi-turn, dataset answers).
    ``selfdistill``: the first turns of those same N conversations, answered by the target
    (cached; starts vLLM when not cached). A path: JSON lines as written by
    :func:`vllm_clover.training.data.save_conversations`, first N; conversations of the held-out
    groups are dropped so evaluation stays clean. Chunk k holds the conversations that come
    from source positions [k*C, (k+1)*C), C = ``DISTILL_CHUNK``, so runs on different N
    share their leading chunks' feature caches.
    """
    if num_conversations < 1:
        raise TrainingError(f"--num-conversations must be >= 1, got {num_conversations}")
    if source in DATA_SOURCES:
        train, _held = split_sharegpt()
        sources = train[:num_conversations]
        if source == "sharegpt":
            return _chunk(sources, sources), f"sharegpt_v3:train[:{num_conversations}]"
        # Whole chunks only, so the answer cache is shared by runs of different sizes.
        span = math.ceil(num_conversations / DISTILL_CHUNK) * DISTILL_CHUNK
        answers = self_distill_cached(target, train[:span], "train", distill_max_new_tokens, distill_dtype)
        return _chunk(sources, answers), (f"selfdistill(sharegpt_v3:train[:{num_conversations}], "
                                          f"max_new_tokens={distill_max_new_tokens}, {distill_dtype})")
    path = Path(source).expanduser()
    if not path.is_file():
        raise TrainingError(f"dataset file {path} not found (expected sharegpt, selfdistill or a .jsonl path)")
    from vllm_clover.training.data import DataError, _group_id

    try:
        convs = load_conversations(path)
    except DataError as exc:
        raise TrainingError(str(exc)) from None
    held = {_group_id(c.id) for c in split_sharegpt()[1]}
    clean = [c for c in convs if _group_id(c.id) not in held]
    if len(clean) < len(convs):
        log(f"dropped {len(convs) - len(clean)} conversations of the held-out split from {path}")
    if not clean:
        raise TrainingError(f"dataset file {path} holds no usable conversation")
    clean = clean[:num_conversations]
    return _chunk(clean, clean), f"file:{path.resolve()}[:{num_conversations}]"


def _chunk(sources: Sequence[Conversation], convs: Sequence[Conversation]) -> list[list[Conversation]]:
    """Group ``convs`` (derived from ``sources``, e.g. their self-distilled answers, matched by
    ``meta["source_id"]`` or id) by the chunk of their source's position; drop the others."""
    where = {c.id: i // DISTILL_CHUNK for i, c in enumerate(sources)}
    chunks: list[list[Conversation]] = [[] for _ in range(math.ceil(len(sources) / DISTILL_CHUNK))]
    for c in convs:
        k = where.get(c.meta.get("source_id", c.id))
        if k is not None:
            chunks[k].append(c)
    return [c for c in chunks if c]


# ============================================================================ feature caches
def feature_cache_dir(target: Path, convs: Sequence[Conversation], max_len: int, dtype: str,
                      root: str | os.PathLike | None = None) -> Path:
    """Feature-cache folder of ``convs``: named by target, data fingerprint, length and dtype."""
    from vllm_clover.default_model import cache_dir
    from vllm_clover.training.features import data_fingerprint

    tag = data_fingerprint(convs)[:12]
    base = Path(root) if root else cache_dir() / "features"
    return base / f"{target.name}-{len(convs)}conv-L{max_len}-{dtype}-{tag}"


class FeatureChunks:
    """Several complete feature caches seen as one dataset (same interface as FeatureDataset)."""

    def __init__(self, dirs: Sequence[Path]) -> None:
        from vllm_clover.training.features import FeatureDataset

        self.parts = [FeatureDataset(d) for d in dirs]
        self.files = [f for p in self.parts for f in p.files]
        self.lengths = np.concatenate([p.lengths for p in self.parts]).astype(np.int64)
        self._starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        part = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.parts[part][index - int(self._starts[part])]

    def collate(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """The padded training batch of ``indices`` with their cached features."""
        from vllm_clover.training.batches import collate_features

        return collate_features([self[i] for i in indices])

    def token_ranking(self, vocab_size: int) -> Tensor:
        """Token ids ranked for the draft vocabulary (long [V], draft_vocab.token_ranking)."""
        from vllm_clover.model.draft_vocab import token_ranking

        return token_ranking(self, vocab_size)

    def data_info(self) -> dict[str, int]:
        keys = ("num_conversations_in", "num_conversations_kept", "num_sequences", "num_tokens",
                "num_loss_tokens")
        return {k: int(sum(p.manifest["data"][k] for p in self.parts)) for k in keys}


def build_feature_chunks(target: Path, chunks: Sequence[Sequence[Conversation]], label: str, max_len: int,
                         dtype: str, threads: int | None, root: str | os.PathLike | None = None,
                         device: str = "cpu") -> tuple[FeatureChunks, list[Path]]:
    """Compute (or reuse) one feature cache per chunk; returns the combined dataset and dirs."""
    from vllm_clover.training.features import extract_features

    dirs = []
    for k, convs in enumerate(chunks):
        d = feature_cache_dir(target, convs, max_len, dtype, root)
        extract_features(target, convs, d, max_len=max_len, dtype=dtype, data_source=f"{label} chunk {k}",
                         num_threads=threads or None, device=device)
        dirs.append(d)
    return FeatureChunks(dirs), dirs
