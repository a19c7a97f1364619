"""The callables tree drafting takes: a head step (the model side) and a child choice.

Pure PyTorch; duck-typed on the drafter so that drafting/ does not import the model.
"""

from __future__ import annotations

from typing import Callable

import torch

Tensor = torch.Tensor

# (state [M, H], prev_token [M], head index) -> (new_state [M, H], logits [M, V])
HeadStepFn = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]
# (logits [M, V], k) -> (child tokens [M, k] in rank order, q [M, V] sampled from, or None)
TopkFn = Callable[[Tensor, int], tuple[Tensor, Tensor | None]]


def greedy_topk(logits: Tensor, k: int) -> tuple[Tensor, None]:
    """Deterministic top-k children (T = 0 drafting): logits [M, V] -> tokens [M, k], None."""
    return logits.topk(k, dim=-1).indices, None


def sampling_topk(temperature: float = 1.0, generator: torch.Generator | None = None) -> TopkFn:
    """k samples without replacement from softmax(logits / T), in draw order (EAGLE T > 0).

    Uses the exponential race: key_v = q_v / Exp(1); the descending order of the keys is
    distributed exactly like sequential draws without replacement. Returns (tokens [M, k],
    q [M, V] float32). If fewer than k tokens have q > 0, the extra picks have q = 0 and
    acceptance skips them.
    """
    if temperature <= 0:
        raise ValueError("sampling_topk needs temperature > 0; use greedy_topk for T = 0")

    def topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        q = torch.softmax(logits.float() / temperature, dim=-1)
        e = torch.empty_like(q).exponential_(1.0, generator=generator)
        return (q / e).topk(k, dim=-1).indices, q

    return topk


def drafter_head_step_fn(drafter, lm_head=None) -> HeadStepFn:
    """Adapter: a ``CloverDrafter`` (vllm_clover.model.drafter) as a :data:`HeadStepFn`.

    ``drafter.head_step(state, prev_token, i)`` returns (s_i, o_i); logits = LMHead(o_i).
    Duck-typed so this module does not import the model.
    """
    def step(state: Tensor, prev_token: Tensor, i: int) -> tuple[Tensor, Tensor]:
        s, o = drafter.head_step(state, prev_token, i)
        return s, drafter.logits(o, lm_head)
    return step
