"""Move the KV rows of an accepted tree path to contiguous slots: reference and Triton.

Caches are per layer ``[num_blocks, block_size, Hkv, D]`` (any strides, e.g. the K and V
halves of vLLM's ``kv_cache[0]`` / ``kv_cache[1]``, or a permuted view of another layout).
Moves are flat slots ``block * block_size + offset`` (vLLM's slot_mapping convention, see
``vllm_clover.drafting.tree.positions_to_slots``):

    src_slots, dst_slots  [B, M] long, -1 = no move

Semantics: for every cache, all source rows are read before any destination row is
written, so a destination may be another move's source (it happens: path root -> node 2 ->
node 5 moves 2 -> 1 and 5 -> 2). Distinct requests own distinct slots; within a request
destinations must be distinct. RoPE was applied at the tree positions (root + depth), which
are the final positions, so a plain copy is correct.
"""

from __future__ import annotations

from typing import Sequence

import torch

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install (ImportError, driver errors)
    triton = None
    tl = None
    HAS_TRITON = False


def _check(caches: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 2:
        raise ValueError("src_slots and dst_slots must both be [B, M]")
    if bool(((src_slots >= 0) != (dst_slots >= 0)).any()):
        raise ValueError("src_slots and dst_slots must be -1 at the same places")
    for c in caches:
        if c.dim() != 4:
            raise ValueError("each cache must be [num_blocks, block_size, Hkv, D]")


def kv_compact_ref(caches: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """In place, for each cache: ``cache[dst] = cache[src]`` (gather all, then scatter)."""
    _check(caches, src_slots, dst_slots)
    ok = src_slots >= 0
    src, dst = src_slots[ok].long(), dst_slots[ok].long()
    for c in caches:
        bs = c.shape[1]
        rows = c[src // bs, src % bs].clone()  # phase 1: read every source
        c[dst // bs, dst % bs] = rows          # phase 2: write


if HAS_TRITON:

    @triton.jit
    def _kv_compact_kernel(C, SRC, DST, s_b, s_m, sc_b, sc_s, sc_h, sc_d,
                           num_moves, head_dim, row_elems, page,
                           BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        # One program: one request, one chunk of BLOCK_E elements of the (Hkv * D) row.
        b = tl.program_id(0)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < num_moves
        src = tl.load(SRC + b * s_b + m * s_m, mask=m_ok, other=-1).to(tl.int64)
        dst = tl.load(DST + b * s_b + m * s_m, mask=m_ok, other=-1).to(tl.int64)
        e_off = (e // head_dim) * sc_h + (e % head_dim) * sc_d
        ok = (src >= 0)[:, None] & (e < row_elems)[None, :]
        src_c = tl.maximum(src, 0)
        dst_c = tl.maximum(dst, 0)
        src_off = (src_c // page) * sc_b + (src_c % page) * sc_s
        dst_off = (dst_c // page) * sc_b + (dst_c % page) * sc_s
        rows = tl.load(C + src_off[:, None] + e_off[None, :], mask=ok)
        # Another warp of this program may write a row this one still has to read.
        tl.debug_barrier()
        tl.store(C + dst_off[:, None] + e_off[None, :], rows, mask=ok)


def kv_compact_triton(caches: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """Triton kernel, same contract as :func:`kv_compact_ref`; one launch per cache.

    Grid ``(B, ceil(Hkv * D / BLOCK_E))``: programs own disjoint (request, element) ranges,
    so the read-before-write order only matters inside a program, where a barrier
    separates the loads of all moves from the stores.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kv_compact_ref")
    _check(caches, src_slots, dst_slots)
    b, m = src_slots.shape
    if b == 0 or m == 0:
        return
    src = src_slots.to(torch.int64)
    dst = dst_slots.to(torch.int64).contiguous()
    src = src.contiguous()
    block_m = max(2, triton.next_power_of_2(m))
    for c in caches:
        _, page, hkv, d = c.shape
        row = hkv * d
        block_e = min(1024, triton.next_power_of_2(row))
        grid = (b, triton.cdiv(row, block_e))
        _kv_compact_kernel[grid](c, src, dst, src.stride(0), src.stride(1), *c.stride(),
                                 m, d, row, page, BLOCK_M=block_m, BLOCK_E=block_e)


# ============================================================================ all layers, one launch
# One engine step's compaction for every layer at once: the caches (each layer's K and V
# views) share shape, strides and dtype, so one program grid walks a table of their base
# addresses. Moves are flat slots of the whole step, ``src``/``dst`` [M] long, -1 = none
# (a fixed M per step, so a device-computed accepted path needs no host read).
def cache_table(caches: Sequence[Tensor]) -> Tensor:
    """int64 [L] base addresses of ``caches`` (all the same shape, strides, dtype and device),
    for :func:`kv_compact_layers_triton`; build once, the caches do not move."""
    first = caches[0]
    for c in caches:
        if c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype or c.device != first.device:
            raise ValueError("caches of one compaction launch must share shape, strides, dtype and device")
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)


def kv_compact_layers_ref(caches: Sequence[Tensor], src: Tensor, dst: Tensor) -> None:
    """Reference of :func:`kv_compact_layers_triton`: :func:`kv_compact_ref` on one request row."""
    kv_compact_ref(caches, src.view(1, -1), dst.view(1, -1))


if HAS_TRITON:

    @triton.jit
    def _kv_compact_layers_kernel(TABLE, C0, SRC, DST, sc_b, sc_s, sc_h, sc_d,
                                  num_moves, head_dim, row_elems, page,
                                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        # One program: one cache of the table, one chunk of BLOCK_E elements of the row.
        base = tl.load(TABLE + tl.program_id(0)).to(tl.pointer_type(C0.dtype.element_ty))
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < num_moves
        src = tl.load(SRC + m, mask=m_ok, other=-1).to(tl.int64)
        dst = tl.load(DST + m, mask=m_ok, other=-1).to(tl.int64)
        e_off = (e // head_dim) * sc_h + (e % head_dim) * sc_d
        ok = (src >= 0)[:, None] & (e < row_elems)[None, :]
        src_c = tl.maximum(src, 0)
        dst_c = tl.maximum(dst, 0)
        src_off = (src_c // page) * sc_b + (src_c % page) * sc_s
        dst_off = (dst_c // page) * sc_b + (dst_c % page) * sc_s
        rows = tl.load(base + src_off[:, None] + e_off[None, :], mask=ok)
        tl.debug_barrier()  # every source row is read before any destination is written
        tl.store(base + dst_off[:, None] + e_off[None, :], rows, mask=ok)


def kv_compact_layers_triton(caches: Sequence[Tensor], table: Tensor, src: Tensor, dst: Tensor) -> None:
    """Move ``cache[dst] = cache[src]`` (all reads before writes) in every cache of ``table``
    (:func:`cache_table` of ``caches``) in one launch, grid ``(L, ceil(Hkv * D / BLOCK_E))``."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kv_compact_layers_ref")
    # Shapes only: checking the -1 places would read the moves back from the device.
    if src.shape != dst.shape or src.dim() != 1 or table.numel() != len(caches):
        raise ValueError("src and dst must both be [M], and table one address per cache")
    m = src.numel()
    if m == 0 or not len(caches):
        return
    c = caches[0]
    _, page, hkv, d = c.shape
    row = hkv * d
    block_m = max(2, triton.next_power_of_2(m))
    block_e = max(16, min(1024, triton.next_power_of_2(row), 16384 // block_m))
    grid = (table.numel(), triton.cdiv(row, block_e))
    _kv_compact_layers_kernel[grid](table, c, src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous(),
                                    *c.stride(), m, d, row, page, BLOCK_M=block_m, BLOCK_E=block_e)
