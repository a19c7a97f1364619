"""The batched (varlen) tree attention and the one-launch KV compaction of every layer
(vllm_clover/kernels/), in FlashAttention's KV layout: Triton against the PyTorch reference,
and the reference against dense masked attention. On a machine without a GPU the Triton
kernels run in the interpreter (tests/conftest.py imports them with TRITON_INTERPRET=1; the
fixture sets it again while they run); on CUDA they run compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_clover.drafting.tree import buffers_from_parents
from vllm_clover.kernels import (ancestor_bits, bits_to_mask, cache_table, kv_compact_layers_ref,
                                 kv_compact_layers_triton, tree_attention_varlen_ref,
                                 tree_attention_varlen_triton)

pytestmark = [pytest.mark.gpu_path, pytest.mark.usefixtures("one_thread")]
INTERPRET = not torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"

try:
    import triton  # noqa: F401
    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    TRITON_ERROR = f"triton import failed: {exc!r}"
needs_triton = pytest.mark.skipif(TRITON_ERROR is not None, reason=TRITON_ERROR or "")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def flash_layout_cache(num_blocks: int, block_size: int, hkv: int, d: int, g: torch.Generator, dtype=torch.float32):
    """One layer's cache as vLLM's FlashAttention allocates it, [num_blocks, Hkv, block_size,
    2 * D], and its (key, value) views [num_blocks, block_size, Hkv, D] taken as
    FlashAttentionImpl.forward takes them (``kv_cache.transpose(1, 2).split(D, -1)``)."""
    kv = torch.randn(num_blocks, hkv, block_size, 2 * d, generator=g).to(dtype)
    key, value = kv.transpose(1, 2).split(d, dim=-1)
    return kv, key, value


def random_parents(n1: int, g: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, m, (1,), generator=g)) for m in range(1, n1)]


def random_step(g: torch.Generator, hq: int, hkv: int, d: int, block_size: int, dtype=torch.float32):
    """A step of 3 requests: tree (n1=7), chain rows (plain decode, no tree), tree (n1=5), in
    token-major order, with shuffled physical blocks. Returns the inputs of the varlen kernels
    and, per tree request, (first row, n1, root, batch row, dense ancestor mask)."""
    roots, widths, is_tree = [9, 20, 3], [7, 3, 5], [True, False, True]
    max_blocks = max((r + w + block_size - 1) // block_size for r, w in zip(roots, widths)) + 1
    num_blocks = len(roots) * max_blocks + 2
    block_table = torch.randperm(num_blocks, generator=g)[: len(roots) * max_blocks].view(len(roots), max_blocks)
    kv, key, value = flash_layout_cache(num_blocks, block_size, hkv, d, g, dtype)
    q = torch.randn(sum(widths), hq, d, generator=g).to(dtype)
    trees, first = [], 0
    for row, (root, n1, tree) in enumerate(zip(roots, widths, is_tree)):
        if tree:
            parent = torch.tensor([random_parents(n1, g)])
            mask = buffers_from_parents(parent, torch.ones_like(parent, dtype=torch.bool)).ancestor_mask[0]
            trees.append((first, n1, root, row, mask))
        first += n1
    nmax = max(t[1] for t in trees)
    dense = torch.zeros(len(trees), nmax, nmax, dtype=torch.bool)
    for k, t in enumerate(trees):
        dense[k, :t[1], :t[1]] = t[4]
    meta = torch.tensor([t[:4] for t in trees], dtype=torch.int32)
    return q, kv, key, value, block_table.to(torch.int32), meta, ancestor_bits(dense), trees


def dense_tree_rows(q, key, value, block_table, first, n1, root, row, mask, scale):
    """Oracle: SDPA in float64 over the gathered prefix + tree rows with a dense bool mask."""
    bs = key.shape[1]
    pos = torch.arange(root + n1)
    blk = block_table[row].long()[pos // bs]
    k, v = key[blk, pos % bs].double(), value[blk, pos % bs].double()
    group = q.shape[1] // k.shape[1]
    allowed = torch.cat((torch.ones(n1, root, dtype=torch.bool), mask), 1)
    o = F.scaled_dot_product_attention(q[first:first + n1].double().transpose(0, 1),
                                       k.repeat_interleave(group, 1).transpose(0, 1),
                                       v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=allowed, scale=scale)
    return o.transpose(0, 1)


@pytest.mark.parametrize("n", [5, 31, 32, 33, 64, 70])
def test_ancestor_bits_round_trip(n) -> None:
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(3, n, n, generator=g) < 0.5
    bits = ancestor_bits(mask)
    assert bits.dtype == torch.int32 and bits.shape == (3, n, (n + 31) // 32)
    assert torch.equal(bits_to_mask(bits, n), mask)


def test_varlen_reference_matches_dense_masked_attention() -> None:
    g = torch.Generator().manual_seed(0)
    q, kv, key, value, bt, meta, bits, trees = random_step(g, hq=4, hkv=2, d=16, block_size=16)
    out = torch.full_like(q, 7.0)
    tree_attention_varlen_ref(q, key, value, out, bt, meta, bits, 0.25)
    tree_rows = set()
    for first, n1, root, row, mask in trees:
        ref = dense_tree_rows(q, key, value, bt, first, n1, root, row, mask, 0.25)
        torch.testing.assert_close(out[first:first + n1].double(), ref, atol=1e-5, rtol=1e-5)
        tree_rows |= set(range(first, first + n1))
    others = [t for t in range(q.shape[0]) if t not in tree_rows]
    assert others and bool((out[others] == 7.0).all()), "non-tree rows must stay untouched"


@needs_triton
@pytest.mark.parametrize("hq,hkv,block_size", [(4, 2, 16), (2, 2, 32), (4, 1, 16)])
def test_varlen_triton_matches_reference(hq, hkv, block_size) -> None:
    g = torch.Generator().manual_seed(hq * 10 + block_size)
    q, kv, key, value, bt, meta, bits, trees = random_step(g, hq=hq, hkv=hkv, d=16, block_size=block_size)
    q, kv, bt, meta, bits = (t.to(DEV) for t in (q, kv, bt, meta, bits))
    key, value = kv.transpose(1, 2).split(16, dim=-1)
    ref = tree_attention_varlen_ref(q, key, value, torch.zeros_like(q), bt, meta, bits, 0.25)
    got = tree_attention_varlen_triton(q, key, value, torch.zeros_like(q), bt, meta, bits, 0.25, block_n=16)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="half-precision Triton needs CUDA (interpreter: numpy)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_triton_half_precision_on_cuda(dtype) -> None:
    g = torch.Generator().manual_seed(3)
    q, kv, key, value, bt, meta, bits, trees = random_step(g, hq=8, hkv=2, d=64, block_size=16, dtype=dtype)
    q, kv, bt, meta, bits = (t.cuda() for t in (q, kv, bt, meta, bits))
    key, value = kv.transpose(1, 2).split(64, dim=-1)
    ref = tree_attention_varlen_ref(q, key, value, torch.zeros_like(q), bt, meta, bits, 0.125)
    got = tree_attention_varlen_triton(q, key, value, torch.zeros_like(q), bt, meta, bits, 0.125)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_triton
def test_one_launch_compacts_every_layer() -> None:
    """Two layers' K and V views of FlashAttention caches, moves of two requests with a
    destination that is another move's source (root -> 2 -> 5 moves 2 -> 1 and 5 -> 2), and
    unused (-1) entries."""
    g = torch.Generator().manual_seed(0)
    layers = [flash_layout_cache(6, 16, 2, 16, g)[0].to(DEV) for _ in range(2)]
    views = [v for kv in layers for v in kv.transpose(1, 2).split(16, dim=-1)]
    src = torch.tensor([34, 37, -1, 50, -1], device=DEV)
    dst = torch.tensor([33, 34, -1, 49, -1], device=DEV)
    original = [v.clone() for v in views]
    expected = [kv.clone() for kv in layers]
    kv_compact_layers_ref([v for kv in expected for v in kv.transpose(1, 2).split(16, dim=-1)], src, dst)
    kv_compact_layers_triton(views, cache_table(views), src, dst)
    for got, want in zip(layers, expected):
        assert torch.equal(got, want)
    for new, old in zip(views, original):  # slot = block * 16 + offset
        for s, t in ((34, 33), (37, 34), (50, 49)):
            assert torch.equal(new[t // 16, t % 16], old[s // 16, s % 16])
        assert torch.equal(new[0], old[0]) and torch.equal(new[37 // 16, 37 % 16], old[37 // 16, 37 % 16])


def test_cache_table_refuses_mixed_layouts() -> None:
    a = torch.zeros(2, 16, 2, 8)
    with pytest.raises(ValueError, match="share shape"):
        cache_table([a, torch.zeros(2, 16, 2, 4)])
