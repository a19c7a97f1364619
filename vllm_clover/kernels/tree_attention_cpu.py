"""Tree-masked attention read in place from vLLM's CPU KV cache, and the KV compaction of
accepted paths: C++ kernels (``csrc/tree_attention_cpu.cpp``) compiled on first use with
``torch.utils.cpp_extension``.

Why: the PyTorch path gathers every tree request's paged K/V prefix per layer per step;
at batch 1 on a 2-core CPU that gather dominates the tree rows' cost (docs/tree-verification.md).
The contract is the one of ``tree_verify.tree_attention_rows`` for CPU_ATTN's layouts:
kv_cache [num_blocks, Hkv, block_size, 2*D], per (block, head) a key half then a value half,
in the order of the attention ISA vLLM picked (``layer.isa``; :data:`LAYOUTS`): ``vec`` /
``vec16`` store the key half transposed [D, block_size] and the value half [block_size, D];
``amx`` (bfloat16 on CPUs with AMX tiles) packs both for AMX tile loads (the C++ source has
the index formulas; ``vllm_clover.engine.tree_verify.cpu_cache_tokens`` reads them in PyTorch).

On CPUs with AMX tiles the kernel is built with them and multiplies ``amx`` blocks in place
(bf16 products, float accumulation and softmax; :func:`amx_tiles_usable`); elsewhere it reads
them through a float copy.

Building needs a C++ compiler (g++) and ninja; :func:`load` raises ``CpuKernelBuildError``
naming what failed. Set ``VLLM_CLOVER_CPU_TREE_KERNEL=0`` to use the PyTorch path instead.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("csrc") / "tree_attention_cpu.cpp"
ENV_VAR = "VLLM_CLOVER_CPU_TREE_KERNEL"


# vLLM CPU attention ISA -> the kernel's KV layout id (kLayoutVec / kLayoutAmx in the C++).
LAYOUTS = {"vec": 0, "vec16": 0, "amx": 1}


def layout_id(isa: str) -> int:
    """The kernel's layout id for a CPU attention ISA; ValueError names the ones it reads."""
    if isa not in LAYOUTS:
        raise ValueError(f"no CPU tree kernel for the {isa!r} KV layout (supported: {tuple(LAYOUTS)})")
    return LAYOUTS[isa]


class CpuKernelBuildError(RuntimeError):
    """The C++ tree-attention kernel could not be compiled or loaded."""


def enabled() -> bool:
    """False when ``VLLM_CLOVER_CPU_TREE_KERNEL=0`` asks for the PyTorch path."""
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV_VAR}={value!r}; expected 0 or 1")
    return value != "0"


def _isa_flags() -> list[str]:
    # Vectorise the position and head-dim loops for what this CPU has; the flags are part of
    # torch's build hash, so another CPU (or flag set) gets its own build.
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":  # the kernel's register tiles are sized for 32 zmm registers
        # + AMX tiles (and the AVX-512 extensions every AMX CPU has) for the amx layout
        amx = ["-mamx-tile", "-mamx-bf16", "-mavx512bf16", "-mavx512bw", "-mavx512vl"]
        return ["-mavx2", "-mfma", "-mavx512f", *(amx if torch.cpu._is_amx_tile_supported() else [])]
    return ["-mavx2", "-mfma"] if capability == "AVX2" else []


@functools.lru_cache(maxsize=1)
def amx_tiles_usable() -> bool:
    """The kernel may multiply amx-layout blocks with AMX tiles: it was built with them and
    Linux granted this process the tile state (``torch._C._cpu._init_amx``, the request
    vLLM's own AMX kernels rely on). Else those blocks go through a float copy."""
    return bool(load().has_amx_tiles()) and torch.cpu._is_amx_tile_supported() and torch._C._cpu._init_amx()


def build_extension(name: str, source: Path, cflags: list[str], env_var: str) -> Any:
    """Compile (first call on a machine: about a minute) and import the C++ extension
    ``name`` from ``source``; CpuKernelBuildError names what failed and ``env_var`` (the switch
    that turns the kernel off)."""
    from torch.utils import cpp_extension

    # torch finds ninja on PATH; a venv used without activation (`.venv/bin/vllm-clover serve`)
    # has its ninja (a vLLM dependency) next to the interpreter, not on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags, verbose=False)
    except Exception as exc:  # compiler missing, ninja missing, build error: all fatal here
        raise CpuKernelBuildError(
            f"vllm-clover: could not build the CPU kernel {source.name} "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
            f"install g++ and ninja, or set {env_var}=0 to run without it") from exc


@functools.lru_cache(maxsize=1)
def load() -> Any:
    """Compile (first call on a machine: about a minute) and import the kernel module."""
    return build_extension("vllm_clover_tree_attention_cpu", SOURCE,
                           ["-O3", "-ffast-math", "-fopenmp", *_isa_flags()], ENV_VAR)


def tree_attention_paged_cpu(query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                             meta: torch.Tensor, block_table: torch.Tensor, anc: torch.Tensor,
                             scale: float, isa: str = "vec") -> None:
    """Overwrite the tree rows of ``output`` in place.

    query, output  [T, Hq, D] (last dim contiguous; output may be a view of [T, Hq*D])
    kv_cache       [num_blocks, Hkv, block_size, 2*D], vLLM CPU_ATTN layout of ``isa``, contiguous
    meta           [R, 4] int64: per tree request (first row, rows n1 incl. root, root position,
                   row of ``block_table``)
    block_table    [num_reqs, max_blocks] int32
    anc            [R, NMAX, NMAX] uint8: anc[r, i, j] = node j is node i's ancestor or itself
    """
    if query.dtype != kv_cache.dtype or output.dtype != query.dtype:
        raise TypeError(f"dtype mismatch: query {query.dtype}, kv_cache {kv_cache.dtype}, output {output.dtype}")
    if query.stride(-1) != 1 or output.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("query/output need a contiguous last dim and kv_cache must be contiguous")
    if query.shape[1] % kv_cache.shape[1] or kv_cache.shape[3] != 2 * query.shape[2]:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, kv_cache {tuple(kv_cache.shape)}")
    if meta.dtype != torch.int64 or block_table.dtype != torch.int32 or anc.dtype != torch.uint8:
        raise TypeError("meta must be int64, block_table int32, anc uint8")
    if block_table.stride(-1) != 1 or not meta.is_contiguous() or not anc.is_contiguous():
        raise ValueError("meta, anc and the rows of block_table must be contiguous")
    layout = layout_id(isa)
    if layout == LAYOUTS["amx"] and (query.dtype != torch.bfloat16 or kv_cache.shape[2] % 16 or query.shape[2] % 16):
        raise ValueError(f"the amx KV layout needs bfloat16, block size and head size multiples of 16; "
                         f"got {query.dtype}, kv_cache {tuple(kv_cache.shape)}")
    amx_tiles = layout == LAYOUTS["amx"] and amx_tiles_usable()
    load().tree_attention_cpu(query, kv_cache, output, meta, block_table, anc, float(scale), layout, amx_tiles)


def rows_argmax_cpu(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(-1).indices`` for CPU logits [R, V] (float32, bfloat16 or float16, rows
    contiguous): the first index of each row's maximum, a NaN counting as the maximum;
    int64 [R]. Why: torch's row reduction is slow for the greedy tree verifier's one pass over
    every row's logits, and slower in bfloat16 (docs/tree-verification.md, "Cheaper verify
    bookkeeping")."""
    if logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"rows_argmax_cpu needs CPU logits [R, V > 0] with contiguous rows; "
                         f"got {tuple(logits.shape)} on {logits.device}")
    return load().rows_argmax_cpu(logits)


def kv_compact_cpu(kv_caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor,
                   isa: str = "vec") -> None:
    """``vllm_clover.kernels.kv_compact_ref``'s moves (src/dst [B, M] flat slots, -1 = no move; every
    source read before any destination is written) on whole CPU_ATTN caches: kv_caches are
    the layers' [num_blocks, Hkv, block_size, 2*D] tensors (contiguous, one dtype) in the
    layout of ``isa``; each move copies the token's K and V for every KV head. Every cache in
    one C++ call: the PyTorch path costs two indexing ops per K/V view, ~20x this call for the
    default model's 30 layers (docs/tree-verification.md)."""
    from vllm_clover.kernels.kv_compact import _check

    _check([], src_slots, dst_slots)
    layout = layout_id(isa)
    for c in kv_caches:
        if c.device.type != "cpu" or c.dtype != kv_caches[0].dtype or c.dim() != 4 or not c.is_contiguous():
            raise TypeError("kv_compact_cpu needs contiguous CPU caches [num_blocks, Hkv, block_size, 2*D] of one dtype")
    ok = src_slots >= 0
    src = src_slots[ok].to(torch.int64).contiguous()
    dst = dst_slots[ok].to(torch.int64).contiguous()
    load().kv_compact_cpu(list(kv_caches), src, dst, layout)
