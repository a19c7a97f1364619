"""The settings of a training run (:class:`TrainArgs`), their checks and the training device.

:class:`TrainArgs` is what ``vllm-clover train`` fills in; it is saved in the checkpoint
(``resume_key``: the settings a resumed run must share) and in ``training.json``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_clover.training.baselines import METHODS


class TrainingError(RuntimeError):
    """Bad input or state for training / evaluation; the message is one line."""


def env_rank() -> int:
    """This process's rank in a torchrun job (``$RANK``; 0 outside one)."""
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def log(msg: str) -> None:
    """One progress line on stderr; in a data-parallel run rank 0's only (every rank would
    print the same line: the ranks share one state)."""
    if env_rank() == 0:
        print(f"[vllm-clover] {msg}", file=sys.stderr, flush=True)


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
    # Cross-entropy over the first N ids of the draft-vocabulary ranking only, the vocabulary
    # the heads are served with (draft_vocab_size); 0: off (docs/training.md).
    draft_vocab: int = 0
    # With a corpus as --data: train on its sequences inside corpus tokens [start, end).
    token_range: tuple[int, int] | None = None
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
    # on more data; train.load_trained_heads).
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
        d["token_range"] = None if d["token_range"] is None else list(d["token_range"])
        return {k: v for k, v in d.items() if k not in self._RESUME_FREE}

    def validate(self) -> None:
        """Refuse contradictory or unknown settings with one line (:class:`TrainingError`)."""
        if self.method not in METHODS:
            raise TrainingError(f"--method {self.method!r} is not supported (choose one of {', '.join(METHODS)})")
        if self.token_value_init not in ("official", "matched"):
            raise TrainingError(f"--token-value-init must be official or matched, got {self.token_value_init!r}")
        if self.method != "clover" and self.token_value_init != "official":
            raise TrainingError("--token-value-init applies to --method clover only")
        if self.variant not in ("clover2", "clover"):
            raise TrainingError(f"--variant must be clover2 or clover, got {self.variant!r}")
        if (self.epochs is None) == (self.steps is None):
            raise TrainingError("give exactly one of --epochs or --steps")
        if self.init_from is not None and self.method != "clover":
            raise TrainingError("--init-from applies to --method clover only")
        if self.draft_vocab and self.train_vocab:
            raise TrainingError("give at most one of --draft-vocab and --train-vocab")
        if self.draft_vocab < 0 or self.train_vocab < 0:
            raise TrainingError("--draft-vocab and --train-vocab must be >= 0")
        if self.token_range is not None:
            from vllm_clover.training.corpus import is_corpus

            if not is_corpus(self.data):
                raise TrainingError(f"--token-range needs a corpus directory as --data (got {self.data!r})")


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
