"""Kernels for Clover tree verification: tree attention over a paged KV cache, and KV
compaction of the accepted path. Each has a PyTorch reference (``*_ref``, the CPU path and
the test oracle) and a Triton kernel (``*_triton``). Docs: docs/trees-and-kernels.md.
On CPU, tree verification inside vLLM uses the C++ kernel of ``vllm_clover.kernels.tree_attention_cpu``
(vLLM's CPU cache layout, read in place) instead.

Backend selection for integration code: :func:`tree_attention` / :func:`kv_compact` read
``VLLM_CLOVER_TREE_KERNELS`` on every call:

    torch   always the reference
    triton  always Triton (CPU tensors need TRITON_INTERPRET=1 set before this import)
    auto    (default, also when unset) Triton for CUDA tensors when Triton imports, else torch
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from .kv_compact import (HAS_TRITON, cache_table, kv_compact_layers_ref, kv_compact_layers_triton, kv_compact_ref,
                         kv_compact_triton)
from .tree_attention import (ancestor_bits, bits_to_mask, gather_paged, tree_attention_ref, tree_attention_triton,
                             tree_attention_varlen_ref, tree_attention_varlen_triton)

ENV_VAR = "VLLM_CLOVER_TREE_KERNELS"
BACKENDS = ("auto", "torch", "triton")

__all__ = ["ENV_VAR", "HAS_TRITON", "ancestor_bits", "backend_for", "bits_to_mask", "cache_table", "gather_paged",
           "kv_compact", "kv_compact_layers", "kv_compact_layers_ref", "kv_compact_layers_triton", "kv_compact_ref",
           "kv_compact_triton", "tree_attention", "tree_attention_ref", "tree_attention_triton",
           "tree_attention_varlen", "tree_attention_varlen_ref", "tree_attention_varlen_triton"]


def backend_for(device: torch.device) -> str:
    """Resolve ``VLLM_CLOVER_TREE_KERNELS`` for tensors on ``device``: "torch" or "triton"."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={choice!r}; expected one of {BACKENDS}")
    if choice == "auto":
        return "triton" if HAS_TRITON and device.type == "cuda" else "torch"
    if choice == "triton" and not HAS_TRITON:
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not importable")
    return choice


def tree_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    """Dispatching entry point; see :mod:`vllm_clover.kernels.tree_attention` for the contract."""
    fn = tree_attention_triton if backend_for(q.device) == "triton" else tree_attention_ref
    return fn(q, key_cache, value_cache, block_table, seq_lens, tree_mask, scale)


def kv_compact(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Dispatching entry point; see :mod:`vllm_clover.kernels.kv_compact` for the contract."""
    fn = kv_compact_triton if backend_for(src_slots.device) == "triton" else kv_compact_ref
    fn(caches, src_slots, dst_slots)


def tree_attention_varlen(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                          block_table: torch.Tensor, meta: torch.Tensor, anc_bits: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Dispatching entry point of the batched (varlen) tree attention; see
    :mod:`vllm_clover.kernels.tree_attention`, section "varlen"."""
    fn = tree_attention_varlen_triton if backend_for(q.device) == "triton" else tree_attention_varlen_ref
    return fn(q, key_cache, value_cache, out, block_table, meta, anc_bits, scale)


def kv_compact_layers(caches: Sequence[torch.Tensor], table: torch.Tensor, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
    """Dispatching entry point of the one-launch compaction of every layer; see
    :mod:`vllm_clover.kernels.kv_compact`, section "all layers"."""
    if backend_for(src.device) == "triton":
        kv_compact_layers_triton(caches, table, src, dst)
    else:
        kv_compact_layers_ref(caches, src, dst)
