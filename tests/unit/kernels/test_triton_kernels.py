"""Tree attention and KV compaction kernels (vllm_clover/kernels/): Triton vs the PyTorch reference,
and the reference vs independent dense computations.

Without a GPU the Triton kernels run in the interpreter. TRITON_INTERPRET must be set when
Triton and the ``@triton.jit`` kernels are defined (``import kernels``) and again while they
run: tests/conftest.py imports them with it set before any test module is collected, then
restores the environment (vLLM subprocesses started by other test modules inherit it); the
``_interpret`` fixture sets it again for each test of this module. Shapes are tiny because
the interpreter runs every program in numpy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_clover import kernels
from vllm_clover.kernels import kv_compact_ref, kv_compact_triton, tree_attention_ref, tree_attention_triton
from vllm_clover.drafting.tree import accepted_kv_moves, buffers_from_parents, get_tree, positions_to_slots

INTERPRET = not torch.cuda.is_available()

try:
    import triton  # noqa: F401
    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    TRITON_ERROR = f"triton import failed: {exc!r}"
needs_triton = pytest.mark.skipif(TRITON_ERROR is not None, reason=TRITON_ERROR or "")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


pytestmark = [pytest.mark.gpu_path, pytest.mark.usefixtures("one_thread")]  # tests/conftest.py


# ============================================================================ helpers
def random_tree_mask(b: int, n1: int, g: torch.Generator) -> torch.Tensor:
    """Per-request random BFS trees of width n1, the last few columns padded at random."""
    parent = torch.full((b, n1), -1, dtype=torch.long)
    valid = torch.ones(b, n1, dtype=torch.bool)
    for i in range(b):
        real = int(torch.randint(max(1, n1 - 4), n1 + 1, (1,), generator=g))
        valid[i, real:] = False
        for n in range(1, real):
            parent[i, n] = int(torch.randint(0, n, (1,), generator=g))
    # Random parents < n need not list siblings in rank order; masks only need ancestry.
    return buffers_from_parents(parent, valid).ancestor_mask


def paged_cache(b: int, seq_lens: list[int], n1: int, block_size: int, hkv: int, d: int,
                g: torch.Generator, dtype=torch.float32):
    """Random K/V caches with shuffled physical blocks (plus spare blocks) and a block table
    covering prefix + tree for each request."""
    need = [(s + n1 + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(need) + 1
    num_blocks = b * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    return k, v, block_table


def dense_attention(q, k_rows, v_rows, allowed, scale):
    """Independent oracle: SDPA on one request. q [Q, Hq, D]; k/v rows [L, Hkv, D]; allowed [Q, L]."""
    group = q.shape[1] // k_rows.shape[1]
    k = k_rows.repeat_interleave(group, 1).transpose(0, 1).double()
    v = v_rows.repeat_interleave(group, 1).transpose(0, 1).double()
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


# ============================================================================ reference
def test_reference_matches_dense_sdpa():
    g = torch.Generator().manual_seed(0)
    t = get_tree()
    b, hq, hkv, d, bs = 2, 4, 2, 16, 16
    seq = [9, 30]
    k, v, bt = paged_cache(b, seq, 26, bs, hkv, d, g)
    q = torch.randn(b, 26, hq, d, generator=g)
    out = tree_attention_ref(q, k, v, bt, torch.tensor(seq), t.ancestor_mask)
    for i in range(b):
        pos = torch.arange(seq[i] + 26)
        blk = bt[i].long()[pos // bs]
        kr, vr = k[blk, pos % bs], v[blk, pos % bs]
        # Brute-force visibility from the paths: prefix, then j visible iff j's path is a
        # prefix of i's path.
        paths = [()] + list(t.paths)
        tree_vis = torch.tensor([[paths[a][: len(paths[j])] == paths[j] for j in range(26)] for a in range(26)])
        allowed = torch.cat((torch.ones(26, seq[i], dtype=torch.bool), tree_vis), 1)
        ref = dense_attention(q[i], kr, vr, allowed, d ** -0.5)
        torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=1e-5)


def test_reference_root_row_is_plain_decode():
    # The root row sees only the prefix and itself: ordinary decode attention.
    g = torch.Generator().manual_seed(1)
    k, v, bt = paged_cache(1, [20], 6, 16, 1, 16, g)
    q = torch.randn(1, 6, 2, 16, generator=g)
    out = tree_attention_ref(q, k, v, bt, torch.tensor([20]), get_tree("small_10").ancestor_mask[:6, :6])
    pos = torch.arange(21)
    blk = bt[0].long()[pos // 16]
    ref = dense_attention(q[0, :1], k[blk, pos % 16], v[blk, pos % 16], torch.ones(1, 21, dtype=torch.bool), 0.25)
    torch.testing.assert_close(out[0, :1].double(), ref, atol=1e-5, rtol=1e-5)


def test_input_validation():
    g = torch.Generator().manual_seed(0)
    k, v, bt = paged_cache(1, [4], 5, 16, 2, 16, g)
    q = torch.randn(1, 5, 3, 16)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple"):
        tree_attention_ref(q, k, v, bt, torch.tensor([4]), torch.eye(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="too short"):
        tree_attention_ref(torch.randn(1, 5, 2, 16), k, v, bt[:, :1], torch.tensor([30]),
                           torch.eye(5, dtype=torch.bool))


# ============================================================================ Triton attention
CASES = [
    # block_size, hq, hkv, seq_lens, tree   (trees straddle KV block boundaries)
    (16, 4, 2, [0, 7], "mc_sim_7b_63"),       # empty prefix; 7 + 26 crosses two boundaries
    (16, 2, 1, [15, 33], "small_10"),          # tree starts at the last slot of a block; MQA
    (32, 4, 4, [30, 64, 3], "random"),         # MHA, per-request padded random trees
    (32, 6, 2, [31, 45], "mc_sim_7b_63"),      # GQA group 3
]


@needs_triton
@pytest.mark.parametrize("block_size, hq, hkv, seq, tree", CASES)
def test_triton_tree_attention_matches_reference(block_size, hq, hkv, seq, tree):
    g = torch.Generator().manual_seed(block_size + hq + len(seq))
    b, d = len(seq), 16
    if tree == "random":
        mask = random_tree_mask(b, 12, g)
    else:
        mask = get_tree(tree).ancestor_mask  # shared [Q, Q]: broadcast inside
    n1 = mask.shape[-1]
    k, v, bt = paged_cache(b, seq, n1, block_size, hkv, d, g)
    q = torch.randn(b, n1, hq, d, generator=g)
    sl = torch.tensor(seq, dtype=torch.int32)
    ref = tree_attention_ref(q, k, v, bt, sl, mask)
    args = [x.to(DEV) for x in (q, k, v, bt, sl, mask)]
    out = tree_attention_triton(*args, block_n=16).cpu()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@needs_triton
def test_triton_tree_attention_fp16_and_strided_layout():
    """fp16, and a cache viewed from the CPU-style layout [blocks, Hkv, block_size, 2*D]
    (K and V halves, permuted): both functions honour the strides."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, bs, seq = 2, 4, 2, 16, 16, [5, 21]
    t = get_tree("small_10")
    raw = torch.randn(8, hkv, bs, 2 * d, generator=g).half()
    k = raw[..., :d].permute(0, 2, 1, 3)
    v = raw[..., d:].permute(0, 2, 1, 3)
    assert not k.is_contiguous()
    bt = torch.tensor([[6, 1, 3], [0, 7, 2]], dtype=torch.int32)
    q = torch.randn(b, 11, hq, d, generator=g).half()
    sl = torch.tensor(seq, dtype=torch.int32)
    ref = tree_attention_ref(q, k, v, bt, sl, t.ancestor_mask)
    dense = tree_attention_ref(q, k.contiguous(), v.contiguous(), bt, sl, t.ancestor_mask)
    assert torch.equal(ref, dense)
    if DEV == "cuda":
        k, v = raw.cuda()[..., :d].permute(0, 2, 1, 3), raw.cuda()[..., d:].permute(0, 2, 1, 3)
    out = tree_attention_triton(q.to(DEV), k, v, bt.to(DEV), sl.to(DEV), t.ancestor_mask.to(DEV)).cpu()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


# ============================================================================ compaction
def _accepted_paths(b: int, g: torch.Generator) -> torch.Tensor:
    t = get_tree()
    rows = []
    for _ in range(b):
        leaf = t.retrieve_paths[int(torch.randint(0, len(t.retrieve_paths), (1,), generator=g))]
        a = int(torch.randint(0, int((leaf >= 0).sum()), (1,), generator=g))
        rows.append(torch.cat((leaf[: a + 1], torch.full((5 - a,), -1))))
    return torch.stack(rows)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_kv_compaction_moves_the_accepted_path(block_size, backend):
    g = torch.Generator().manual_seed(block_size)
    b, hkv, d = 4, 2, 8
    seq = [0, 7, 15, 40][:b]  # trees straddle block boundaries
    acc = _accepted_paths(b, g)
    acc[0] = torch.tensor([0, 2, 8, 20, -1, -1])  # a destination that is another move's source
    k, v, bt = paged_cache(b, seq, 26, block_size, hkv, d, g)
    k0, v0 = k.clone(), v.clone()
    src, dst = accepted_kv_moves(acc, torch.tensor(seq))
    ss, ds = positions_to_slots(src, bt, block_size), positions_to_slots(dst, bt, block_size)
    caches = [k.to(DEV), v.to(DEV)]
    fn = kv_compact_ref if backend == "torch" else kv_compact_triton
    fn(caches, ss.to(DEV), ds.to(DEV))
    k1, v1 = (c.cpu() for c in caches)
    flat = lambda c: c.view(-1, hkv, d)  # noqa: E731  slot-indexed rows
    for i in range(b):
        for j in range(6):
            n = int(acc[i, j])
            if n < 0:
                break
            want = int(positions_to_slots(torch.tensor([[seq[i] + n]]), bt[i : i + 1], block_size))
            got = int(positions_to_slots(torch.tensor([[seq[i] + j]]), bt[i : i + 1], block_size))
            assert torch.equal(flat(k1)[got], flat(k0)[want]) and torch.equal(flat(v1)[got], flat(v0)[want])
    # Nothing but the destinations changed.
    changed = (flat(k1) != flat(k0)).flatten(1).any(1).nonzero().flatten()
    assert set(changed.tolist()) <= set(ds[ds >= 0].tolist())
    if backend == "triton":
        kr, vr = k0.clone(), v0.clone()
        kv_compact_ref([kr, vr], ss, ds)
        assert torch.equal(k1, kr) and torch.equal(v1, vr)


@needs_triton
def test_triton_compaction_on_strided_view():
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(6, 2, 16, 2 * 8, generator=g)  # [blocks, Hkv, block_size, 2*D]
    ref_raw = raw.clone()
    src = torch.tensor([[20, 33, -1], [2, 70, 71]])
    dst = torch.tensor([[19, 20, -1], [1, 2, 3]])
    views = lambda r: [r[..., :8].permute(0, 2, 1, 3), r[..., 8:].permute(0, 2, 1, 3)]  # noqa: E731
    kv_compact_ref(views(ref_raw), src, dst)
    dev_raw = raw.to(DEV, copy=True)
    kv_compact_triton(views(dev_raw), src.to(DEV), dst.to(DEV))
    assert torch.equal(dev_raw.cpu(), ref_raw)
    assert not torch.equal(ref_raw, raw)  # the moves did something


# ============================================================================ end to end
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_tree_attention_then_compaction_equals_chain_attention(backend, monkeypatch):
    """After compaction the accepted path is an ordinary causal continuation: each accepted
    node's tree-attention output equals causal attention of the path over the compacted
    cache. Ties tree mask, slot layout, move plan and kernels together."""
    monkeypatch.setenv(kernels.ENV_VAR, backend)
    g = torch.Generator().manual_seed(11)
    t = get_tree()
    b, hq, hkv, d, bs = 2, 4, 2, 16, 16
    seq = [13, 30]
    k, v, bt = paged_cache(b, seq, 26, bs, hkv, d, g)
    q = torch.randn(b, 26, hq, d, generator=g)
    sl = torch.tensor(seq, dtype=torch.int32)
    to = lambda *xs: [x.to(DEV) for x in xs]  # noqa: E731
    tree_out = kernels.tree_attention(*to(q, k, v, bt, sl, t.ancestor_mask)).cpu()
    acc = torch.tensor([[0, 2, 8, 20, -1, -1], [0, 1, 5, 13, 21, 24]])
    src, dst = accepted_kv_moves(acc, sl)
    caches = to(k, v)
    kernels.kv_compact(caches, *to(positions_to_slots(src, bt, bs), positions_to_slots(dst, bt, bs)))
    for i in range(b):
        path = [int(n) for n in acc[i] if n >= 0]
        a = len(path)
        qp = q[i : i + 1, path]
        chain = torch.ones(a, a, dtype=torch.bool).tril()
        out = kernels.tree_attention(*to(qp, caches[0], caches[1], bt[i : i + 1], sl[i : i + 1], chain)).cpu()
        torch.testing.assert_close(out[0], tree_out[i, path], atol=2e-5, rtol=1e-4)


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend_for(cpu) == "torch"
    if kernels.HAS_TRITON:
        assert kernels.backend_for(torch.device("cuda")) == "triton"
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.backend_for(torch.device("cuda")) == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="VLLM_CLOVER_TREE_KERNELS"):
        kernels.backend_for(cpu)


@needs_triton
def test_kernel_benchmark_runs_and_backends_agree(capsys):
    """vllm_clover/benchmarks/bench_kernels.py (run on the GPU for docs/trees-and-kernels.md) on toy
    shapes: every row is printed, the outputs agree and the compaction matches."""
    from vllm_clover.benchmarks.bench_kernels import main

    main(["--tiny"])
    lines = capsys.readouterr().out.splitlines()
    attn = [ln for ln in lines if ln.startswith("2 40 small_10")]
    comp = [ln for ln in lines if ln.startswith("2 3 2 16")]
    assert len(attn) == 1 and len(comp) == 1
    assert float(attn[0].rsplit("|", 1)[1]) < 1e-4
    assert comp[0].rstrip().endswith("True")
