"""vLLM's CPU LoRA ops with no-adapter rows left alone (patch ``cpu-lora-no-adapter-rows``).

On the CPU platform vLLM applies LoRA with the PyTorch ops of
``vllm/lora/ops/torch_ops/lora_ops.py`` (``PunicaWrapperCPU``). Their token index -1 means
"no adapter for this row" (``PunicaWrapperBase``), which the Triton kernels honour by not
touching the row; the PyTorch ops gather ``lora_weights[indices]`` with it, and -1 selects the
*last* adapter slot. With the default ``max_loras=1`` that is the loaded adapter: a request
without an adapter batched next to one with it gets the adapter's update, silently (it also
makes a plain-vLLM reference of a mixed batch wrong). vllm-project/vllm#48421 fixes the same in
vLLM.

:func:`skip_rows_without_adapter` wraps each of ``bgmv_shrink``, ``bgmv_expand`` and
``bgmv_expand_slice`` (the ``sgmv_*`` ops call them): a call whose rows all have an adapter is
vLLM's own, bit for bit; a call with no such row writes nothing; otherwise vLLM's op runs with
the -1 indices clamped to a valid slot and the rows without an adapter get their previous
values back, as the Triton kernels leave them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

# The ops wrapped, all with (inputs, lora_weights, output_tensor, lora_indices_tensor, ...).
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
NO_ADAPTER = -1  # PunicaWrapperBase's index for a row without an adapter


def skip_rows_without_adapter(op: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(op)
    def wrapped(inputs: torch.Tensor, lora_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        missing = lora_indices_tensor == NO_ADAPTER  # [rows] bool
        if not bool(missing.any()):
            return op(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        if bool(missing.all()):
            return None
        if lora_indices_tensor.shape[0] != output_tensor.shape[0]:
            raise RuntimeError(f"vllm-clover: LoRA op {op.__name__} got {lora_indices_tensor.shape[0]} "
                               f"indices for {output_tensor.shape[0]} output rows")
        rows = missing.nonzero().squeeze(1)
        kept = output_tensor[rows].clone()  # [rows without adapter, out]
        op(inputs, lora_weights, output_tensor, lora_indices_tensor.clamp(min=0), *args, **kwargs)
        output_tensor[rows] = kept
        return None

    return wrapped
