"""oneDNN-packed matmuls for the drafter on vLLM's CPU build.

Why: the drafter's own ``nn.Linear`` layers (the Attention Decoders' q/k/v, ``head0_proj``,
``head_proj``, Clover-1's ResBlocks) and its reduced-vocabulary LM head would run through
``torch.nn.functional.linear``, which at the drafter's row counts (1 to 8) is markedly slower
on this CPU than the oneDNN primitives vLLM's CPU build gives the target's layers
(``vllm/model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm``: one handler created
over the weight at load, ``ops.onednn_mm`` per call). Measured here (2-core AMD EPYC, AVX2,
float32, caches evicted between steps): Clover-2 heads 0 and 1 plus two 4,096-row draft LM-head
products, 3.4-4.0 ms per step with ``F.linear`` against 2.5-2.7 ms packed.

The packed handler holds its own copy of the weight in oneDNN's layout, so a packed layer
must not have its weight changed afterwards (the proposer packs after loading, once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def onednn_available() -> bool:
    """True on vLLM's CPU build with its oneDNN matmul ops (``ops._supports_onednn``)."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and bool(getattr(ops, "_supports_onednn", False))


class PackedLinear:
    """``x @ weight.T + bias`` through a oneDNN handler built once over ``weight`` [N, K].

    Call with x [..., K] (any leading shape, x.dtype == weight.dtype) -> [..., N].
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        from vllm import _custom_ops as ops

        if weight.dim() != 2:
            raise ValueError(f"PackedLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        self._ops = ops
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = weight.shape
        # vLLM's own call for the target's linears (utils.py); 32 = primitive cache entries,
        # one per distinct row count.
        self.handler: Any = ops.create_onednn_mm(weight.detach().t(), 32)

    def __call__(self, x: Tensor) -> Tensor:
        return self._ops.onednn_mm(self.handler, x.contiguous(), self.bias)


def pack_linears(module: nn.Module) -> int:
    """Route every plain ``nn.Linear`` inside ``module`` through a :class:`PackedLinear`
    (its ``forward`` becomes the packed call; parameters stay, for ``state_dict``).

    vLLM's own linear layers (``LinearBase``, e.g. the Augmenting-Block layers) are not
    ``nn.Linear`` and already go through vLLM's dispatch. Returns the number packed.
    """
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.forward = PackedLinear(sub.weight, sub.bias)  # type: ignore[method-assign]
            count += 1
    return count
