"""float32 linear layers on AVX-512 and AVX2 CPUs: a C++ kernel (``csrc/linear_cpu.cpp``) for
``x @ W.T (+ bias)`` over a weight packed once at load, compiled on first use for this CPU's ISA.

Why: vLLM's CPU build runs float32 weights through oneDNN (``dispatch_cpu_unquantized_gemm``),
which at decoding's and tree verification's row counts (1 to ~40) is far from the machine's
bounds on AVX-512 and AVX2 CPUs alike; this kernel streams each weight vector once per tile of
up to 14 rows (timings: docs/cpu-linear.md). Every output
element is one in-order FMA chain over K, so a row's result does not depend on how many rows
share the call: the property greedy speculative decoding needs to stay token-identical to
one-row decoding.

The op is ``torch.ops.vllm_clover_cpu.linear_f32(x, packed, n, bias)`` (registered in C++, with
a shape-only fake for ``torch.compile``); :func:`linear` wraps it for any leading shape.
``linear_bf16w`` is the same over weights packed in bfloat16 (``pack_weight(W, torch.bfloat16)``):
half the bytes per pass, float32 inputs, products and sums, for the drafter's products where
its weights may be rounded (option ``draft_dtype``; never the target's).
``VLLM_CLOVER_CPU_LINEAR=0`` turns the kernel off (vLLM's oneDNN path then runs as before).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from vllm_clover.kernels.tree_attention_cpu import build_extension

SOURCE = Path(__file__).with_name("csrc") / "linear_cpu.cpp"
ENV_VAR = "VLLM_CLOVER_CPU_LINEAR"


def enabled() -> bool:
    """False when ``VLLM_CLOVER_CPU_LINEAR=0`` asks for vLLM's own float32 linears."""
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV_VAR}={value!r}; expected 0 or 1")
    return value != "0"


# torch's CPU capability -> the kernel's build flags (its register tiles are sized per ISA).
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}


def supported() -> bool:
    """The kernel needs AVX-512, or AVX2 with FMA; elsewhere vLLM's path stays."""
    return torch.backends.cpu.get_cpu_capability() in ISA_FLAGS


@functools.lru_cache(maxsize=1)
def load() -> Any:
    """Compile (first call on a machine: about half a minute) and import the kernel; also
    registers the op's fake (shape-only) implementation for ``torch.compile``."""
    # No -ffast-math: it would allow re-associating the FMA chains (the row-invariance above).
    capability = torch.backends.cpu.get_cpu_capability()
    if not supported():
        raise RuntimeError(f"the float32 linear kernel needs AVX-512 or AVX2 (this CPU: {capability})")
    # The flags are part of torch's build hash: another ISA gets its own build.
    module = build_extension("vllm_clover_linear_cpu", SOURCE, ["-O3", "-fopenmp", *ISA_FLAGS[capability]], ENV_VAR)

    def _linear_fake(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], n))

    for op in ("linear_f32", "linear_bf16w"):
        torch.library.register_fake(f"vllm_clover_cpu::{op}")(_linear_fake)

    return module


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] float32 -> the kernel's layout [ceil(N/16), K, 16] in ``dtype`` (a copy; W may
    be freed). ``torch.bfloat16`` rounds the weights to nearest-even bfloat16."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"pack_weight needs a float32 [N, K] CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_weight packs float32 or bfloat16 weights, not {dtype}")
    load()
    if dtype == torch.bfloat16:
        return torch.ops.vllm_clover_cpu.pack_bf16(weight.detach().to(torch.bfloat16))
    return torch.ops.vllm_clover_cpu.pack_f32(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [..., K] float32 and ``packed = pack_weight(W, dtype)`` ->
    [..., N] float32."""
    op = torch.ops.vllm_clover_cpu.linear_bf16w if packed.dtype == torch.bfloat16 else torch.ops.vllm_clover_cpu.linear_f32
    y = op(x.reshape(-1, x.shape[-1]), packed, out_features, bias)
    return y.reshape(*x.shape[:-1], out_features)
