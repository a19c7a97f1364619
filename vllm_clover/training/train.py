"""Training Clover heads on cached target features (``vllm-clover train``).

``--method medusa`` / ``--method eagle`` train the Medusa-1 / EAGLE-1 baselines of
:mod:`vllm_clover.training.baselines` through the same pipeline (data, features, batches, optimizer,
schedule, checkpoints); only the model, its input (h-bar_t instead of x_t) and the loss
weights differ, and the output is in the format of vLLM's built-in ``medusa`` / ``eagle``.

Pipeline (docs/training.md)::

    conversations  --(optional) self-distillation with the target via vLLM, cached-->
    feature cache  --features.extract_features, computed once, reused-->
    training loop  --Clover-2 loss, AdamW, checkpoints + exact resume-->
    <out>/config.json + model.safetensors (bf16, trainable weights only) + training.json

The loss is the official Clover-2 loss (:func:`vllm_clover.model.drafter.clover_loss`), computed
by :func:`clover_loss_backward` in a mathematically identical but cheaper way: the LM-head
products (which dominate the cost on CPU) are done only on loss-masked rows, the
target's soft labels are computed once per position and shared by all heads (head i at
position t and head 0 at position t+i have the same target h-bar), and the vocabulary
dimension is processed in row chunks so memory stays bounded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vllm_clover.training.baselines import METHODS, build_baseline, loss_weights, save_baseline, shape_config
from vllm_clover.model.config import CloverConfig, read_json_dict
from vllm_clover.training.data import Conversation, load_conversations, save_conversations
from vllm_clover.model.drafter import CloverDrafter, init_from_target, match_token_value_scale

Tensor = torch.Tensor

# Llama-family causal LMs whose decoder layers our Augmenting Block (a Llama layer without
# biases) can copy and whose ``model.model.norm`` the feature hook reads.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
DATA_SOURCES = ("sharegpt", "selfdistill")
# Heads shipped inside the package for the default model (docs/training.md, section 6).
SHIPPED_HEADS = "smollm2-135m-instruct-clover2"


def shipped_heads_dir(name: str = SHIPPED_HEADS) -> Path:
    """Folder of a drafter shipped in ``vllm_clover/heads/`` (may not exist in a bare checkout)."""
    return Path(__file__).resolve().parent.parent / "heads" / name
# Self-distilled answers are cached per chunk of this many source conversations, so a
# long generation can be interrupted and resumed, and larger runs reuse smaller ones.
DISTILL_CHUNK = 250


class TrainingError(RuntimeError):
    """Bad input or state for training / evaluation; the message is one line."""


def _log(msg: str) -> None:
    print(f"[vllm-clover] {msg}", file=sys.stderr, flush=True)


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
        _log(f"self-distilled {len(answers)}/{len(chunk)} conversations -> {path} "
             f"in {time.perf_counter() - start:.0f} s (~{toks:.0f} answer tokens)")
        result.extend(answers)
    return result


# ============================================================================ inputs
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
        _log(f"dropped {len(convs) - len(clean)} conversations of the held-out split from {path}")
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


# ============================================================================ model
def build_drafter_for_target(target: Path, target_config: dict[str, Any], variant: str = "clover2",
                             num_heads: int = 5, num_layers: int = 2
                             ) -> tuple[CloverDrafter, CloverConfig]:
    """A Clover drafter initialised from ``target`` (doc section 1.6), float32, unbound."""
    from safetensors.torch import load_file

    config = CloverConfig.from_target_config(target_config, variant=variant, num_heads=num_heads,
                                             num_layers=num_layers)
    config.target_name = config.target_name or target.name
    drafter = CloverDrafter(config)
    state: dict[str, Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        state.update(load_file(str(path)))
    init_from_target(drafter, state)
    return drafter, config


def load_trained_heads(drafter: CloverDrafter, heads_dir: str | os.PathLike,
                       target_config: dict[str, Any]) -> None:
    """Copy the weights of trained Clover heads (a ``save_drafter`` directory) into ``drafter``.

    The heads must be for this target and of the same shape (variant, heads, layers); any
    difference is refused with one line naming it, never silently skipped.
    """
    from vllm_clover.model.checkpoint import CloverCheckpointError, load_drafter

    try:
        trained = load_drafter(heads_dir, target_config)
    except (CloverCheckpointError, OSError) as exc:
        raise TrainingError(f"--init-from: {exc}") from None
    mine, theirs = drafter.state_dict(), trained.state_dict()
    if trained.config.variant != drafter.config.variant:
        raise TrainingError(f"--init-from: {heads_dir} holds {trained.config.variant} heads, "
                            f"this run trains {drafter.config.variant}")
    diff = sorted(k for k in mine.keys() | theirs.keys()
                  if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if diff:
        raise TrainingError(f"--init-from: {heads_dir} does not match this run's shape "
                            f"(--num-layers, or Clover-1's --num-heads): tensor(s) {', '.join(diff[:4])}"
                            f"{' ...' if len(diff) > 4 else ''} differ")
    drafter.load_state_dict({k: v.to(mine[k].dtype) for k, v in theirs.items()})


def build_model_for_target(args: TrainArgs, target: Path, target_config: dict[str, Any]):
    """(model, config) for ``args.method``, float32, unbound; call after seeding the RNGs."""
    if args.method == "clover":
        return build_drafter_for_target(target, target_config, args.variant, args.num_heads, args.num_layers)
    try:
        config = shape_config(args.method, target_config, args.num_heads, args.num_layers)
    except ValueError as exc:  # BaselineError, CloverConfigError: one line
        raise TrainingError(str(exc)) from None
    config.target_name = config.target_name or target.name
    return build_baseline(args.method, config), config


def save_model(out: Path, drafter, config: CloverConfig, method: str, target: Path,
               target_config: dict[str, Any]) -> None:
    """Write the final drafter (bf16 trainable weights) in the format vLLM loads for ``method``."""
    if method == "clover":
        from vllm_clover.model.checkpoint import save_drafter

        save_drafter(out, drafter, config, dtype=torch.bfloat16)
        return
    from vllm_clover.training.features import load_target_head

    # Medusa needs a copy of the target's LM head in the file: the stored tensor, uncast.
    lm_head = load_target_head(target)[2] if method == "medusa" else None
    save_baseline(out, drafter, target_config, lm_head, target_name=config.target_name, dtype=torch.bfloat16)


def loss_settings(args: TrainArgs) -> tuple[float, float, float]:
    """(decay, v_w, p_w): Clover's from the arguments, the baselines' fixed (baselines.LOSS_WEIGHTS)."""
    return (args.decay, args.v_w, args.p_w) if args.method == "clover" else loss_weights(args.method)


# ============================================================================ loss
def clover_loss_backward(outputs: Sequence[Tensor], target_hidden: Tensor, lm_head: Tensor,
                         loss_mask: Tensor, decay: float = 0.7, v_w: float = 10.0, p_w: float = 1.0,
                         vocab: Tensor | None = None, chunk_rows: int = 1024,
                         backward: bool = True) -> tuple[float, dict[str, Tensor]]:
    """Clover-2 loss (same value as :func:`vllm_clover.model.drafter.clover_loss`) + its backward.

    outputs: ``forward_train`` result, o_i [B, T-i, H]; target_hidden [B, T, H] float32
    (h-bar_{t+1} at t); lm_head [V, H] (its dtype sets the product dtype, bf16 for speed);
    loss_mask [B, T]. ``vocab`` (long [V']) restricts both softmaxes to a token subset
    (an approximation, see docs/training.md); None = full vocabulary = the exact loss.

    Why it is cheaper: a trained position u (loss_mask[b, u] = 1) is the target h-bar_{u+1}
    of head i at t = u - i for every i <= u, so the target soft labels are computed once per
    u and shared by all heads; LM-head products run only on those rows, ``chunk_rows`` at a
    time, each chunk's cross-entropy is back-propagated to a detached copy of o_i at once
    (freeing the [rows, V] tensors), and one final backward through
    ``sum_i (o_i * dL/do_i)`` + the regression terms finishes the graph.

    Returns (loss value, metrics) with metrics as in ``clover_loss`` (``vloss``, ``ploss``,
    ``correct``, ``total``, ``acc``; tensors [K]). With ``backward=False`` no gradient is
    computed (evaluation).
    """
    k = len(outputs)
    weight = lm_head if vocab is None else lm_head[vocab]
    bu, uu = (loss_mask > 0).nonzero(as_tuple=True)  # trained positions, sorted by (b, u)
    tgt_rows = target_hidden[bu, uu]  # [n, H]
    denoms, rows_idx, o_rows, leaves = [], [], [], []
    vloss_total = target_hidden.new_zeros(())
    vlosses = []
    for i, o in enumerate(outputs):
        idx = (uu >= i).nonzero(as_tuple=True)[0]  # indices into the trained rows
        rows = o[bu[idx], uu[idx] - i].float()  # [n_i, H]
        denom = float(len(idx)) + 1.0  # official: sum(mask) + 1
        vloss = F.smooth_l1_loss(rows, tgt_rows[idx], reduction="none").mean(-1).sum() / denom
        vloss_total = vloss_total + decay ** i * v_w * vloss
        vlosses.append(vloss.detach())
        denoms.append(denom)
        rows_idx.append(idx)
        o_rows.append(rows)
        leaves.append(rows.detach().requires_grad_(backward))
    plosses = [0.0] * k
    correct = [0] * k
    n = len(uu)
    for r0 in range(0, n, chunk_rows):
        r1 = min(r0 + chunk_rows, n)
        with torch.no_grad():
            t_logits = F.linear(tgt_rows[r0:r1].to(weight.dtype), weight).float()
            t_prob = torch.softmax(t_logits, dim=-1)
            t_arg = t_logits.argmax(-1)
            del t_logits
        for i in range(k):
            idx = rows_idx[i]
            lo, hi = (int(v) for v in torch.searchsorted(idx, torch.tensor([r0, r1], device=idx.device)))
            if hi <= lo:
                continue
            sel = idx[lo:hi] - r0
            with torch.set_grad_enabled(backward):
                logits = F.linear(leaves[i][lo:hi].to(weight.dtype), weight).float()
                ce = -(t_prob[sel] * torch.log_softmax(logits, dim=-1)).sum() / denoms[i]
                if backward:
                    ce.backward()
            plosses[i] += float(ce.detach())
            correct[i] += int((logits.detach().argmax(-1) == t_arg[sel]).sum())
            del logits, ce
    if backward:
        surrogate = vloss_total
        for i in range(k):
            if leaves[i].grad is not None:
                surrogate = surrogate + decay ** i * p_w * (o_rows[i] * leaves[i].grad).sum()
        if surrogate.requires_grad:
            surrogate.backward()
    loss = float(vloss_total.detach()) + sum(decay ** i * p_w * plosses[i] for i in range(k))
    total = torch.tensor([len(ix) for ix in rows_idx], dtype=torch.float32)
    correct_t = torch.tensor(correct, dtype=torch.float32)
    metrics = {"vloss": torch.stack(vlosses), "ploss": torch.tensor(plosses), "correct": correct_t,
               "total": total, "acc": correct_t / total.clamp(min=1.0)}
    return loss, metrics


def frequent_vocab(dataset, size: int, vocab_size: int) -> Tensor:
    """The ``size`` most frequent response tokens of a feature cache (long [size], sorted ids);
    ranking: :func:`vllm_clover.model.draft_vocab.token_ranking`."""
    from vllm_clover.model.draft_vocab import token_ranking

    return torch.sort(token_ranking(dataset, vocab_size)[:size]).values


@torch.no_grad()
def batch_vocab(base: Tensor, target_hidden: Tensor, loss_mask: Tensor, input_ids: Tensor,
                lm_head: Tensor, topk: int = 32, chunk_rows: int = 2048) -> Tensor:
    """Token subset for one batch's loss (``--train-vocab``): sorted unique long [V'].

    The union of ``base`` (the most frequent response tokens), every token of the batch
    (``input_ids`` [B, T]: a small model copies names and code from its prompt) and the
    target's ``topk`` tokens at each trained position (target_hidden [B, T, H] rows where
    loss_mask [B, T] is set), so the target's greedy token, and nearly all of its
    probability mass, is always inside the subset. One full-vocabulary product per trained
    row (shared by all heads) instead of eleven.
    """
    rows = target_hidden[loss_mask > 0]
    tops = [F.linear(rows[r:r + chunk_rows].to(lm_head.dtype), lm_head).topk(topk, dim=-1).indices.flatten()
            for r in range(0, len(rows), chunk_rows)]
    return torch.unique(torch.cat([base, input_ids.flatten(), *tops]))


# ============================================================================ batches
def epoch_batches(lengths: np.ndarray, batch_tokens: int, seed: int, epoch: int,
                  window: int = 64) -> list[list[int]]:
    """Seeded batch plan of one epoch: lists of sequence indices, B * max_len <= batch_tokens.

    Sequences are shuffled, then sorted by length within windows of ``window`` batches'
    worth of sequences (little padding, still random), packed greedily, and the batch
    order is shuffled. A pure function of its arguments: resuming replays it exactly.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    mean_len = max(float(np.mean(lengths)), 1.0) if len(lengths) else 1.0
    span = max(1, int(window * batch_tokens / mean_len))
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        part = order[start:start + span]
        part = part[np.argsort(-lengths[part], kind="stable")]
        cur: list[int] = []
        for i in part.tolist():
            if cur and (len(cur) + 1) * int(lengths[cur[0]]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    perm = rng.permutation(len(batches))
    return [batches[j] for j in perm]


class BatchPlan:
    """Global step -> batch of sequence indices, cycling through seeded epochs."""

    def __init__(self, lengths: np.ndarray, batch_tokens: int, seed: int) -> None:
        self.lengths, self.batch_tokens, self.seed = lengths, batch_tokens, seed
        self._epochs: list[list[list[int]]] = []

    def epoch(self, e: int) -> list[list[int]]:
        while len(self._epochs) <= e:
            self._epochs.append(epoch_batches(self.lengths, self.batch_tokens, self.seed, len(self._epochs)))
        return self._epochs[e]

    def steps_for_epochs(self, epochs: float) -> int:
        whole = int(epochs)
        steps = sum(len(self.epoch(e)) for e in range(whole))
        return steps + int(round((epochs - whole) * len(self.epoch(whole))))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, index in epoch) of global step ``step`` (0-based)."""
        e = 0
        while step >= len(self.epoch(e)):
            step -= len(self.epoch(e))
            e += 1
        return e, step


# ============================================================================ training
@dataclass
class TrainArgs:
    """Everything a training run depends on (saved in the checkpoint and training.json)."""

    out: str
    target: str | None = None
    method: str = "clover"
    variant: str = "clover2"
    data: str = "selfdistill"
    num_conversations: int = 1000
    max_len: int = 1024
    num_heads: int = 5
    num_layers: int = 2
    epochs: float | None = None
    steps: int | None = None
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01  # torch's AdamW default, as the official code
    warmup_steps: int | None = None  # None: 5% of the run (official: 8000 of 1.6M)
    grad_clip_value: float = 0.5
    batch_tokens: int = 8192
    seed: int = 0
    threads: int = 1
    save_every: int = 100
    train_vocab: int = 0  # 0 = full vocabulary (exact loss)
    # Target features and the drafter's products (autocast, LM-head products) in this dtype;
    # the CLI's "auto" picks float32 on CPUs without fast bf16 (cpu_env.fast_bf16_matmul).
    compute_dtype: str = "bfloat16"
    feature_cache: str | None = None
    distill_max_new_tokens: int = 256
    distill_dtype: str = "float32"
    decay: float = 0.7
    v_w: float = 10.0
    p_w: float = 1.0
    token_value_init: str = "official"  # or "matched": match_token_value_scale (docs/training.md)
    # Start from these trained Clover heads instead of the target-derived init (fine-tuning
    # on more data; docs/training.md "Continuing from trained heads").
    init_from: str | None = None
    # Where features are computed and the drafter trained: "cpu" or a CUDA device ("cuda",
    # "cuda:1"). Same loss and data; only the speed (and float rounding) differ.
    device: str = "cpu"
    keep_checkpoint: bool = False
    command: str = ""

    # Fields that may differ between an interrupted run and its resumption.
    _RESUME_FREE = ("threads", "save_every", "keep_checkpoint", "command", "feature_cache", "device")

    def resume_key(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(d["betas"])
        return {k: v for k, v in d.items() if k not in self._RESUME_FREE}


CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.pt"


def resolve_device(name: str) -> torch.device:
    """``--device``: a torch device that exists here; :class:`TrainingError` naming why not."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainingError(f"--device {name!r} is not a torch device (use cpu or cuda[:N])") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise TrainingError(f"--device {name!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise TrainingError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise TrainingError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """What training.json records as the device: "cpu" or the GPU's name."""
    return "cpu" if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})"


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """A ``collate_features`` batch on ``device`` (no copy on CPU)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def loss_chunk_rows(device: torch.device) -> int:
    """Rows per LM-head chunk in :func:`clover_loss_backward`: small on CPU (bounded memory,
    no speed cost), large on a GPU where each chunk's kernel launches and syncs dominate."""
    return 1024 if device.type == "cpu" else 16384


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_training_state(out: Path, drafter: CloverDrafter, optimizer, scheduler, step: int,
                        args: TrainArgs, history: list[dict[str, Any]], elapsed: float) -> Path:
    """Write ``<out>/checkpoint/state.pt`` atomically (model fp32, optimizer, scheduler, RNG)."""
    ckpt = out / CHECKPOINT_DIR
    ckpt.mkdir(parents=True, exist_ok=True)
    state = {"model": drafter.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "step": step, "rng": _rng_state(),
             "args": args.resume_key(), "history": history, "elapsed": elapsed}
    tmp = ckpt / f".{STATE_FILE}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, ckpt / STATE_FILE)
    return ckpt / STATE_FILE


def rms(t: Tensor, mask: Tensor | None = None) -> float:
    """Root mean square of ``t`` [..., H] over all elements (rows with ``mask`` == 0 left out)."""
    t = t.detach().float()
    if mask is not None:
        t = t[mask.bool()]
    return float(t.pow(2).mean().sqrt())


def token_state_rms(drafter: CloverDrafter, batch: dict[str, Tensor]) -> dict[str, float]:
    """RMS of the state each Attention Decoder adds a token to, for ``match_token_value_scale``:
    the trunk's x_t (measured on ``batch``'s real positions) and, for head decoders, the
    normalised trunk output z, whose RMS is that of ``trunk_norm``'s weight."""
    z_rms = rms(drafter.trunk_norm.weight)
    if drafter.config.variant == "clover2":
        return {"trunk_decoder": rms(batch["x"], batch["attention_mask"]), "head_decoder": z_rms}
    return {f"head_decoders.{i}": z_rms for i in range(drafter.config.num_heads)}


def _linear_warmup_decay(warmup: int, total: int) -> Callable[[int], float]:
    """transformers' get_linear_schedule_with_warmup as a plain lambda."""
    def factor(step: int) -> float:
        if step < warmup:
            return float(step + 1) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    return factor


def _fmt_acc(acc: Sequence[float]) -> str:
    return "/".join(f"{a:.2f}" for a in acc)


def train(args: TrainArgs, resume: bool = False, stop_after: int | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Run (or resume) a training run; returns the ``training.json`` content.

    ``stop_after``: stop (after checkpointing) once this many steps are done in this call,
    to simulate an interruption (tests, ``--stop-after``). Raises :class:`TrainingError`.
    """
    t_start = time.perf_counter()
    if args.method not in METHODS:
        raise TrainingError(f"--method {args.method!r} is not supported (choose one of {', '.join(METHODS)})")
    if args.token_value_init not in ("official", "matched"):
        raise TrainingError(f"--token-value-init must be official or matched, got {args.token_value_init!r}")
    if args.method != "clover" and args.token_value_init != "official":
        raise TrainingError("--token-value-init applies to --method clover only")
    if args.variant not in ("clover2", "clover"):
        raise TrainingError(f"--variant must be clover2 or clover, got {args.variant!r}")
    if (args.epochs is None) == (args.steps is None):
        raise TrainingError("give exactly one of --epochs or --steps")
    if args.init_from is not None and args.method != "clover":
        raise TrainingError("--init-from applies to --method clover only")
    device = resolve_device(args.device)
    out = Path(args.out).expanduser()
    state_path = out / CHECKPOINT_DIR / STATE_FILE
    if resume and not state_path.is_file():
        raise TrainingError(f"--resume: no checkpoint at {state_path}")
    if not resume and (state_path.is_file() or (out / "training.json").is_file()):
        raise TrainingError(f"output directory {out} already holds a training run; "
                            "pass --resume to continue it or choose another --out")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_target(args.target)
    target_config = check_target(target)

    # ---- data and features (computed once, reused)
    t0 = time.perf_counter()
    chunks, label = select_conversations(args.data, args.num_conversations, target,
                                         args.distill_max_new_tokens, args.distill_dtype)
    if not chunks:
        raise TrainingError(f"no training conversations from --data {args.data}")
    t_data = time.perf_counter() - t0
    from vllm_clover.training.features import collate_features, load_target_head

    t0 = time.perf_counter()
    ds, cache_dirs = build_feature_chunks(target, chunks, label, args.max_len, args.compute_dtype,
                                          args.threads, args.feature_cache, str(device))
    t_features = time.perf_counter() - t0
    data_info = {"source": label, "feature_caches": [str(d) for d in cache_dirs], **ds.data_info()}

    # ---- model, frozen target head, optimizer
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    drafter, config = build_model_for_target(args, target, target_config)
    if args.init_from is not None:
        load_trained_heads(drafter, args.init_from, target_config)
        _log(f"initialised from the trained heads in {args.init_from}")
    norm_w, eps, lm_head, embed = load_target_head(target, dtype=torch.float32)
    norm_w, lm_head, embed = (t.to(device) for t in (norm_w, lm_head, embed))
    drafter.to(device)
    if args.method == "clover":
        # E = lm_head weight as in the official code; the LM-head products run in compute_dtype.
        drafter.bind_target(lm_head)
    else:
        drafter.bind_target(lm_head, embed)  # EAGLE reads the target's embedding, as vLLM shares it
    lm_head_compute = lm_head.to(getattr(torch, args.compute_dtype))
    vocab = frequent_vocab(ds, args.train_vocab, config.vocab_size).to(device) if args.train_vocab else None
    plan = BatchPlan(ds.lengths, args.batch_tokens, args.seed)
    if args.token_value_init == "matched" and args.init_from is None:
        first = to_device(collate_features([ds[i] for i in plan.epoch(0)[0]]), device)
        scales = match_token_value_scale(drafter, token_state_rms(drafter, first), rms(drafter.embed_weight))
        _log("token value projections initialised as s*I: " + ", ".join(f"{k} s={v:.1f}" for k, v in scales.items()))
    total_steps = args.steps if args.steps is not None else plan.steps_for_epochs(args.epochs)
    if total_steps < 1:
        raise TrainingError("the run has 0 steps (too few conversations or epochs)")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=tuple(args.betas),
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _linear_warmup_decay(warmup, total_steps))
    step, history, elapsed_before = 0, [], 0.0
    if resume:
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["args"] != args.resume_key():
            diff = sorted(k for k in args.resume_key() if state["args"].get(k) != args.resume_key()[k])
            raise TrainingError(f"--resume: {state_path} was made with different settings ({', '.join(diff)})")
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history, elapsed_before = state["step"], state["history"], state["elapsed"]
        _set_rng_state(state["rng"])
        _log(f"resumed {out} at step {step}/{total_steps}")
    out.mkdir(parents=True, exist_ok=True)

    # ---- loop
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
    t_loop = time.perf_counter()
    done_here = 0
    try:
        while step < total_steps:
            epoch, j = plan.locate(step)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            batch = to_device(collate_features([ds[i] for i in plan.epoch(epoch)[j]]), device)
            record = train_step(drafter, optimizer, scheduler, batch, norm_w, eps, lm_head_compute, vocab, args)
            step += 1
            done_here += 1
            # CPU time next to wall time: on a shared machine the two differ a lot.
            history.append({"step": step, "epoch": epoch, **record,
                            "wall_s": round(time.perf_counter() - wall0, 3),
                            "cpu_s": round(time.process_time() - cpu0, 3)})
            if bar is not None:
                recent = _window_metrics(history, 20)
                bar.set_postfix_str(f"loss={recent['loss']:.3f} acc={_fmt_acc(recent['acc'])}", refresh=False)
                bar.update(1)
            if step % args.save_every == 0 or step == total_steps or done_here == stop_after:
                save_training_state(out, drafter, optimizer, scheduler, step, args, history,
                                    elapsed_before + time.perf_counter() - t_loop)
            if stop_after is not None and done_here >= stop_after and step < total_steps:
                return {"interrupted_at_step": step}
    except KeyboardInterrupt:
        save_training_state(out, drafter, optimizer, scheduler, step, args, history,
                            elapsed_before + time.perf_counter() - t_loop)
        raise TrainingError(f"interrupted at step {step}; continue with --resume") from None
    finally:
        if bar is not None:
            bar.close()
    t_train = elapsed_before + time.perf_counter() - t_loop

    # ---- final artefacts
    drafter.cpu()
    save_model(out, drafter, config, args.method, target, target_config)
    if args.method == "clover":
        from vllm_clover.model.draft_vocab import save_draft_vocab, token_ranking

        save_draft_vocab(out, token_ranking(ds, config.vocab_size), data_info["source"])
    final = _window_metrics(history, max(1, min(50, len(history) // 10 or 1)))
    report = {
        "command": args.command,
        "args": asdict(args),
        "target": {"dir": str(target), "architecture": (target_config.get("architectures") or [None])[0],
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size},
        "device": device_name(device),
        "data": data_info,
        "steps": total_steps,
        "warmup_steps": warmup,
        "epochs_covered": round(_epochs_covered(plan, total_steps), 3),
        "train_vocab": ({"base": int(len(vocab)), "mean_per_step": round(float(np.mean(
            [h["vocab"] for h in history])), 1)} if vocab is not None else "full"),
        "wall_time_s": {"data": round(t_data, 1), "features": round(t_features, 1),
                        "training": round(t_train, 1),
                        "training_cpu": round(sum(h.get("cpu_s", 0.0) for h in history), 1),
                        "total_this_call": round(time.perf_counter() - t_start, 1)},
        "final_train_metrics": {"window_steps": final["steps"], "loss": round(final["loss"], 4),
                                "acc_per_head": [round(a, 4) for a in final["acc"]]},
        "num_trainable_params": sum(p.numel() for p in params),
        "threads": args.threads,
        "versions": {"torch": torch.__version__},
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    if not args.keep_checkpoint:
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    return report


def train_step(drafter: CloverDrafter, optimizer, scheduler, batch: dict[str, Tensor], norm_w: Tensor,
               eps: float, lm_head: Tensor, vocab: Tensor | None, args: TrainArgs) -> dict[str, Any]:
    """One optimizer step on a ``collate_features`` batch; returns its history record.

    x [B, T, H] (bf16 cache) -> fp32 drafter under autocast to ``args.compute_dtype``
    (bf16; none for float32) (Medusa / EAGLE get
    h-bar_t = RMSNorm(x_t) instead, what vLLM feeds them); targets h-bar_{t+1} [B, T, H] from
    the target's final norm; loss and backward by clover_loss_backward over the full
    vocabulary or this batch's subset (``vocab`` = base subset, see batch_vocab), with the
    method's loss weights (:func:`loss_settings`).
    """
    from vllm_clover.training.features import rms_norm, shifted_postnorm_targets

    if getattr(drafter, "input_kind", "prenorm") == "postnorm":
        x = rms_norm(batch["x"], norm_w, eps)
    else:
        x = batch["x"].float()
    target_hidden = shifted_postnorm_targets(batch["x"], batch["lengths"], norm_w, eps)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.compute_dtype == "bfloat16"):
        outputs = drafter.forward_train(x, batch["input_ids_shifted"], batch["attention_mask"])
    optimizer.zero_grad(set_to_none=True)
    step_vocab = None if vocab is None else batch_vocab(
        vocab, target_hidden, batch["loss_mask"], batch["input_ids"], lm_head)
    decay, v_w, p_w = loss_settings(args)
    loss, m = clover_loss_backward(outputs, target_hidden, lm_head, batch["loss_mask"],
                                   decay, v_w, p_w, vocab=step_vocab, chunk_rows=loss_chunk_rows(x.device))
    torch.nn.utils.clip_grad_value_([p for p in drafter.parameters() if p.requires_grad],
                                    args.grad_clip_value)
    optimizer.step()
    scheduler.step()
    return {"loss": loss,
            "vloss": [round(v, 5) for v in m["vloss"].tolist()],
            "ploss": [round(v, 5) for v in m["ploss"].tolist()],
            "correct": m["correct"].tolist(), "total": m["total"].tolist(),
            "vocab": drafter.config.vocab_size if step_vocab is None else len(step_vocab),
            "lr": scheduler.get_last_lr()[0]}


def _window_metrics(history: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Mean loss and pooled per-head accuracy over the last ``n`` steps."""
    recent = history[-n:]
    correct = np.sum([h["correct"] for h in recent], axis=0)
    total = np.maximum(np.sum([h["total"] for h in recent], axis=0), 1)
    return {"steps": len(recent), "loss": float(np.mean([h["loss"] for h in recent])),
            "acc": (correct / total).tolist()}


def _epochs_covered(plan: BatchPlan, steps: int) -> float:
    epoch, j = plan.locate(steps - 1)
    return epoch + (j + 1) / len(plan.epoch(epoch))
