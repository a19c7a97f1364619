"""The target's token table and LM head as one tensor-parallel rank holds them.

Under tensor parallelism vLLM splits the target's ``VocabParallelEmbedding`` / ``ParallelLMHead``
by vocabulary: rank r keeps rows ``[start, end)`` of the (padded) table, ``weight [P, H]`` with
``P = padded vocab / tp``. The drafter's E (the token table of the Regressive Connection) and
LMHead are those rows, so Clover runs vocab-parallel the way vLLM's EAGLE shares the target's
head (``LogitsProcessor``):

* ``embed(ids)``: each rank looks up the ids it holds, zeros elsewhere, then an all-reduce
  (what ``VocabParallelEmbedding.forward`` does);
* ``logits(h)``: each rank's ``h @ weight.T`` [.., P], all-gathered along the vocabulary (the
  shards are contiguous in id order) and cut to the real vocabulary [.., V];
* the reduced draft vocabulary (draft_vocab.py): each rank's ``draft_rows(ids)`` [N, H] holds the
  rows of the draft ids it owns and zeros for the others, so the sum over ranks of
  ``h @ rows.T`` is the exact [.., N] draft logits: one all-reduce of B x N floats per head step.

Every rank then holds the same states, logits and drafts, so every rank drafts the same tree and
verifies it with its own attention heads. With one rank nothing is gathered or reduced.
The heads themselves (fusion, attention decoders, projections) are replicated; the Augmenting
Block is a vLLM ``LlamaDecoderLayer`` and is sharded like the target's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def tp_group() -> Any | None:
    """vLLM's tensor-parallel ``GroupCoordinator`` when it has several ranks, else None."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group if group.world_size > 1 else None


@dataclass
class TargetVocab:
    """The rows of the target's LM head this rank holds (all of them with one rank).

    ``weight`` [P, H]: this rank's rows (padding included); ``start``: the global id of row 0;
    ``real``: how many of the rows are real tokens (ids ``[start, start + real)``);
    ``vocab_size`` V: the real vocabulary; ``group``: the TP group, None with one rank."""

    weight: Tensor
    start: int
    real: int
    vocab_size: int
    group: Any | None = None

    @classmethod
    def of(cls, head: torch.nn.Module, vocab_size: int) -> "TargetVocab":
        """This rank's part of the target's ``ParallelLMHead`` ``head`` (vocabulary V)."""
        weight = head.weight
        group = tp_group()
        indices = getattr(head, "shard_indices", None)
        if group is None or indices is None:
            return cls(weight=weight, start=0, real=min(vocab_size, weight.shape[0]), vocab_size=vocab_size)
        if getattr(head, "num_added_embeddings", 0):
            raise NotImplementedError("vllm-clover: a target LM head with added (LoRA extra) vocabulary "
                                      "under tensor parallelism is not supported")
        start = indices.org_vocab_start_index
        return cls(weight=weight, start=start, real=indices.org_vocab_end_index - start,
                   vocab_size=vocab_size, group=group)

    @property
    def sharded(self) -> bool:
        return self.group is not None

    @property
    def full_weight(self) -> Tensor:
        """The whole table [V, H] (one rank only)."""
        if self.sharded:
            raise RuntimeError("vllm-clover: the LM head is split over tensor-parallel ranks")
        return self.weight[: self.vocab_size]

    # ------------------------------------------------------------------ the drafter's E and LMHead
    def embed(self, ids: Tensor) -> Tensor:
        """E[ids]: ids [...] (long) -> [..., H] in the table's dtype."""
        if not self.sharded:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.start + self.real)
        local = F.embedding(torch.where(inside, ids - self.start, torch.zeros_like(ids)), self.weight)
        return self.group.all_reduce(local * inside.unsqueeze(-1).to(local.dtype))

    def gather_logits(self, local: Tensor) -> Tensor:
        """This rank's logits [..., P] -> the whole vocabulary's [..., V]."""
        if not self.sharded:
            return local[..., : self.vocab_size]
        return self.group.all_gather(local.contiguous(), dim=-1)[..., : self.vocab_size]

    def logits(self, h: Tensor) -> Tensor:
        """LMHead(h): h [..., H] -> [..., V]."""
        return self.gather_logits(F.linear(h.to(self.weight.dtype), self.weight))

    # ------------------------------------------------------------------ the draft vocabulary
    def draft_rows(self, ids: Tensor) -> Tensor:
        """LM-head rows of the draft vocabulary ``ids`` [N] -> [N, H]: this rank's rows, zeros for
        ids another rank holds (all rows with one rank). Sum the products over ranks:
        :meth:`reduce_draft_logits`."""
        if not self.sharded:
            return self.weight[ids].contiguous()
        inside = (ids >= self.start) & (ids < self.start + self.real)
        rows = self.weight[torch.where(inside, ids - self.start, torch.zeros_like(ids))]
        return (rows * inside.unsqueeze(-1).to(rows.dtype)).contiguous()

    def reduce_draft_logits(self, partial: Tensor) -> Tensor:
        """The sum over ranks of ``h @ draft_rows.T`` [..., N]: the draft logits."""
        return partial if not self.sharded else self.group.all_reduce(partial)


# ============================================================================ one choice for all ranks
def from_first_rank(values: Sequence[int]) -> list[int]:
    """``values`` as tensor-parallel rank 0 has them, on every rank (unchanged with one rank).

    What a rank decides from its own clock (the adaptive tree's shape, whether a cached cost
    curve is used, where calibration stops) must be the same on every rank: each rank drafts
    and verifies the tree itself, and the target's forward passes are collectives that every
    rank must enter the same number of times. Every rank passes a list of the same length;
    it travels over the group's CPU (gloo) communicator, so no device sync is added."""
    group = tp_group()
    if group is None:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.int64)
    torch.distributed.broadcast(t, src=group.ranks[0], group=group.cpu_group)
    return t.tolist()


def is_first_rank() -> bool:
    """True on tensor-parallel rank 0 (and with one rank)."""
    group = tp_group()
    return group is None or group.rank_in_group == 0
