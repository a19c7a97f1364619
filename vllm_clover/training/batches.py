"""From sequences to training batches: the seeded epoch plan and the padded batch.

:func:`epoch_batches` / :class:`BatchPlan` decide which sequences form each step's batch (a
pure function of the seed, so a resumed run replays the same batches); :func:`collate_features`
pads those sequences and their cached features into tensors, :func:`collate_sequences` the
sequences alone (a corpus, whose features are computed per batch:
:mod:`~vllm_clover.training.stream`).

The shift convention
--------------------
:func:`collate_features` pads a list of sequences to T = max length and returns

* ``x`` [B,T,H] bf16: x_t (zero on padding);
* ``input_ids`` [B,T] int64: y_t, unshifted (0 on padding);
* ``input_ids_shifted`` [B,T] int64: y_{t+1}, the token that x_t predicts; 0 at the last
  position of each sequence and on padding;
* ``loss_mask`` [B,T] float32: loss_mask[y_{t+1}], i.e. position t is trained iff y_{t+1} is
  an assistant token; 0 at the last position and on padding;
* ``attention_mask`` [B,T] int64: 1 for t < L (the last real position included: x_{L-1} is a
  valid input, it only lacks a label); ``lengths`` [B] int64.

Head i (i = 0, 1, ...) at position t predicts y_{t+2+i}; its regression target is
h̄_{t+1+i} = RMSNorm(x_{t+1+i}), computed by the trainer from ``x`` with the target's final
norm (:func:`features.load_target_head`, :func:`features.shifted_postnorm_targets`), and its mask is
``loss_mask[:, i:]`` as in the Clover-2 code.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

Tensor = torch.Tensor


# ============================================================================ the plan
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

    def epochs_covered(self, steps: int) -> float:
        """How many epochs the first ``steps`` steps cover (fractional)."""
        epoch, j = self.locate(steps - 1)
        return epoch + (j + 1) / len(self.epoch(epoch))


# ============================================================================ the batch
def shift_sequence(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L] ids and mask -> ([L] y_{t+1}, [L] mask of y_{t+1}); the last position gets 0."""
    ids = torch.zeros_like(input_ids)
    mask = torch.zeros_like(loss_mask)
    ids[:-1] = input_ids[1:]
    mask[:-1] = loss_mask[1:]
    return ids, mask


def collate_sequences(batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad sequences (``input_ids`` [L], ``loss_mask`` [L]) into a training batch without the
    target's features (right padding): input_ids [B,T], input_ids_shifted [B,T] (y_{t+1}),
    loss_mask [B,T] float32 (assistant bit of y_{t+1}), attention_mask [B,T], lengths [B];
    the last real position and padding have shifted id 0 and mask 0 (module docstring)."""
    lengths = torch.tensor([len(item["input_ids"]) for item in batch], dtype=torch.int64)
    b, t = len(batch), int(lengths.max())
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "input_ids_shifted": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=torch.float32),
        "attention_mask": torch.zeros(b, t, dtype=torch.int64),
        "lengths": lengths,
    }
    for row, item in enumerate(batch):
        n = len(item["input_ids"])
        shifted_ids, shifted_mask = shift_sequence(torch.as_tensor(item["input_ids"]).to(torch.int64),
                                                   torch.as_tensor(item["loss_mask"]))
        out["input_ids"][row, :n] = torch.as_tensor(item["input_ids"])
        out["input_ids_shifted"][row, :n] = shifted_ids
        out["loss_mask"][row, :n] = shifted_mask.to(torch.float32)
        out["attention_mask"][row, :n] = 1
    return out


def collate_features(batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad sequences from :class:`features.FeatureDataset` into a training batch: the
    :func:`collate_sequences` batch plus x [B,T,H] (the cached ``hidden``, zero past each
    sequence's end)."""
    out = collate_sequences(batch)
    b, t = out["input_ids"].shape
    x = torch.zeros(b, t, batch[0]["hidden"].shape[-1], dtype=batch[0]["hidden"].dtype)
    for row, item in enumerate(batch):
        x[row, :len(item["input_ids"])] = item["hidden"]
    return {"x": x, **out}


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """A ``collate_features`` batch on ``device`` (no copy on CPU)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
