"""Unit tests of tree verification inside vLLM (vllm_clover/engine/tree_verify.py) with vLLM's own
pieces but no engine: the CPU KV layouts we read (vec, and AMX's packed bfloat16 one),
tree-masked attention over them,
the CloverRejectionSampler around vLLM's RejectionSampler (greedy, sampling, mixed batches,
KV compaction), the trunk's view of a tree step, tree selection and the tree option.
End-to-end runs are in tests/test_tree_e2e.py."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_clover.kernels.tree_attention_cpu import LAYOUTS, amx_tiles_usable, rows_argmax_cpu, tree_attention_paged_cpu
from vllm_clover.kernels.tree_attention_cpu import load as load_cpu_kernel
from vllm_clover.drafting.tree import StaticTree, buffers_from_parents, get_tree, greedy_accept
from vllm_clover.engine.tree_verify import (TreeRequest, TreeStep, chain_metadata, chain_only_reason,
                                     check_cpu_kv_layout, cpu_cache_tokens, cpu_cache_views, cpu_kernel_inputs,
                                     rows_argmax, select_tree, spine, tree_attention_rows, trunk_view)

TREE = StaticTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], "t7")


# ============================================================================ KV layout
HAS_AMX = torch.cpu._is_amx_tile_supported()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="vLLM writes the amx KV layout on CPUs with AMX tiles only")


@pytest.mark.parametrize("dtype,isa,head,block", [
    (torch.float32, "vec", 64, 128), (torch.bfloat16, "vec", 64, 32), (torch.float32, "vec16", 48, 128),
    pytest.param(torch.bfloat16, "amx", 64, 128, marks=needs_amx), pytest.param(torch.bfloat16, "amx", 32, 32, marks=needs_amx)])
def test_cpu_cache_tokens_read_what_vllm_writes(dtype, isa, head, block) -> None:
    check_cpu_kv_layout(isa, dtype, head, block)


def test_unsupported_isa_is_refused_with_a_reason(monkeypatch) -> None:
    with pytest.raises(NotImplementedError, match="neon.*float32"):
        check_cpu_kv_layout("neon", torch.bfloat16, 64, 128)
    monkeypatch.setenv("VLLM_CLOVER_CPU_TREE_KERNEL", "0")  # the PyTorch path reads vec views only
    with pytest.raises(NotImplementedError, match="amx.*C\\+\\+ kernel"):
        check_cpu_kv_layout("amx", torch.bfloat16, 64, 128)


def _amx_pack(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Dense K/V [num_blocks, block_size, Hkv, D] -> a CPU cache in the amx layout (the
    inverse of cpu_cache_tokens(.., "amx"), so kernels can be tested on any CPU)."""
    nb, bs, hkv, d = key.shape
    k = key.reshape(nb, bs // 16, 16, hkv, d // 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(nb, hkv, bs * d)
    v = value.reshape(nb, bs // 2, 2, hkv, d // 16, 16).permute(0, 3, 4, 1, 5, 2).reshape(nb, hkv, bs * d)
    return torch.stack([k, v], dim=2).reshape(nb, hkv, bs, 2 * d)


def test_amx_pack_inverts_cpu_cache_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 2, 32, 3, 64, generator=g).bfloat16()
    k2, v2 = cpu_cache_tokens(_amx_pack(key, value), 64, "amx")
    assert torch.equal(k2, key) and torch.equal(v2, value)


@needs_amx
@pytest.mark.parametrize("block,prefix,n1", [(128, 0, 1), (128, 37, 14), (128, 250, 17), (32, 3, 6), (32, 61, 9)])
def test_amx_tiles_ignore_unwritten_cache_slots(block, prefix, n1) -> None:
    """With AMX tiles the kernel multiplies whole 32-position chunks of a block: slots past
    the sequence (here NaN; in vLLM whatever an earlier request left) must not reach the
    output. Equals float64 tree attention within bf16 tolerance, prefixes ending mid-chunk
    (odd and even), GQA 9/3 heads of 64."""
    assert amx_tiles_usable()
    g = torch.Generator().manual_seed(block + prefix)
    hq, hkv, d, nb = 9, 3, 64, 12
    length = prefix + n1
    key, value = torch.randn(2, nb, block, hkv, d, generator=g).bfloat16()
    table = torch.randperm(nb, generator=g)[:(length + block - 1) // block].to(torch.int32)
    pos = torch.arange(len(table) * block)
    blk, off = table.long()[pos // block], pos % block
    garbage_k, garbage_v = key.clone(), value.clone()
    garbage_k[blk[length:], off[length:]] = float("nan")
    garbage_v[blk[length:], off[length:]] = float("nan")
    parent = [-1] + [int(torch.randint(0, n, (1,), generator=g)) for n in range(1, n1)]
    anc = buffers_from_parents(torch.tensor([parent])).ancestor_mask.to(torch.uint8).contiguous()
    query = torch.randn(n1, hq, d, generator=g).bfloat16()
    out = torch.zeros_like(query)
    tree_attention_paged_cpu(query, _amx_pack(garbage_k, garbage_v), out, torch.tensor([[0, n1, prefix, 0]]),
                             table[None], anc, 1 / 8, "amx")
    mask = torch.ones(n1, length, dtype=torch.bool)
    mask[:, prefix:] = anc[0].bool()
    k, v = key[blk[:length], off[:length]].double(), value[blk[:length], off[:length]].double()
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.double().transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
        v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask, scale=1 / 8).transpose(0, 1)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def _paged_cache(k: torch.Tensor, v: torch.Tensor, block: int, blocks: list[int], nb: int = 6):
    """Write K/V [L, Hkv, D] of one sequence into a fresh CPU cache with vLLM's op."""
    from vllm import _custom_ops as ops

    hkv, d = k.shape[1:]
    kv = torch.zeros(nb, hkv, block, 2 * d, dtype=k.dtype)
    kh, vh = kv.view(nb, hkv, 2 * block, d).chunk(2, dim=2)
    pos = torch.arange(k.shape[0])
    slots = torch.tensor(blocks)[pos // block] * block + pos % block
    ops.cpu_attn_reshape_and_cache(k, v, kh, vh, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return kv, slots


@pytest.mark.parametrize("cpu_kernel", ["1", "0"], ids=["cpp", "torch"])
@pytest.mark.parametrize("prefix", [0, 5, 31])
def test_tree_attention_rows_equal_dense_masked_attention(prefix: int, cpu_kernel: str, monkeypatch) -> None:
    """Rows of a tree request read the paged prefix plus their ancestors: the result equals
    dense attention over the raw K/V with that mask (prefix 31 makes the tree straddle a
    32-slot block). Other rows of the step are left as they were. Both CPU paths: the C++
    kernel (default) and PyTorch (VLLM_CLOVER_CPU_TREE_KERNEL=0)."""
    monkeypatch.setenv("VLLM_CLOVER_CPU_TREE_KERNEL", cpu_kernel)
    torch.manual_seed(0)
    hq, hkv, d, block = 4, 2, 32, 32
    n1 = TREE.num_nodes + 1
    length = prefix + n1
    k, v = torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    kv, slots = _paged_cache(k, v, block, [3, 1, 4])
    other = 3  # rows of another request before the tree request
    query = torch.randn(other + n1, hq, d)
    output = torch.full((other + n1, hq * d), 7.0)
    bufs = TREE.buffers(1)
    step = TreeStep(num_tokens=other + n1, requests=[TreeRequest(
        index=1, start=other, root=prefix, buffers=bufs, slots=slots[prefix:])])
    meta = SimpleNamespace(block_table=torch.tensor([[0, 0, 0], [3, 1, 4]], dtype=torch.int32))
    impl = SimpleNamespace(head_size=d, num_heads=hq, scale=1 / math.sqrt(d))
    tree_attention_rows(impl, query, kv, meta, output, step)
    assert torch.equal(output[:other], torch.full((other, hq * d), 7.0))
    mask = torch.ones(n1, length, dtype=torch.bool)
    mask[:, prefix:] = bufs.ancestor_mask[0]
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query[other:].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask)
    torch.testing.assert_close(output[other:].view(n1, hq, d), ref.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,block", [(torch.float32, 16), (torch.float32, 128), (torch.bfloat16, 32),
                                         (torch.bfloat16, 128)])
def test_cpu_kernel_matches_torch_path_on_random_trees(dtype, block, monkeypatch) -> None:
    """Several tree requests with random trees and prefixes (some straddling blocks, one
    empty), GQA 9/3 heads of 64 as in the default model: the C++ kernel equals the PyTorch
    path, and both equal float64 dense attention; rows of non-tree requests stay as they were.
    In bfloat16 the kernel also reads the same K/V packed in the amx layout: through its float
    copy to the bit, and with AMX tiles (where the CPU has them) within bf16 tolerance."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 9, 3, 64
    nb = 40
    kv = torch.randn(nb, hkv, block, 2 * d, generator=g).to(dtype)
    key, value = cpu_cache_views(kv, d)
    perm = torch.randperm(nb, generator=g)
    prefixes, widths, requests, start = [0, block - 2, 3 * block + 7], [6, 9, 4], [], 2
    table = torch.zeros(4, 10, dtype=torch.int32)
    for i, (prefix, n1) in enumerate(zip(prefixes, widths)):
        row = i + 1  # batch row 0 is a non-tree request
        table[row] = perm[row * 10:(row + 1) * 10].to(torch.int32)
        parent = [-1] + [int(torch.randint(0, n, (1,), generator=g)) for n in range(1, n1)]
        bufs = buffers_from_parents(torch.tensor([parent]))
        slots = table[row].long()[torch.arange(prefix, prefix + n1) // block] * block + torch.arange(prefix, prefix + n1) % block
        requests.append(TreeRequest(index=row, start=start, root=prefix, buffers=bufs, slots=slots))
        start += n1 + 1  # a gap row between requests: must stay untouched
    query = torch.randn(start, hq, d, generator=g).to(dtype)
    meta = SimpleNamespace(block_table=table)
    impl = SimpleNamespace(head_size=d, num_heads=hq, scale=1 / math.sqrt(d))
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("VLLM_CLOVER_CPU_TREE_KERNEL", flag)
        outs[flag] = torch.full((start, hq * d), 7.0, dtype=dtype)
        tree_attention_rows(impl, query, kv, meta, outs[flag],
                            TreeStep(num_tokens=start, requests=[dataclasses.replace(r) for r in requests]))
    if dtype == torch.bfloat16:
        monkeypatch.setenv("VLLM_CLOVER_CPU_TREE_KERNEL", "1")
        packed = _amx_pack(key, value)
        step = TreeStep(num_tokens=start, requests=[dataclasses.replace(r) for r in requests])
        copied = torch.full((start, hq * d), 7.0, dtype=dtype)
        kmeta, kanc = cpu_kernel_inputs(step)
        load_cpu_kernel().tree_attention_cpu(query, packed, copied.view(start, hq, d), kmeta, table, kanc, impl.scale,
                                             LAYOUTS["amx"], False)  # the float-copy path, on any CPU
        assert torch.equal(copied, outs["1"])
        outs["amx"] = torch.full((start, hq * d), 7.0, dtype=dtype)
        tree_attention_rows(impl, query, packed, meta, outs["amx"], step, "amx")  # AMX tiles where usable
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["1"], outs["0"], **tol)
    touched = torch.zeros(start, dtype=torch.bool)
    for r in requests:
        n1 = r.buffers.width
        touched[r.start:r.start + n1] = True
        pos = torch.arange(r.root + n1)
        blk, off = table[r.index].long()[pos // block], pos % block
        k, v = key[blk, off].double(), value[blk, off].double()
        mask = torch.ones(n1, r.root + n1, dtype=torch.bool)
        mask[:, r.root:] = r.buffers.ancestor_mask[0]
        ref = torch.nn.functional.scaled_dot_product_attention(
            query[r.start:r.start + n1].double().transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
            v.repeat_interleave(3, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
        for key_ in outs.keys() - {"0"}:
            torch.testing.assert_close(outs[key_][r.start:r.start + n1].view(n1, hq, d).double(), ref, **tol)
    for out in outs.values():
        assert torch.all(out[~touched] == 7.0)


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "vec"), (torch.bfloat16, "vec"), (torch.bfloat16, "amx")])
def test_cpu_compaction_kernel_equals_the_reference(dtype, isa) -> None:
    """kv_compact_cpu over many layers' whole CPU caches moves exactly what kv_compact_ref
    moves on their (key, value) token views, chained moves included (a destination that is
    another move's source: all reads happen before the writes); vec and amx layouts."""
    from vllm_clover.kernels import kv_compact_ref
    from vllm_clover.kernels.tree_attention_cpu import kv_compact_cpu

    g = torch.Generator().manual_seed(5)
    block, d = 16, 64
    dense = [torch.randn(2, 8, block, 3, d, generator=g).to(dtype) for _ in range(5)]  # (K, V) per layer
    src = torch.tensor([[20, 33, 47, -1], [2, 70, 71, 90]])   # 33 -> 20 while 20 -> 19
    dst = torch.tensor([[19, 20, 21, -1], [1, 2, 3, 4]])
    if isa == "amx":
        raws = [_amx_pack(k, v) for k, v in dense]
    else:
        raws = [torch.zeros(8, 3, block, 2 * d, dtype=dtype) for _ in dense]
        for raw, (k, v) in zip(raws, dense):
            kv_view, vv_view = cpu_cache_views(raw, d)
            kv_view.copy_(k), vv_view.copy_(v)
    ref = [t.clone() for k, v in dense for t in (k, v)]
    kv_compact_ref(ref, src, dst)
    kv_compact_cpu(raws, src, dst, isa)
    got = [t for raw in raws for t in cpu_cache_tokens(raw, d, isa)]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not any(torch.equal(r, t) for r, t in zip(ref, (t for k, v in dense for t in (k, v))))  # every cache moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49152])
def test_rows_argmax_kernel_is_torch_max_indices(dtype, vocab) -> None:
    """The greedy verifier's argmax (C++, AVX-512 where built with it) gives torch.max's
    index: the first of tied maxima, the first NaN, -inf rows, and a strided row view."""
    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g), torch.randint(0, 3, (vocab,), generator=g).float(),
            torch.full((vocab,), -math.inf), torch.zeros(vocab)]
    if vocab > 1:
        nan = torch.randn(vocab, generator=g)
        nan[vocab // 2:] = math.nan
        inf = torch.randn(vocab, generator=g)
        inf[[vocab - 1, vocab // 3]] = math.inf
        rows += [nan, inf]
    logits = torch.stack(rows).to(dtype)
    expected = logits.max(-1).indices
    assert torch.equal(rows_argmax_cpu(logits), expected)
    assert torch.equal(rows_argmax(logits), expected)
    wide = torch.cat([logits, torch.full((len(rows), 5), 1e4, dtype=dtype)], 1)[:, :vocab]  # strided rows
    assert torch.equal(rows_argmax_cpu(wide), expected)
    with pytest.raises(ValueError, match="contiguous rows"):
        rows_argmax_cpu(torch.randn(8, 4).t())


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "vec"), pytest.param(torch.bfloat16, "amx", marks=needs_amx)])
@pytest.mark.parametrize("with_chain", [False, True], ids=["tree-rows-only", "tree-and-chain"])
def test_hook_on_vllm_cpu_attention(with_chain: bool, dtype, isa, monkeypatch) -> None:
    """vLLM's own CPU_ATTN forward under our hook (patches.runner.install_tree_attention): the
    tree request's rows equal dense ancestor-masked attention, a chain request's rows vLLM's
    causal result; vLLM's causal kernel runs only when some row is not a tree row (when
    tree rows are every row, its output would be overwritten, so it is skipped). Float32
    (vec layout) and, on CPUs with AMX, bfloat16 in vLLM's amx layout."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    from vllm_clover.patches.runner import install_tree_attention
    from vllm_clover.engine.tree_verify import TreeStepContext

    install_tree_attention()
    calls = []
    native = ops.cpu_attention_with_kv_cache
    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", lambda **kw: calls.append(1) or native(**kw))
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, block, nb = 9, 3, 64, 32, 8
    n1 = TREE.num_nodes + 1
    # (batch row, prefix, scheduled rows): a chain request of 3 rows, then the tree request.
    reqs = ([(0, 37, 3)] if with_chain else []) + [(len([0] if with_chain else []), 20, n1)]
    table = torch.randperm(nb, generator=g).to(torch.int32).view(2, 4)[: len(reqs)]
    kv = torch.zeros(nb, hkv, block, 2 * d, dtype=dtype)
    key_cache, value_cache = kv.view(nb, hkv, 2 * block, d).chunk(2, dim=2)
    qsl, seq_lens, ks, vs, tree_req = [0], [], [], [], None
    for row, prefix, rows in reqs:
        k = torch.randn(prefix + rows, hkv, d, generator=g).to(dtype)
        v = torch.randn(prefix + rows, hkv, d, generator=g).to(dtype)
        pos = torch.arange(prefix + rows)
        slots = table[row].long()[pos // block] * block + pos % block
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        ks.append(k), vs.append(v), seq_lens.append(prefix + rows), qsl.append(qsl[-1] + rows)
        if rows == n1:
            tree_req = TreeRequest(index=row, start=qsl[-2], root=prefix, buffers=TREE.buffers(1), slots=slots[prefix:])
    t = qsl[-1]
    query = torch.randn(t, hq, d, generator=g).to(dtype)
    qsl_t, seq_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(reqs), num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq_t, dtype=dtype,
        query_start_loc=qsl_t, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    meta = cpu_attn.CPUAttentionMetadata(num_actual_tokens=t, max_query_len=max(r for *_, r in reqs), query_start_loc=qsl_t,
                                max_seq_len=max(seq_lens), seq_lens=seq_t, block_table=table, slot_mapping=None,
                                scheduler_metadata=sched)
    # The impl reads only the model dtype from the current config (zentorch SDPA or not).
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=dtype)))
    impl = cpu_attn.CPUAttentionBackendImpl(hq, d, 1 / math.sqrt(d), hkv, None, None, "auto")
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, isa=isa,
                            clover_tree_context=TreeStepContext(TreeStep(num_tokens=t, requests=[tree_req])))
    output = torch.full((t, hq * d), 7.0, dtype=dtype)
    impl.forward(layer, query, None, None, kv, meta, output)
    assert len(calls) == (1 if with_chain else 0)
    for (row, prefix, rows), k, v, start in zip(reqs, ks, vs, qsl):
        mask = torch.ones(rows, prefix + rows, dtype=torch.bool).tril(prefix)
        if rows == n1:
            mask[:, prefix:] = TREE.buffers(1).ancestor_mask[0]
        ref = torch.nn.functional.scaled_dot_product_attention(
            query[start:start + rows].double().transpose(0, 1), k.double().repeat_interleave(hq // hkv, 1).transpose(0, 1),
            v.double().repeat_interleave(hq // hkv, 1).transpose(0, 1), attn_mask=mask).transpose(0, 1)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(output[start:start + rows].view(rows, hq, d).double(), ref, **tol)


# ============================================================================ sampler
@pytest.fixture(scope="module")
def vllm_sampler():
    """vLLM's RejectionSampler with the CPU kernel fallbacks a worker registers."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_clover.patches import cpu as cpu_patches
    current_platform.register_triton_kernel_overrides()
    cpu_patches.install_expand_fix()
    return RejectionSampler(Sampler())


def _sampling_metadata(temps: list[float], generators: dict | None = None, logprobs: int | None = None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    b = len(temps)
    greedy = all(t == 0 for t in temps)
    return SamplingMetadata(
        temperature=None if greedy else torch.tensor(temps, dtype=torch.float32),
        all_greedy=greedy, all_random=all(t > 0 for t in temps), top_p=None, top_k=None,
        generators=generators or {}, max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _runner_metadata(drafts: list[list[int]]):
    """SpecDecodeMetadata as vLLM's runner builds it (request i owns len(drafts[i]) + 1 rows)."""
    ids = [t for d in drafts for t in d]
    return chain_metadata([len(d) for d in drafts], ids, torch.device("cpu"))


class _Cache:
    """A one-layer CPU KV cache whose rows we can read back after compaction."""

    def __init__(self, slots: int = 64, hkv: int = 2, d: int = 32, block: int = 32):
        self.kv = torch.randn(slots // block, hkv, block, 2 * d)
        self.d = d

    def layers(self):
        return [(SimpleNamespace(head_size=self.d), self.kv, "vec")]

    def rows(self, slots: list[int]):
        k, v = cpu_cache_views(self.kv, self.d)
        flat_k = k.reshape(-1, *k.shape[2:]) if k.is_contiguous() else k.contiguous().view(-1, *k.shape[2:])
        flat_v = v.contiguous().view(-1, *v.shape[2:])
        return flat_k[slots].clone(), flat_v[slots].clone()


class _SamplerSpy(torch.nn.Module):
    """vLLM's rejection sampler, counting its calls (its ``sampler`` stays reachable)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner_sampler, self.sampler, self.calls = inner, inner.sampler, 0

    def forward(self, *args):
        self.calls += 1
        return self.inner_sampler(*args)


def _tree_step(index: int, start: int, root: int, n1: int, tree: StaticTree = TREE) -> TreeRequest:
    bufs = buffers_from_parents(tree.parent[None][:, :n1])
    return TreeRequest(index=index, start=start, root=root, buffers=bufs,
                       slots=torch.arange(root, root + n1, dtype=torch.long))


def test_greedy_tree_batch_with_a_chain_request(vllm_sampler) -> None:
    """Request 0 verifies TREE, request 1 a 2-token chain (vLLM's own rules), request 2 has
    no drafts. The tree row equals greedy_accept; the chain row equals vLLM's sampler on
    the chain alone; the accepted nodes' KV moved to the contiguous slots."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler, TreeStepContext

    torch.manual_seed(1)
    vocab = 50
    n1 = TREE.num_nodes + 1
    tree_tokens = [11, 12, 13, 21, 22, 23, 31]  # nodes 1..7
    logits = torch.randn(n1 + 3 + 1, vocab)
    # Target argmax: root -> 12 (node 2, rank 1), node 2 -> 23 (node 6), node 6 -> 40 (bonus).
    logits[0, 12] = logits[2, 23] = logits[6, 40] = 30.0
    chain_rows = slice(n1, n1 + 3)
    logits[chain_rows.start, 5] = 30.0  # chain: first draft 5 accepted, second (9) rejected
    cache = _Cache()
    step = TreeStep(num_tokens=n1 + 3 + 1, requests=[_tree_step(0, 0, 10, n1)])
    before_k, before_v = cache.rows([10 + 2, 10 + 6])
    sampler = CloverRejectionSampler(vllm_sampler, cache.layers, TreeStepContext(step))
    out = sampler(_runner_metadata([tree_tokens, [5, 9], []]), None, logits.clone(),
                  _sampling_metadata([0.0, 0.0, 0.0]))
    got = out.sampled_token_ids.tolist()
    ref = greedy_accept(torch.tensor([[0] + tree_tokens]), logits[:n1].argmax(-1)[None], TREE.buffers(1))
    assert got[0][:3] == ref.output_tokens[0].tolist()[:3] == [12, 23, 40]
    assert step.requests[0].path == [0, 2, 6]
    alone = vllm_sampler(_runner_metadata([[5, 9]]), None, logits[chain_rows].clone(), _sampling_metadata([0.0]))
    assert got[1][:2] == alone.sampled_token_ids[0].tolist()[:2] and got[1][2] == -1
    assert got[2][0] == int(logits[-1].argmax()) and got[2][1:] == [-1, -1]
    after_k, after_v = cache.rows([10 + 1, 10 + 2])
    assert torch.equal(after_k, before_k) and torch.equal(after_v, before_v)


def test_all_greedy_tree_batch_skips_the_rejection_sampler(vllm_sampler) -> None:
    """Every request a greedy tree request, no logits processing: the output is built
    directly (vLLM's rejection sampler is not called) and equals greedy_accept per request:
    accepted drafts, then the bonus, -1 padded to the longest accepted path + 1."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler, TreeStepContext

    torch.manual_seed(5)
    n1 = TREE.num_nodes + 1
    trees = [[11, 12, 13, 21, 22, 23, 31], [1, 2, 3, 4, 5, 6, 7]]
    logits = torch.randn(2 * n1, 50)
    logits[0, 12] = logits[2, 23] = logits[6, 40] = 30.0  # request 0 accepts nodes 2, 6
    logits[n1 + 0, 44] = 30.0  # request 1 accepts nothing: bonus 44
    cache = _Cache()
    step = TreeStep(num_tokens=2 * n1, requests=[_tree_step(0, 0, 10, n1), _tree_step(1, n1, 30, n1)])

    spy = _SamplerSpy(vllm_sampler)
    out = CloverRejectionSampler(spy, cache.layers, TreeStepContext(step))(
        _runner_metadata(trees), None, logits.clone(), _sampling_metadata([0.0, 0.0]))
    assert spy.calls == 0
    assert out.sampled_token_ids.dtype == torch.int32 and out.logprobs_tensors is None
    for i, tokens in enumerate(trees):
        ref = greedy_accept(torch.tensor([[0] + tokens]), logits[i * n1:(i + 1) * n1].argmax(-1)[None],
                            TREE.buffers(1))
        assert out.sampled_token_ids[i].tolist() == ref.output_tokens[0].tolist()[:3]
    assert out.sampled_token_ids.tolist() == [[12, 23, 40], [44, -1, -1]]


def test_truncated_tree_prefix(vllm_sampler) -> None:
    """The scheduler may send back only a BFS prefix of the drafts; the plan and the
    sampler then verify that prefix (still a tree, ancestor-closed)."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler, TreeStepContext

    n1 = 5  # nodes 0..4: root, three depth-1 children, (0, 0)
    logits = torch.randn(n1, 20)
    logits[0, 3] = logits[1, 7] = logits[4, 9] = 30.0
    step = TreeStep(num_tokens=n1, requests=[_tree_step(0, 0, 4, n1)])
    out = CloverRejectionSampler(vllm_sampler, _Cache().layers, TreeStepContext(step))(
        _runner_metadata([[3, 5, 6, 7]]), None, logits, _sampling_metadata([0.0]))
    assert out.sampled_token_ids[0].tolist()[:3] == [3, 7, 9]
    assert step.requests[0].path == [0, 1, 4]


def test_sampled_tree_rows_follow_the_target_distribution(vllm_sampler) -> None:
    """T = 0.7 tree requests in one batch (plus a greedy one): the first emitted token of
    each follows softmax(logits / 0.7) at the root (TV < 0.03 over 6000 requests; sampling noise
    alone gives about 0.011), although
    the drafts are the target's top-3 (drafts alone would be far off)."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler, TreeStepContext

    torch.manual_seed(2)
    vocab, b, temp = 8, 6000, 0.7
    small = StaticTree([(0,), (1,), (2,), (0, 0)], "t4")
    n1 = small.num_nodes + 1
    root_logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    rows = []
    for _ in range(b):
        block = torch.randn(n1, vocab)
        block[0] = root_logits
        rows.append(block)
    greedy_block = torch.randn(1, vocab)
    logits = torch.cat(rows + [greedy_block])
    drafts = [[0, 1, 2, 3]] * b + [[]]
    step = TreeStep(num_tokens=logits.shape[0],
                    requests=[_tree_step(i, i * n1, 100, n1, small) for i in range(b)])
    out = CloverRejectionSampler(vllm_sampler, _Cache(slots=256).layers, TreeStepContext(step))(
        _runner_metadata(drafts), None, logits, _sampling_metadata([temp] * b + [0.0]))
    first = out.sampled_token_ids[:b, 0]
    freq = torch.bincount(first, minlength=vocab).float() / b
    target = torch.softmax(root_logits / temp, -1)
    assert 0.5 * (freq - target).abs().sum() < 0.03, (freq, target)
    assert out.sampled_token_ids[b, 0] == int(greedy_block.argmax())
    # Rows are well formed: accepted path tokens then the bonus, -1 after.
    for i in range(0, b, 97):
        row = out.sampled_token_ids[i].tolist()
        path = step.requests[i].path
        assert row[: len(path) - 1] == [drafts[i][k - 1] for k in path[1:]]
        assert all(t == -1 for t in row[len(path):])


def test_logprobs_of_a_chain_request_next_to_a_tree(vllm_sampler) -> None:
    """A logprobs request (always a chain) in a tree step gets the logprobs vLLM's sampler
    computes for it alone."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler, TreeStepContext

    torch.manual_seed(3)
    n1 = TREE.num_nodes + 1
    logits = torch.randn(n1 + 3, 30)
    logits[n1, 4] = 30.0
    step = TreeStep(num_tokens=n1 + 3, requests=[_tree_step(0, 0, 0, n1)])
    out = CloverRejectionSampler(vllm_sampler, _Cache().layers, TreeStepContext(step))(
        _runner_metadata([list(range(1, n1)), [4, 5]]), None, logits.clone(),
        _sampling_metadata([0.0, 0.0], logprobs=2))
    alone = vllm_sampler(_runner_metadata([[4, 5]]), None, logits[n1:].clone(), _sampling_metadata([0.0], logprobs=2))
    got = out.logprobs_tensors
    a = alone.logprobs_tensors
    accepted_tree = len(step.requests[0].path)
    width = out.sampled_token_ids.shape[1]
    sel = slice(width, width + a.logprobs.shape[0])  # the chain request's rows
    assert torch.equal(got.logprob_token_ids[sel][:2], a.logprob_token_ids[:2])
    torch.testing.assert_close(got.logprobs[sel][:2], a.logprobs[:2])
    assert accepted_tree >= 1


def test_step_without_drafts_takes_the_plain_sampler(vllm_sampler) -> None:
    """No request drafted (drafting off at this batch size): the sampler vLLM runs without
    speculation gives the same tokens and logprobs as vLLM's rejection sampler, greedy and
    seeded-sampled rows alike, and the rejection sampler is not called."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler

    torch.manual_seed(4)
    b, vocab = 5, 40
    logits = torch.randn(b, vocab)
    temps = [0.0, 0.8, 0.0, 1.2, 0.5]

    def metadata():
        gens = {i: torch.Generator().manual_seed(10 + i) for i in (1, 3, 4)}
        return _sampling_metadata(temps, generators=gens, logprobs=3)

    ref = vllm_sampler(_runner_metadata([[]] * b), None, logits.clone(), metadata())

    spy = _SamplerSpy(vllm_sampler)
    out = CloverRejectionSampler(spy, _Cache().layers)(_runner_metadata([[]] * b), None, logits.clone(), metadata())
    assert spy.calls == 0
    assert torch.equal(out.sampled_token_ids, ref.sampled_token_ids)
    assert torch.equal(out.logprobs_tensors.logprob_token_ids, ref.logprobs_tensors.logprob_token_ids)
    torch.testing.assert_close(out.logprobs_tensors.logprobs, ref.logprobs_tensors.logprobs)
    # A step with drafts still goes to the rejection sampler.
    logits2 = torch.randn(b + 2, vocab)
    CloverRejectionSampler(spy, _Cache().layers)(_runner_metadata([[3, 4]] + [[]] * (b - 1)), None,
                                                 logits2, _sampling_metadata([0.0] * b))
    assert spy.calls == 1


# ============================================================================ trunk, trees, options
def test_trunk_view_keeps_accepted_paths_only() -> None:
    """Request 0 (a prefill chunk of 4 rows) keeps its rows; request 1 (a tree with path
    0 -> 2 -> 6) keeps rows 4, 6, 10 with the contiguous slots of positions root..root+2."""
    r = _tree_step(1, 4, 50, TREE.num_nodes + 1)
    r.path = [0, 2, 6]
    step = TreeStep(num_tokens=12, requests=[r])
    qsl = np.array([0, 4, 12])
    slots = torch.arange(100, 112)
    rows, view_qsl, view_slots = trunk_view(step, qsl, 2, slots)
    assert rows.tolist() == [0, 1, 2, 3, 4, 6, 10]
    assert view_qsl.tolist() == [0, 4, 7]
    assert view_slots.tolist() == [100, 101, 102, 103, 50, 51, 52]
    assert trunk_view(None, qsl, 2, slots) is None


def test_chain_view_metadata() -> None:
    """vLLM's CommonAttentionMetadata cut to a trunk view: request 0 keeps its 4 rows
    (sequence length 20), request 1 (scheduled 8 rows, sequence 58) keeps 3: length 53."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_clover.engine.proposer import _chain_view_metadata

    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 4, 12], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 4, 12], dtype=torch.int32),
        seq_lens=torch.tensor([20, 58], dtype=torch.int32), num_reqs=2, num_actual_tokens=12,
        max_query_len=8, max_seq_len=58, block_table_tensor=torch.zeros(2, 4, dtype=torch.int32),
        slot_mapping=torch.zeros(12, dtype=torch.long))
    # num_computed: the runner's host copy, seq_lens - scheduled rows = [16, 50].
    new = _chain_view_metadata(cm, torch.tensor([0, 4, 7], dtype=torch.int32), torch.arange(7),
                               torch.tensor([16, 50], dtype=torch.int32))
    assert new.seq_lens.tolist() == [20, 53] and new.num_actual_tokens == 7
    assert new.max_query_len == 4 and new.max_seq_len == 53
    assert new.query_start_loc.tolist() == [0, 4, 7] and new.slot_mapping.tolist() == list(range(7))


def test_select_tree_shrinks_with_the_batch() -> None:
    tree = get_tree("mc_sim_7b_63")
    assert select_tree(tree, 1, 96, 25) is tree
    assert select_tree(tree, 3, 96, 25) is tree
    assert select_tree(tree, 4, 96, 25).name == "chain5"
    assert select_tree(tree, 32, 96, 25).name == "chain2"
    assert select_tree(tree, 200, 96, 25).name == "chain1"
    assert select_tree(tree, 1, 96, 10).name == "chain5"  # the scheduler allows 10 drafts


def test_spine_is_the_top1_path() -> None:
    assert spine(TREE.parent.tolist()) == [1, 4, 7]
    tree = get_tree("mc_sim_7b_63")
    assert [tree.paths[n - 1] for n in spine(tree.parent.tolist())] == [(0,) * d for d in range(1, 6)]
    assert spine([-1, 0, 0, 2]) == [1] and spine([-1]) == []  # a dynamic tree's shape


def test_chain_only_reasons() -> None:
    from vllm import SamplingParams

    assert chain_only_reason(SamplingParams(temperature=0.0)) is None
    assert chain_only_reason(SamplingParams(temperature=0.8, top_p=0.9, seed=3)) is None
    assert chain_only_reason(SamplingParams(logprobs=2)) == "logprobs"
    assert chain_only_reason(SamplingParams(repetition_penalty=1.2)) == "penalties"
    assert chain_only_reason(SamplingParams(presence_penalty=0.5)) == "penalties"
    assert chain_only_reason(SamplingParams(min_tokens=4)) == "min_tokens"
    assert chain_only_reason(SamplingParams(allowed_token_ids=[1, 2])) == "allowed_token_ids"


def test_tree_option_translation(tmp_path) -> None:
    """``tree`` in the speculative config: K becomes the node count, the depth must fit the
    checkpoint's heads, bad values are one-line errors."""
    from vllm_clover.engine.options import CloverSpecError, tree_option

    assert tree_option(None, 5) is None and tree_option("chain", 5) is None
    assert tree_option("mc_sim_7b_63", 5).num_nodes == 25
    assert tree_option([[0], [1], [0, 0]], 2).num_nodes == 3
    with pytest.raises(CloverSpecError, match="5 deep but the checkpoint has 4 heads"):
        tree_option("mc_sim_7b_63", 4)
    with pytest.raises(CloverSpecError, match="unknown tree 'nope'"):
        tree_option("nope", 5)
    with pytest.raises(CloverSpecError, match="tree"):
        tree_option([[0, 0]], 5)  # missing prefix (0,)
    with pytest.raises(CloverSpecError, match="tree"):
        tree_option(7, 5)
    assert tree_option("dynamic", 5) == "dynamic"
