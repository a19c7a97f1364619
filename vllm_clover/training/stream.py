"""Training on a tokenized corpus with the target's features computed per batch.

A corpus (:mod:`~vllm_clover.training.corpus`) holds token ids only. :class:`CorpusSlice` is
the training dataset for the sequences of one ``--token-range``; its :meth:`CorpusSlice.collate`
pads a batch and runs the target once over it (:class:`TargetFeatures`), so features are
never stored: disk use is the corpus (2 bytes a token) whatever the data size, and a run
over new tokens costs one target forward per token, the same as extracting them once.

A resumed run replays the same batch plan, and the target's forward is deterministic for a
given batch, thread count and device, so resumption stays exact. In a data-parallel run
(:mod:`~vllm_clover.training.distributed`) each rank collates only its share of a batch, so
the target runs on that share alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vllm_clover.training.batches import collate_sequences
from vllm_clover.training.corpus import Corpus

Tensor = torch.Tensor


class TargetFeatures:
    """The target's x_t (pre-final-norm last-layer states) for padded batches, on demand.

    ``__call__(input_ids [B,T], attention_mask [B,T]) -> x [B,T,H]`` in bfloat16 (what a
    feature cache stores), zero where ``attention_mask`` is 0, on ``device``.
    """

    def __init__(self, model_dir: str | os.PathLike, dtype: str, device: torch.device) -> None:
        from vllm_clover.training.features import load_target_for_features

        _model, self.decoder, self.norm = load_target_for_features(model_dir, dtype)
        _model.to(device)
        self.device = device
        self.seconds = 0.0  # wall seconds spent in the target's forward
        self.tokens = 0  # real (unpadded) tokens computed

    def __call__(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        import time

        t0 = time.perf_counter()
        x = self._forward(input_ids.to(self.device), attention_mask.to(self.device))
        # Cloned outside inference mode: autograd refuses to save inference tensors.
        x = x.clone()
        self.seconds += time.perf_counter() - t0
        self.tokens += int(attention_mask.sum())
        return x

    @torch.inference_mode()
    def _forward(self, ids: Tensor, att: Tensor) -> Tensor:
        from vllm_clover.training.features import prenorm_hidden

        x = prenorm_hidden(self.decoder, self.norm, ids, att).to(torch.bfloat16)
        return x * att.unsqueeze(-1).to(x.dtype)


class CorpusSlice:
    """The sequences of a corpus that lie in tokens [start, end), as a training dataset.

    ``ds[i]`` is ``{"input_ids": int64 [L], "loss_mask": uint8 [L]}``; ``ds.lengths`` int64
    [S]; :meth:`collate` gives a training batch with x computed by ``features`` (set
    :attr:`features` before the first call).
    """

    def __init__(self, corpus: Corpus, start: int | None = None, end: int | None = None) -> None:
        self.corpus = corpus
        total = int(corpus.offsets[-1])
        self.start, self.end = (0 if start is None else start), (total if end is None else min(end, total))
        self.seqs = corpus.token_range(self.start, self.end)
        self.lengths = np.asarray(corpus.lengths[self.seqs.start:self.seqs.stop], dtype=np.int64)
        self.features: TargetFeatures | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        ids, mask = self.corpus.sequence(self.seqs[index])
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask)}

    def collate(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """The padded batch of ``indices`` (:func:`batches.collate_sequences`) with its x."""
        if self.features is None:
            raise RuntimeError("CorpusSlice.features is not set")
        batch = collate_sequences([self[i] for i in indices])
        return {"x": self.features(batch["input_ids"], batch["attention_mask"]), **batch}

    def token_ranking(self, vocab_size: int) -> Tensor:
        """The corpus's draft-vocabulary ranking (long [V]): one ranking for every slice, so
        runs that continue each other on new tokens keep the same draft vocabulary."""
        if vocab_size != len(self.corpus.ranking):
            raise ValueError(f"corpus ranks {len(self.corpus.ranking)} tokens, the target has {vocab_size}")
        return torch.from_numpy(np.asarray(self.corpus.ranking, dtype=np.int64))

    def data_info(self) -> dict[str, Any]:
        mask_tokens = sum(int(self[i]["loss_mask"].sum()) for i in range(len(self)))
        sd = np.asarray(self.corpus.source[self.seqs.start:self.seqs.stop])
        return {"corpus": str(Path(self.corpus.path).resolve()), "token_range": [self.start, self.end],
                "num_sequences": len(self), "num_tokens": int(self.lengths.sum()),
                "num_loss_tokens": mask_tokens, "num_selfdistill_sequences": int(sd.sum())}
