"""Tree verification in FlashAttention's KV layout (vllm_clover/engine/attention_backend.py), run on
CPU tensors: the branch is chosen by the attention impl's layout, not by the device. The step's
device metadata (persistent buffers), the tree rows of all requests against dense masked
attention (PyTorch reference and the Triton kernel in the interpreter), greedy acceptance and
the KV moves against the per-request host path, the whole CloverRejectionSampler step against
the host path, the host-side slot mapping against vLLM's own, and the CUSTOM backend class."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

# The GPU check (vllm_clover/benchmarks/gpu_check.sh) also runs on machines without vLLM: there
# only the kernel tests run.
pytest.importorskip("vllm", reason="needs vLLM (the GPU check's kernel-only machines have none)")

from vllm_clover.drafting.tree import buffers_from_parents, greedy_accept
from vllm_clover.engine.attention_backend import (FLASH_LAYOUT, TreeMetadataBuffers, compaction_moves,
                                                  device_greedy_accept, flash_cache_views, kv_layout)
from vllm_clover.engine.tree_verify import TreeRequest, TreeStep, TreeStepContext, host_slots, tree_attention_rows
from vllm_clover.kernels.tree_attention import bits_to_mask

from tests.unit.engine.test_tree_verify import _runner_metadata, _sampling_metadata, vllm_sampler  # noqa: F401

pytestmark = [pytest.mark.gpu_path, pytest.mark.usefixtures("one_thread")]
INTERPRET = not torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRET:  # tests/conftest.py imported the kernels with it set; kernels run under it
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def flash_impl(hq: int, hkv: int, d: int):
    """vLLM's own FlashAttentionImpl (its constructor runs on the CPU build; forward does not)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    return FlashAttentionImpl(num_heads=hq, head_size=d, scale=1 / math.sqrt(d), num_kv_heads=hkv,
                              alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def random_parents(n1: int, g: torch.Generator) -> tuple[int, ...]:
    return tuple([-1] + [int(torch.randint(0, m, (1,), generator=g)) for m in range(1, n1)])


def tree_request(index: int, start: int, root: int, parent: tuple[int, ...], block_row: torch.Tensor,
                 block_size: int) -> TreeRequest:
    p = torch.tensor([parent])
    buffers = buffers_from_parents(p, torch.ones_like(p, dtype=torch.bool))
    slots = host_slots(block_row.numpy(), block_size, root, len(parent))
    return TreeRequest(index=index, start=start, root=root, buffers=buffers, slots=slots)


def mixed_step(g: torch.Generator, block_size: int = 16):
    """Batch rows: 0 = tree (7 rows, root 9), 1 = a chain of 3 rows, 2 = tree (5 rows, root 30)."""
    roots, widths = [9, 20, 30], [7, 3, 5]
    max_blocks = 4
    bt = torch.randperm(3 * max_blocks + 2, generator=g)[:3 * max_blocks].view(3, max_blocks).to(torch.int32)
    starts = [0, 7, 10]
    reqs = [tree_request(i, starts[i], roots[i], random_parents(widths[i], g), bt[i], block_size) for i in (0, 2)]
    return TreeStep(num_tokens=sum(widths), requests=reqs), bt


def test_kv_layout_follows_the_impl_class() -> None:
    from vllm_clover.engine.attention_backend import CPU_LAYOUT

    assert kv_layout(flash_impl(4, 2, 16)) == FLASH_LAYOUT
    assert kv_layout(SimpleNamespace(head_size=16)) == CPU_LAYOUT


def test_metadata_buffers_are_persistent_and_exact() -> None:
    g = torch.Generator().manual_seed(0)
    step, _ = mixed_step(g)
    buffers = TreeMetadataBuffers(max_requests=4, max_nodes=8, device="cpu")
    md = buffers.build(step, logits_start=[0, 10], draft_start=[0, 8])
    assert md.num_requests == 2 and md.max_nodes == 7
    assert md.meta.tolist() == [[0, 7, 9, 0], [10, 5, 30, 2]]
    for k, r in enumerate(step.requests):
        n1 = r.buffers.width
        assert torch.equal(bits_to_mask(md.anc_bits[k:k + 1, :n1], n1)[0], r.buffers.ancestor_mask[0])
        assert torch.equal(md.slots[k, :n1], r.slots) and bool((md.slots[k, n1:] == -1).all())
        assert md.parent[k, :n1].tolist() == r.buffers.parent[0].tolist() and not md.valid[k, n1:].any()
    assert md.logits_rows[1, :5].tolist() == [10, 11, 12, 13, 14] and md.draft_index[1, :5].tolist() == [0, 8, 9, 10, 11]
    assert md.max_depth == max(int(r.buffers.depth.max()) for r in step.requests)
    # A narrower step reuses the same storage and leaves no stale rows in its views.
    ptrs = {name: t.data_ptr() for name, t in buffers.dev.items()}
    small = TreeStep(num_tokens=3, requests=[tree_request(0, 0, 4, (-1, 0, 0), torch.arange(4, dtype=torch.int32), 16)])
    md2 = buffers.build(small)
    assert {name: t.data_ptr() for name, t in buffers.dev.items()} == ptrs
    assert md2.meta.data_ptr() == ptrs["meta"] and md2.meta.tolist() == [[0, 3, 4, 0]]
    assert md2.slots.tolist() == [[4, 5, 6]] and md2.logits_rows.tolist() == [[0, 1, 2]]
    with pytest.raises(RuntimeError, match="exceeds the buffers"):
        TreeMetadataBuffers(max_requests=1, max_nodes=8, device="cpu").build(step)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_flash_layout_tree_rows_equal_dense_masked_attention(kernels, monkeypatch) -> None:
    """tree_attention_rows on a real FlashAttentionImpl and a cache laid out as FlashAttention
    allocates it: every tree row equals dense attention over prefix + ancestors; the chain's
    rows keep what the causal kernel wrote. ``triton``: the kernel a GPU runs, interpreted."""
    monkeypatch.setenv("VLLM_CLOVER_TREE_KERNELS", kernels)
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, bs = 4, 2, 16, 16
    step, bt = mixed_step(g, bs)
    step.device = TreeMetadataBuffers(4, 8, "cpu").build(step)
    kv_cache = torch.randn(bt.numel() + 2, hkv, bs, 2 * d, generator=g)
    query = torch.randn(step.num_tokens, hq, d, generator=g)
    output = torch.full((step.num_tokens, hq * d), 7.0)
    impl = flash_impl(hq, hkv, d)
    tree_attention_rows(impl, query, kv_cache, SimpleNamespace(block_table=bt), output, step)
    key, value = flash_cache_views(kv_cache, d)
    out = output.view(-1, hq, d)
    for r in step.requests:
        n1 = r.buffers.width
        pos = torch.arange(r.root + n1)
        blk = bt[r.index].long()[pos // bs]
        k = key[blk, pos % bs].repeat_interleave(hq // hkv, 1).transpose(0, 1).double()
        v = value[blk, pos % bs].repeat_interleave(hq // hkv, 1).transpose(0, 1).double()
        allowed = torch.cat((torch.ones(n1, r.root, dtype=torch.bool), r.buffers.ancestor_mask[0]), 1)
        ref = F.scaled_dot_product_attention(query[r.start:r.start + n1].transpose(0, 1).double(), k, v,
                                             attn_mask=allowed, scale=impl.scale).transpose(0, 1)
        torch.testing.assert_close(out[r.start:r.start + n1].double(), ref, atol=1e-4, rtol=1e-4)
    assert bool((out[7:10] == 7.0).all())


@pytest.mark.parametrize("seed", range(10))
def test_device_greedy_accept_equals_the_per_request_rule(seed) -> None:
    """Random trees, drafts partly equal to the target's argmax at their parent (duplicate
    sibling tokens included): the batched device acceptance takes greedy_accept's path per
    request, and the KV moves are the host path's (CloverRejectionSampler.compact)."""
    g = torch.Generator().manual_seed(seed)
    vocab = 6  # small: many matches and ties between equally deep paths
    step, _ = mixed_step(g)
    num_draft = [6, 2, 4]
    logits0 = [0, 7, 10]
    draft0 = [0, 6, 8]
    md = TreeMetadataBuffers(4, 8, "cpu").build(step, [logits0[r.index] for r in step.requests],
                                                [draft0[r.index] for r in step.requests])
    drafts = torch.randint(0, vocab, (sum(num_draft),), generator=g)
    target = torch.randint(0, vocab, (15,), generator=g)
    accepted, bonus = device_greedy_accept(md, drafts, target)
    src, dst = compaction_moves(md, accepted)
    moves = []
    for k, r in enumerate(step.requests):
        n1, i = r.buffers.width, r.index
        tokens = torch.cat([torch.zeros(1, dtype=torch.long), drafts[draft0[i]:draft0[i] + n1 - 1]])[None]
        ref = greedy_accept(tokens, target[logits0[i]:logits0[i] + n1][None], r.buffers)
        a = int(ref.num_accepted[0])
        path = ref.accepted_nodes[0, :a + 1].tolist()
        assert accepted[k][accepted[k] >= 0].tolist() == path
        assert int(bonus[k]) == int(ref.bonus[0])
        moves += [(int(r.slots[path[j]]), int(r.slots[j])) for j in range(1, len(path)) if path[j] != j]
    got = [(int(s), int(t)) for s, t in zip(src, dst) if s >= 0]
    assert got == moves and bool(((src >= 0) == (dst >= 0)).all())


def test_sampler_step_on_the_device_equals_the_host_path(vllm_sampler) -> None:  # noqa: F811
    """A greedy batch of two trees and a chain through CloverRejectionSampler: with the step's
    device metadata (acceptance and compaction on the device, FlashAttention caches of two
    layers) the sampled tokens, accepted paths and compacted caches equal the host path's."""
    from vllm_clover.engine.tree_verify import CloverRejectionSampler

    g = torch.Generator().manual_seed(2)
    hq, hkv, d, bs, vocab = 4, 2, 16, 16, 40
    step, bt = mixed_step(g, bs)
    parents = [(-1, 0, 0, 1, 2, 2, 4), (-1, 0, 0, 2, 1)]
    caches = [torch.randn(bt.numel() + 2, hkv, bs, 2 * d, generator=g) for _ in range(2)]
    impl = flash_impl(hq, hkv, d)
    drafts = [[11, 12, 13, 14, 15, 16], [5, 9], [21, 22, 23, 24]]  # tree nodes 1.., then the chain
    logits = torch.randn(15, vocab, generator=g)
    # Target choices (row = node): tree 0 takes root -> node 2 -> node 5, tree 1 root -> node 2
    # -> node 3, so both paths move KV (2 -> 1, 5 -> 2; 2 -> 1, 3 -> 2); the chain takes 5.
    logits[0, 12] = logits[2, 15] = logits[10, 22] = logits[12, 23] = logits[7, 5] = 30.0
    results = {}
    for mode in ("host", "device"):
        run_step = TreeStep(num_tokens=step.num_tokens, requests=[
            tree_request(r.index, r.start, r.root, p, bt[r.index], bs) for r, p in zip(step.requests, parents)])
        if mode == "device":
            run_step.device = TreeMetadataBuffers(4, 8, "cpu").build(run_step, [0, 10], [0, 8])
        layer_caches = [c.clone() for c in caches]
        sampler = CloverRejectionSampler(vllm_sampler, lambda: [(impl, c, None) for c in layer_caches],
                                         TreeStepContext(run_step))
        out = sampler(_runner_metadata(drafts), None, logits.clone(), _sampling_metadata([0.0, 0.0, 0.0]))
        results[mode] = (out.sampled_token_ids.tolist(), [r.path for r in run_step.requests], layer_caches)
    assert results["device"][0] == results["host"][0]
    assert results["device"][1] == results["host"][1] == [[0, 2, 5], [0, 2, 3]]
    for a, b, before in zip(results["device"][2], results["host"][2], caches):
        assert torch.equal(a, b) and not torch.equal(a, before)
        key, old = flash_cache_views(a, d)[0], flash_cache_views(before, d)[0]
        r = step.requests[0]  # node 5's key now sits at position root + 2
        s5, s2 = int(r.slots[5]), int(r.slots[2])
        assert torch.equal(key[s2 // bs, s2 % bs], old[s5 // bs, s5 % bs])


def test_host_slots_equal_vllms_slot_mapping() -> None:
    """The slots plan_tree_step computes on the host are those vLLM's slot-mapping kernel
    writes (BlockTable.compute_slot_mapping, the CPU build's implementation)."""
    from vllm.v1.worker.block_table import BlockTable

    g = torch.Generator().manual_seed(3)
    bs = 16
    table = BlockTable(block_size=bs, max_num_reqs=2, max_num_blocks_per_req=6, max_num_batched_tokens=64,
                       pin_memory=False, device=torch.device("cpu"), cp_kv_cache_interleave_size=1)
    table.block_table.np[:2] = torch.randperm(20, generator=g)[:12].view(2, 6).numpy()
    table.block_table.copy_to_gpu(2)
    roots, widths = [13, 40], [9, 5]
    positions = torch.cat([torch.arange(r, r + w) for r, w in zip(roots, widths)])
    qsl = torch.tensor([0, 9, 14], dtype=torch.int32)
    table.compute_slot_mapping(2, qsl, positions)
    vllm_slots = table.slot_mapping.gpu[:14].long()
    ours = torch.cat([host_slots(table.block_table.np[i], bs, roots[i], widths[i]) for i in range(2)])
    assert torch.equal(ours, vllm_slots)


def test_custom_backend_is_flash_attention_with_tree_metadata() -> None:
    """The CUSTOM backend vLLM resolves is FlashAttention's backend (same impl, KV shape and
    supported dtypes) with the plugin's metadata builder."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_clover.engine.attention_backend import register_custom_backend

    register_custom_backend()
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert issubclass(backend, FlashAttentionBackend) and backend.get_name() == "CUSTOM"
    assert backend.get_impl_cls() is FlashAttentionBackend.get_impl_cls()
    assert issubclass(backend.get_builder_cls(), FlashAttentionMetadataBuilder)
    assert backend.supported_dtypes == FlashAttentionBackend.supported_dtypes


def test_builder_reads_the_step_in_flight() -> None:
    """What the CUSTOM builder attaches (``clover_tree``): the device metadata of the step the
    engine's context holds, None between tree steps. (The builder's FlashAttention half needs
    CUDA: FlashAttentionMetadataBuilder reads the flash-attn version and device properties.)"""
    from vllm_clover.engine.attention_backend import bind_tree_context, current_tree_metadata

    g = torch.Generator().manual_seed(4)
    step, _ = mixed_step(g)
    step.device = TreeMetadataBuffers(4, 8, "cpu").build(step)
    context = TreeStepContext()
    bind_tree_context(context)
    assert current_tree_metadata() is None
    context.publish(step)
    assert current_tree_metadata() is step.device
    context.take()
    assert current_tree_metadata() is None
