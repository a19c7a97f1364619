"""Tree attention over a paged KV cache: PyTorch reference and Triton kernel.

Layout (vLLM's FlashAttention layout, one layer; ``kv_cache[0]`` / ``kv_cache[1]``):

    q            [B, Q, Hq, D]          query rows of each request's tree, BFS order (Q = N+1)
    key_cache    [num_blocks, block_size, Hkv, D]
    value_cache  [num_blocks, block_size, Hkv, D]
    block_table  [B, max_blocks] int32  logical block -> physical block
    seq_lens     [B] int32              prefix length before the tree (= root position)
    tree_mask    [B, Q, Q] or [Q, Q] bool   [b, i, j]: node j is an ancestor of i or i
    out          [B, Q, Hq, D]

Row i of request b attends to logical positions ``0 .. seq_lens[b]-1`` (the prefix) and
to ``seq_lens[b] + j`` for every j with ``tree_mask[b, i, j]``. The tree's own K/V must
already be in the cache at those positions (node j at ``seq_lens[b] + j``, as vLLM's
``reshape_and_cache`` writes them when slots follow the sequential positions). GQA: query
head h reads KV head ``h // (Hq // Hkv)``. Both functions honour arbitrary strides, so a
permuted view of another layout (e.g. the CPU ``[blocks, Hkv, block_size, ...]`` cache)
can be passed without a copy. Softmax runs in float32; no ALiBi, soft-cap or window.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

try:  # Triton is optional: the reference is the CPU path.
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install (ImportError, driver errors)
    triton = None
    tl = None
    HAS_TRITON = False


def _check(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
           seq_lens: Tensor, tree_mask: Tensor) -> Tensor:
    """Validate shapes and return tree_mask as [B, Q, Q] (a view when given [Q, Q])."""
    b, nq, hq, d = q.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key/value caches must both be [num_blocks, block_size, Hkv, D]")
    if key_cache.shape[-1] != d or hq % key_cache.shape[2] != 0:
        raise ValueError("head_dim mismatch, or Hq not a multiple of Hkv")
    if block_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError("block_table [B, max_blocks] and seq_lens [B] must match q's batch")
    if tree_mask.dim() == 2:
        tree_mask = tree_mask.expand(b, nq, nq)
    if tree_mask.shape != (b, nq, nq):
        raise ValueError(f"tree_mask must be [B, Q, Q] or [Q, Q], got {tuple(tree_mask.shape)}")
    block_size = key_cache.shape[1]
    need = (int(seq_lens.max()) + nq + block_size - 1) // block_size if b else 0
    if need > block_table.shape[1]:
        raise ValueError("block_table too short for seq_lens + tree rows")
    return tree_mask


def gather_paged(cache: Tensor, block_table_row: Tensor, length: int) -> Tensor:
    """Rows ``0..length-1`` of one sequence: cache [NB, BS, H, D] -> [length, H, D]."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blk = block_table_row.long()[pos // bs]
    return cache[blk, pos % bs]


def tree_attention_ref(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                       seq_lens: Tensor, tree_mask: Tensor, scale: float | None = None) -> Tensor:
    """Readable reference (a loop over requests). Shapes: module docstring."""
    tree_mask = _check(q, key_cache, value_cache, block_table, seq_lens, tree_mask)
    b, nq, hq, d = q.shape
    group = hq // key_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    for i in range(b):
        s = int(seq_lens[i])
        k = gather_paged(key_cache, block_table[i], s + nq).float().repeat_interleave(group, dim=1)
        v = gather_paged(value_cache, block_table[i], s + nq).float().repeat_interleave(group, dim=1)
        allowed = torch.cat((torch.ones(nq, s, dtype=torch.bool, device=q.device),
                             tree_mask[i].bool()), dim=1)  # [Q, s + Q]
        logits = torch.einsum("qhd,khd->hqk", q[i].float(), k) * scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        out[i] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v).to(q.dtype)
    return out


if HAS_TRITON:

    @triton.jit
    def _attend_tile(q, k, v, allow, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
        # One online-softmax step over a tile of keys: scores of q [BQ, D] against k [BN, D]
        # where ``allow`` [BQ or 1, BN] holds, running max m_i, normaliser l_i, output acc.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(allow, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attn_kernel(
        Q, K, V, O, BT, SL, M,
        sqb, sqq, sqh, sqd,
        skb, sks, skh, skd,
        svb, svs, svh, svd,
        sob, soq, soh, sod,
        sbb, sbn,
        smb, smi, smj,
        scale, num_q, head_dim, page,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # One program: request b, query head h, a block of BLOCK_Q tree rows.
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        offs_q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        q_ok = offs_q < num_q
        d_ok = offs_d < head_dim
        q = tl.load(Q + b * sqb + offs_q[:, None] * sqq + h * sqh + offs_d[None, :] * sqd,
                    mask=q_ok[:, None] & d_ok[None, :], other=0.0)
        seq_len = tl.load(SL + b)
        # Online softmax state; a finite "minus infinity" keeps fully masked tiles NaN-free.
        m_i = tl.full([BLOCK_Q], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

        # Phase 1: the paged prefix, visible to every tree row.
        for start in range(0, seq_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_ok = pos < seq_len
            blk = tl.load(BT + b * sbb + (pos // page) * sbn, mask=p_ok, other=0).to(tl.int64)
            off = pos % page
            kv_mask = p_ok[:, None] & d_ok[None, :]
            k = tl.load(K + blk[:, None] * skb + off[:, None] * sks + kvh * skh + offs_d[None, :] * skd,
                        mask=kv_mask, other=0.0)
            v = tl.load(V + blk[:, None] * svb + off[:, None] * svs + kvh * svh + offs_d[None, :] * svd,
                        mask=kv_mask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, p_ok[None, :], m_i, l_i, acc, scale, PRECISION)

        # Phase 2: the tree rows themselves, under the ancestor mask.
        for tstart in range(0, num_q, BLOCK_T):
            j = tstart + tl.arange(0, BLOCK_T)
            j_ok = j < num_q
            pos = seq_len + j
            blk = tl.load(BT + b * sbb + (pos // page) * sbn, mask=j_ok, other=0).to(tl.int64)
            off = pos % page
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(K + blk[:, None] * skb + off[:, None] * sks + kvh * skh + offs_d[None, :] * skd,
                        mask=kv_mask, other=0.0)
            v = tl.load(V + blk[:, None] * svb + off[:, None] * svs + kvh * svh + offs_d[None, :] * svd,
                        mask=kv_mask, other=0.0)
            allow = tl.load(M + b * smb + offs_q[:, None] * smi + j[None, :] * smj,
                            mask=q_ok[:, None] & j_ok[None, :], other=0) != 0
            m_i, l_i, acc = _attend_tile(q, k, v, allow, m_i, l_i, acc, scale, PRECISION)

        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(O + b * sob + offs_q[:, None] * soq + h * soh + offs_d[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def tree_attention_triton(q: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                          seq_lens: Tensor, tree_mask: Tensor, scale: float | None = None,
                          block_n: int = 32) -> Tensor:
    """Triton kernel, same contract as :func:`tree_attention_ref`.

    Grid ``(B, Hq, ceil(Q / 16))``; each program streams the prefix in tiles of ``block_n``
    positions (any tile size: every key row is looked up through the block table, so tiles
    need not align with KV blocks) and then the tree tiles under the mask. On CPU tensors
    it needs ``TRITON_INTERPRET=1`` set before ``kernels`` is imported.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use tree_attention_ref")
    tree_mask = _check(q, key_cache, value_cache, block_table, seq_lens, tree_mask)
    b, nq, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    if b == 0 or nq == 0:
        return out
    mask = tree_mask if tree_mask.dtype == torch.int8 else tree_mask.to(torch.int8)
    bt = block_table.to(torch.int32)
    sl = seq_lens.to(torch.int32)
    block_q = 16  # tl.dot needs >= 16 on every dimension
    block_t = max(16, triton.next_power_of_2(min(nq, 64)))
    block_d = max(16, triton.next_power_of_2(d))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (b, hq, triton.cdiv(nq, block_q))
    _tree_attn_kernel[grid](
        q, key_cache, value_cache, out, bt, sl, mask,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        *bt.stride(), *mask.stride(),
        scale, nq, d, key_cache.shape[1],
        GROUP=hq // key_cache.shape[2], BLOCK_Q=block_q, BLOCK_N=max(16, block_n),
        BLOCK_T=block_t, BLOCK_D=block_d, PRECISION=precision,
    )
    return out


# ============================================================================ varlen (batched)
# All tree rows of one engine step in one launch, in vLLM's token-major layout: the query
# rows of every request are consecutive rows of the step's [T, Hq, D] query, request after
# request, and each tree request is described by one row of ``meta`` and its ancestor
# bitmask:
#
#     q, out       [T, Hq, D]          the step's query / attention output (out: tree rows
#                                      overwritten in place, other rows untouched)
#     key/value    [num_blocks, block_size, Hkv, D]   (FlashAttention's layout, any strides)
#     block_table  [B, max_blocks] int32   the step's block table (row = batch row)
#     meta         [R, 4] int32        per tree request: first query row, n1 = rows (root
#                                      included), root position (prefix length), batch row
#     anc_bits     [R, NMAX, W] int32  bit j % 32 of word j // 32 of row i: node j is an
#                                      ancestor of node i or i itself (W = ceil(NMAX / 32))
#
# Row i of request r attends to the prefix ``0 .. root-1`` and to the tree rows j < n1 whose
# bit is set; node j's K/V sit at position root + j. Bits, not a dense mask: 64 nodes take
# 2 words a row, and the same buffers serve every layer of the step.
META_FIELDS = ("first_row", "n1", "root", "batch_row")


def ancestor_bits(mask: Tensor) -> Tensor:
    """Dense ancestor masks [R, N, N] bool -> bitmask [R, N, ceil(N / 32)] int32."""
    r, n, _ = mask.shape
    words = (n + 31) // 32
    padded = torch.zeros(r, n, words * 32, dtype=torch.int64, device=mask.device)
    padded[..., :n] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    bits = (padded.view(r, n, words, 32) * weights).sum(-1)  # 0 .. 2^32 - 1
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


def bits_to_mask(bits: Tensor, n: int) -> Tensor:
    """Inverse of :func:`ancestor_bits` for the first ``n`` columns: [R, N, W] -> [R, N, n] bool."""
    j = torch.arange(n, device=bits.device)
    words = bits.to(torch.int64)[..., j // 32]
    return ((words >> (j % 32)) & 1).bool()


def _check_varlen(q: Tensor, key_cache: Tensor, value_cache: Tensor, out: Tensor, block_table: Tensor,
                  meta: Tensor, anc_bits: Tensor) -> None:
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError("q and out must both be [T, Hq, D]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[-1] != q.shape[-1]:
        raise ValueError("key/value caches must both be [num_blocks, block_size, Hkv, D] with q's D")
    if q.shape[1] % key_cache.shape[2] != 0:
        raise ValueError("Hq not a multiple of Hkv")
    if meta.dim() != 2 or meta.shape[1] != len(META_FIELDS):
        raise ValueError(f"meta must be [R, 4] ({', '.join(META_FIELDS)})")
    if anc_bits.dim() != 3 or anc_bits.shape[0] != meta.shape[0] or anc_bits.shape[2] * 32 < anc_bits.shape[1]:
        raise ValueError("anc_bits must be [R, NMAX, ceil(NMAX / 32)]")


def tree_attention_varlen_ref(q: Tensor, key_cache: Tensor, value_cache: Tensor, out: Tensor,
                              block_table: Tensor, meta: Tensor, anc_bits: Tensor, scale: float) -> Tensor:
    """Readable reference of the varlen contract above (a loop over tree requests, reading
    ``meta`` on the host); writes and returns ``out``."""
    _check_varlen(q, key_cache, value_cache, out, block_table, meta, anc_bits)
    group = q.shape[1] // key_cache.shape[2]
    for r, (first, n1, root, row) in enumerate(meta.tolist()):
        k = gather_paged(key_cache, block_table[row], root + n1).float().repeat_interleave(group, dim=1)
        v = gather_paged(value_cache, block_table[row], root + n1).float().repeat_interleave(group, dim=1)
        allowed = torch.cat((torch.ones(n1, root, dtype=torch.bool, device=q.device),
                             bits_to_mask(anc_bits[r:r + 1, :n1], n1)[0]), dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[first:first + n1].float(), k) * scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        out[first:first + n1] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v).to(out.dtype)
    return out


if HAS_TRITON:

    @triton.jit
    def _tree_attn_varlen_kernel(
        Q, K, V, O, BT, META, M,
        sqt, sqh, sqd,
        skb, sks, skh, skd,
        svb, svs, svh, svd,
        sot, soh, sod,
        sbb, sbn,
        smr, smi, smw,
        scale, head_dim, page,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # One program: tree request r, query head h, a block of BLOCK_Q of its tree rows.
        r = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        first = tl.load(META + r * 4 + 0)
        n1 = tl.load(META + r * 4 + 1)
        seq_len = tl.load(META + r * 4 + 2)
        brow = tl.load(META + r * 4 + 3).to(tl.int64)
        offs_q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        q_ok = offs_q < n1
        d_ok = offs_d < head_dim
        rows = (first + offs_q).to(tl.int64)
        q = tl.load(Q + rows[:, None] * sqt + h * sqh + offs_d[None, :] * sqd,
                    mask=q_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_Q], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

        # Phase 1: the paged prefix, visible to every tree row.
        for start in range(0, seq_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_ok = pos < seq_len
            blk = tl.load(BT + brow * sbb + (pos // page) * sbn, mask=p_ok, other=0).to(tl.int64)
            off = pos % page
            kv_mask = p_ok[:, None] & d_ok[None, :]
            k = tl.load(K + blk[:, None] * skb + off[:, None] * sks + kvh * skh + offs_d[None, :] * skd,
                        mask=kv_mask, other=0.0)
            v = tl.load(V + blk[:, None] * svb + off[:, None] * svs + kvh * svh + offs_d[None, :] * svd,
                        mask=kv_mask, other=0.0)
            m_i, l_i, acc = _attend_tile(q, k, v, p_ok[None, :], m_i, l_i, acc, scale, PRECISION)

        # Phase 2: the tree rows, under the ancestor bitmask.
        for tstart in range(0, n1, BLOCK_T):
            j = tstart + tl.arange(0, BLOCK_T)
            j_ok = j < n1
            pos = seq_len + j
            blk = tl.load(BT + brow * sbb + (pos // page) * sbn, mask=j_ok, other=0).to(tl.int64)
            off = pos % page
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(K + blk[:, None] * skb + off[:, None] * sks + kvh * skh + offs_d[None, :] * skd,
                        mask=kv_mask, other=0.0)
            v = tl.load(V + blk[:, None] * svb + off[:, None] * svs + kvh * svh + offs_d[None, :] * svd,
                        mask=kv_mask, other=0.0)
            word = tl.load(M + r * smr + offs_q[:, None] * smi + (j // 32)[None, :] * smw,
                           mask=q_ok[:, None] & j_ok[None, :], other=0)
            allow = ((word >> (j % 32)[None, :]) & 1) != 0
            m_i, l_i, acc = _attend_tile(q, k, v, allow & j_ok[None, :], m_i, l_i, acc, scale, PRECISION)

        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(O + rows[:, None] * sot + h * soh + offs_d[None, :] * sod,
                 o.to(O.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def tree_attention_varlen_triton(q: Tensor, key_cache: Tensor, value_cache: Tensor, out: Tensor,
                                 block_table: Tensor, meta: Tensor, anc_bits: Tensor, scale: float,
                                 block_n: int = 32) -> Tensor:
    """Triton kernel of the varlen contract above: one launch, grid ``(R, Hq, ceil(NMAX / 16))``
    (R and NMAX from the tensors' shapes, so nothing is read back from the device); writes and
    returns ``out``. ``meta`` must be int32 and contiguous, ``anc_bits`` int32. On CPU tensors it
    needs ``TRITON_INTERPRET=1`` set before ``kernels`` is imported."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use tree_attention_varlen_ref")
    _check_varlen(q, key_cache, value_cache, out, block_table, meta, anc_bits)
    r, nmax = anc_bits.shape[0], anc_bits.shape[1]
    if r == 0 or nmax == 0:
        return out
    if meta.dtype != torch.int32 or not meta.is_contiguous():
        raise ValueError("meta must be contiguous int32")
    d = q.shape[-1]
    block_q = 16  # tl.dot needs >= 16 on every dimension
    grid = (r, q.shape[1], triton.cdiv(nmax, block_q))
    _tree_attn_varlen_kernel[grid](
        q, key_cache, value_cache, out, block_table, meta, anc_bits,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        *block_table.stride(), *anc_bits.stride(),
        scale, d, key_cache.shape[1],
        GROUP=q.shape[1] // key_cache.shape[2], BLOCK_Q=block_q, BLOCK_N=max(16, block_n),
        BLOCK_T=max(16, triton.next_power_of_2(min(nmax, 64))), BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
