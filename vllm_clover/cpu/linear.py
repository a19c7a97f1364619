"""Packed matmuls for the drafter on vLLM's CPU build, and the float32 kernel for the target.

Why: the drafter's own ``nn.Linear`` layers (the Attention Decoders' q/k/v, ``head0_proj``,
``head_proj``, Clover-1's ResBlocks) and its reduced-vocabulary LM head would run through
``torch.nn.functional.linear``, which at the drafter's row counts (1 to 8) is markedly slower
than the oneDNN primitives vLLM's CPU build gives the target's layers
(``vllm/model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm``: one handler created
over the weight at load, ``ops.onednn_mm`` per call): ~1.4x for heads 0 and 1 plus two
4,096-row draft LM-head products on an AVX2 CPU.

The packed handler holds its own copy of the weight in oneDNN's layout, so a packed layer
must not have its weight changed afterwards (the proposer packs after loading, once).

Draft matmuls in bfloat16 (option ``draft_dtype``, ``draft_matmul_dtype``): at batch 1 the
drafter's 18 products stream ~59 MB of float32 weights per step (two Augmenting layers, the
Attention Decoders, two 4,096-row LM-head products), about 11% of the target's bytes, and
bfloat16 copies halve them (docs/design-proposer.md). Only the products change dtype: inputs
are cast down, outputs back up, and norms, gates, attention and the KV cache stay in the
model's dtype. Drafts may differ in rare near-ties; verification keeps output exactly the
target's.

Where the float32 linear kernel runs (below) and the model is float32, the drafter's products go
through it too (:class:`KernelLinear`, :func:`drafter_product`), with ``draft_dtype`` bfloat16
over bfloat16 copies of the weights (float32 inputs, products and sums): 1.3x and 2.1x faster
than oneDNN float32 at one row (docs/cpu-linear.md, "bfloat16 weights for the drafter"). That is
also the only bfloat16 drafting an AVX2-only CPU has. CPUs that multiply bfloat16 natively keep
oneDNN's bfloat16 primitive.

The target's float32 linears (patch ``cpu-fp32-linear-kernel``, :func:`wrap_dispatch`):
on AVX-512 and AVX2 CPUs every float32 linear layer vLLM builds, the target's and the LM head
included, runs through ``vllm_clover.kernels.linear_cpu`` instead of oneDNN, in every engine of
a process where the plugin is loaded (plain vLLM too, so speed comparisons stay like for like):
one to ~40 rows cost less there, which is what decoding and tree verification run
(docs/cpu-linear.md). ``VLLM_CLOVER_CPU_LINEAR=0`` restores vLLM's dispatch.
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


def native_bf16_matmul() -> bool:
    """Does this CPU multiply bfloat16 natively (AVX512-BF16 or AMX)? Elsewhere oneDNN
    converts, and bfloat16 weights would not make drafting faster."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def onednn_bf16_matmul() -> bool:
    """Can vLLM's oneDNN build multiply bfloat16 on this CPU? It needs AVX-512 (converting) or
    AMX. On an AVX2-only CPU creating the primitive fails: "could not create a primitive
    descriptor for the matmul primitive"."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" or bool(torch.cpu._is_amx_tile_supported())


def fp32_kernel_usable() -> bool:
    """Does ``vllm_clover.kernels.linear_cpu`` run float32 linears in this process: vLLM's CPU build (not
    AMD's zentorch one), an AVX-512 or AVX2 CPU, the kernel not turned off?"""
    from vllm.platforms import current_platform

    from vllm_clover.kernels import linear_cpu

    return (current_platform.is_cpu() and not current_platform.is_zen_cpu() and linear_cpu.enabled()
            and linear_cpu.supported())


def draft_matmul_dtype(option: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the drafter's products for the ``draft_dtype`` option: "auto" is bfloat16
    for a float32 model on a CPU with native bfloat16 matmuls or the float32 linear kernel
    (bfloat16 weights), else the model's."""
    if option == "auto":
        halves = native_bf16_matmul() or fp32_kernel_usable()
        return torch.bfloat16 if model_dtype == torch.float32 and halves else model_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[option]


class PackedLinear:
    """``x @ weight.T + bias`` through a oneDNN handler built once over ``weight`` [N, K].

    Call with x [..., K] (any leading shape, x.dtype == weight.dtype) -> [..., N] in x's
    dtype. With ``compute_dtype`` the handler holds a copy of the weight in that dtype and
    each call casts x to it and the product back (the bias is added in x's dtype).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        from vllm import _custom_ops as ops

        if weight.dim() != 2:
            raise ValueError(f"PackedLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        self._ops = ops
        self.bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = weight.dtype if compute_dtype is None else compute_dtype
        if self.compute_dtype == torch.bfloat16 and not onednn_bf16_matmul():
            raise ValueError(
                "vllm-clover: the drafter's bfloat16 products need a CPU with AVX-512 or AMX for "
                f"oneDNN (this CPU: {torch.backends.cpu.get_cpu_capability()}), or a float32 model "
                "with the float32 linear kernel on (VLLM_CLOVER_CPU_LINEAR); use draft_dtype 'auto' "
                "or 'float32'")
        # vLLM's own call for the target's linears (utils.py); 32 = primitive cache entries,
        # one per distinct row count.
        self.handler: Any = ops.create_onednn_mm(weight.detach().to(self.compute_dtype).t(), 32)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype == self.compute_dtype:
            return self._ops.onednn_mm(self.handler, x.contiguous(), self.bias)
        y = self._ops.onednn_mm(self.handler, x.to(self.compute_dtype).contiguous(), None).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


class KernelLinear:
    """``x @ weight.T + bias`` through ``vllm_clover.kernels.linear_cpu`` over a copy of the float32
    ``weight`` [N, K] packed in ``weight_dtype`` (float32; bfloat16: rounded weights, half the
    bytes). Call with float32 x [..., K] -> float32 [..., N]."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None,
                 weight_dtype: torch.dtype = torch.float32) -> None:
        from vllm_clover.kernels import linear_cpu

        if weight.dim() != 2:
            raise ValueError(f"KernelLinear needs a 2-D weight, got shape {tuple(weight.shape)}")
        self._linear = linear_cpu.linear
        self.out_features, self.in_features = weight.shape
        self.packed = linear_cpu.pack_weight(weight.detach(), weight_dtype)
        self.bias = None if bias is None else bias.detach().float()

    def __call__(self, x: Tensor) -> Tensor:
        return self._linear(x, self.packed, self.out_features, self.bias)


def drafter_product(weight: Tensor, bias: Tensor | None = None,
                    compute_dtype: torch.dtype | None = None) -> KernelLinear | PackedLinear:
    """The drafter's packed product ``x @ weight.T + bias`` in ``compute_dtype`` (None: the
    weight's dtype): the float32 kernel for a float32 weight where it runs
    (:func:`fp32_kernel_usable`; bfloat16 as bfloat16 weights, except on CPUs that multiply
    bfloat16 natively, which keep oneDNN's bfloat16 primitive), else :class:`PackedLinear`."""
    compute = weight.dtype if compute_dtype is None else compute_dtype
    if (weight.dtype == torch.float32 and compute in (torch.float32, torch.bfloat16) and fp32_kernel_usable()
            and not (compute == torch.bfloat16 and native_bf16_matmul())):
        return KernelLinear(weight, bias, compute)
    return PackedLinear(weight, bias, compute_dtype)


def pack_linears(module: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Route every plain ``nn.Linear`` inside ``module`` through a :func:`drafter_product`
    (its ``forward`` becomes the packed call; parameters stay, for ``state_dict``).

    vLLM's own linear layers (``LinearBase``, e.g. the Augmenting-Block layers) are not
    ``nn.Linear`` and already go through vLLM's dispatch (:func:`repack_vllm_linears` changes
    their dtype). Returns the number packed.
    """
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.forward = drafter_product(sub.weight, sub.bias, compute_dtype)  # type: ignore[method-assign]
            count += 1
    return count


def repack_vllm_linears(loaded: list[tuple[nn.Module, Tensor]], compute_dtype: torch.dtype) -> int:
    """Give vLLM linear layers products in ``compute_dtype``: ``loaded`` pairs each layer with
    the weight it was loaded with (vLLM's CPU dispatch frees ``layer.weight`` once it has
    packed it: ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, linear.py:216).
    Their ``cpu_linear`` (what ``cpu_unquantized_gemm`` calls, utils.py) becomes a
    :func:`drafter_product` over that weight. Returns the number repacked."""
    for layer, weight in loaded:
        if not callable(getattr(layer, "cpu_linear", None)):
            raise RuntimeError(f"vllm-clover: {type(layer).__name__} has no cpu_linear to repack "
                               "(vLLM's CPU linear dispatch changed; see vllm_clover/patches/)")
        packed = drafter_product(weight, compute_dtype=compute_dtype)
        layer.cpu_linear = lambda x, _w, bias, p=packed: p(x) if bias is None else p(x) + bias
    return len(loaded)


def uses_fp32_kernel(layer: nn.Module) -> bool:
    """Will :func:`wrap_dispatch`'s dispatch give ``layer`` the float32 kernel?
    A float32 2-D weight where the kernel runs (:func:`fp32_kernel_usable`)."""
    weight = getattr(layer, "weight", None)
    return (isinstance(weight, Tensor) and not weight.is_meta and weight.dim() == 2
            and weight.dtype == torch.float32 and fp32_kernel_usable())


def wrap_dispatch(original: Any) -> Any:
    """vLLM's ``dispatch_cpu_unquantized_gemm(layer, remove_weight)`` (called at load by
    ``UnquantizedLinearMethod`` and ``VocabParallelEmbedding``'s LM head, both importing it
    from ``vllm.model_executor.layers.utils`` at call time) with the float32 kernel: layers
    for which :func:`uses_fp32_kernel` holds get ``layer.cpu_linear`` over a packed copy of
    their weight (freed afterwards when vLLM would free it); every other layer goes to
    ``original``. Installed by the patch ``cpu-fp32-linear-kernel`` (vllm_clover/patches/cpu.py)."""

    def dispatch_cpu_unquantized_gemm(layer: nn.Module, remove_weight: bool) -> None:
        if not uses_fp32_kernel(layer):
            return original(layer, remove_weight)
        from vllm_clover.kernels import linear_cpu

        out_features = layer.weight.shape[0]
        packed = linear_cpu.pack_weight(layer.weight)
        layer.cpu_linear = lambda x, _weight, bias: linear_cpu.linear(x, packed, out_features, bias)
        if remove_weight:  # as vLLM's dispatch does: the packed copy is all the layer needs
            layer.weight = nn.Parameter(torch.empty(0, dtype=torch.float32), requires_grad=False)

    return dispatch_cpu_unquantized_gemm
