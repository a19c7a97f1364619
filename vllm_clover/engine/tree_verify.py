"""Batched tree verification inside vLLM's V1 runner (one target pass per step).

The proposer drafts a token tree per request (``tree.expand_static_tree``) and hands vLLM
its nodes in BFS order as ordinary drafts; vLLM's scheduler, KV allocation and continuous
batching stay untouched (``num_speculative_tokens`` = node count, any BFS prefix is
ancestor-closed, so the scheduler may truncate). This module turns such a step into tree
verification, in five places (hooks in ``runner_hooks``, catalogue in ``patches``):

1. ``plan_tree_step`` (after ``GPUModelRunner._prepare_inputs``): for every request whose
   scheduled drafts are a tree the proposer made, overwrite the RoPE positions of its rows
   with ``root + depth``. The KV slots were already computed from sequential positions, so
   node n keeps its own slot ``root + n``.
2. ``tree_attention_rows`` (after the attention kernel of each target layer): recompute
   the rows of tree requests with the ancestor mask (prefix + ancestors + self), on CPU
   straight from vLLM's cache layout (C++ kernel ``vllm_clover.kernels.tree_attention_cpu``; PyTorch
   with ``VLLM_CLOVER_CPU_TREE_KERNEL=0``), in FlashAttention's layout with one varlen launch for
   all tree rows of the step (``vllm_clover.engine.attention_backend``, chosen by the impl's KV
   layout, not the device); the native kernels know only causal masks.
3. ``CloverRejectionSampler`` (replaces ``runner.rejection_sampler``): greedy rows take the
   longest path matching the target's argmax; sampled rows use lossless multi-candidate
   rejection sampling (``tree.sample_accept``). The accepted path is then handed to vLLM's
   own rejection sampler as a *chain* (logits rows reordered), so its output layout,
   logprobs, roll-back and metrics stay vLLM's.
4. ``CloverRejectionSampler.compact``: the target KV of the accepted nodes moves to
   slots ``root + 1 .. root + a`` (``vllm_clover.kernels.kv_compact``), so the cache is contiguous again
   before the scheduler's next step.
5. ``trunk_view`` (in the proposer): Clover's trunk runs over the accepted rows only, as a
   chain at positions ``root .. root + a`` and the contiguous slots, so its Augmenting-Block
   KV never needs compaction.

Requests that need what this path cannot give (logprobs, penalties, bad words, allowed
tokens, min_tokens, structured output) draft the tree's top-1 spine as a chain
(:func:`chain_only_reason`); a step without tree requests is plain vLLM. Docs:
docs/tree-verification.md.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_clover.kernels.tree_attention_cpu import enabled as cpu_kernel_enabled
from vllm_clover.kernels.tree_attention_cpu import LAYOUTS as CPU_KERNEL_LAYOUTS
from vllm_clover.kernels.tree_attention_cpu import kv_compact_cpu, rows_argmax_cpu, tree_attention_paged_cpu
from vllm_clover.drafting.tree import (StaticTree, TreeBuffers, get_tree, greedy_accept,
                              sample_accept, single_tree_buffers)

Tensor = torch.Tensor
# vLLM's SamplingMetadata.temperature value for greedy requests (gpu_input_batch.py).
GREEDY_TEMPERATURE = 0.0
# vLLM's padding in sampler outputs (rejection_sampler.PLACEHOLDER_TOKEN_ID).
PLACEHOLDER_TOKEN_ID = -1
# CPU attention ISAs whose KV layout tree verification reads (checked by check_cpu_kv_layout):
# the PyTorch path through cpu_cache_views (vec, vec16), the C++ kernel those of its LAYOUTS.
CPU_TREE_ISAS = tuple(CPU_KERNEL_LAYOUTS)
CPU_VIEW_ISAS = ("vec", "vec16")


# ============================================================================ step plan
@dataclass
class TreeRequest:
    """One request verified as a tree in this step (n scheduled drafts = nodes 1..n)."""

    index: int          # row in the persistent batch
    start: int          # its first scheduled row (the root token)
    root: int           # root position = num_computed_tokens
    buffers: TreeBuffers  # batch of one, truncated to the n+1 scheduled nodes
    slots: Tensor       # [n+1] long: KV slots of rows start..start+n (positions root..root+n)
    # Set by the sampler: accepted node indices, root (0) first.
    path: list[int] | None = None
    # Built at the first target layer, reused by the others (same block table, CPU path):
    # (block, offset) of positions 0..root+n, and the additive attention mask
    # [(n+1) * heads-per-KV-head, root+n+1] (0 / -inf).
    kv_index: tuple[Tensor, Tensor] | None = None
    attn_mask: Tensor | None = None


@dataclass
class TreeStep:
    """The tree requests of one engine step (held by a :class:`TreeStepContext`)."""

    num_tokens: int
    requests: list[TreeRequest]
    by_index: dict[int, TreeRequest] = field(default_factory=dict)
    # Inputs of the C++ CPU kernel (kernels.tree_attention_cpu), built at the first layer:
    # meta [R, 4] int64 (first row, n1, root, batch row), anc [R, NMAX, NMAX] uint8.
    cpu_kernel_inputs: tuple[Tensor, Tensor] | None = None
    # FlashAttention layout: the step's metadata in the engine's persistent device buffers
    # (attention_backend.TreeMetadataBuffers), built by plan_tree_step.
    device: Any = None

    def __post_init__(self) -> None:
        self.by_index = {r.index: r for r in self.requests}

    @property
    def covers_all_rows(self) -> bool:
        """True when every scheduled row of the step is a tree request's row."""
        return sum(r.buffers.width for r in self.requests) == self.num_tokens


class TreeStepContext:
    """The tree plan of the engine step in flight (None: no tree request in it), one per
    Clover engine, owned by its ``CloverProposer`` (``tree_context``).

    Published after ``_prepare_inputs`` (:func:`plan_tree_step`), read during the target
    pass by the attention hook and by :class:`CloverRejectionSampler`, and taken (cleared)
    when drafting starts, so the trunk's attention never sees it. vLLM calls an attention
    impl with its layer and the tensors only (its ``ForwardContext`` has no slot for plugin
    data), so the proposer binds the context to every target attention layer
    (``layer.clover_tree_context``) at load time."""

    def __init__(self, step: TreeStep | None = None) -> None:
        self.step = step

    def publish(self, step: TreeStep | None) -> None:
        self.step = step

    def take(self) -> TreeStep | None:
        """This step's plan, cleared from the context."""
        step, self.step = self.step, None
        return step


def plan_tree_step(runner: Any, scheduler_output: Any) -> TreeStep | None:
    """Find this step's tree requests and give their rows RoPE positions ``root + depth``.

    A request counts as a tree when the drafts the scheduler sent back are a prefix of the
    tokens the proposer drafted as a tree (``drafter.tree_drafts[req_id]``) and that prefix
    is not a plain chain; anything else (truncated by grammar, stale, chain) is verified by
    vLLM as a chain, which is exact for any draft sequence. Call after ``_prepare_inputs``.
    """
    table = getattr(getattr(runner, "drafter", None), "tree_drafts", None)
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not table or not spec:
        return None
    batch = runner.input_batch
    qsl = runner.query_start_loc.np
    block_table = batch.block_table[0]
    requests = []
    for req_id, drafts in spec.items():
        entry = table.get(req_id)
        n = len(drafts)
        if entry is None or n == 0 or list(drafts) != entry[0][:n]:
            continue
        parent = entry[1][: n + 1]
        if all(p == m for m, p in enumerate(parent[1:])):
            continue  # the scheduled prefix is a chain: vLLM verifies it as is
        i = batch.req_id_to_index[req_id]
        start = int(qsl[i])
        root = int(batch.num_computed_tokens_cpu[i])
        buffers = tree_buffers(parent)
        slots = host_slots(block_table.block_table.np[i], block_table.block_size, root, n + 1)
        requests.append(TreeRequest(index=i, start=start, root=root, buffers=buffers, slots=slots))
    if not requests:
        return None
    # The tree rows' RoPE positions, root + depth, in one write (one host-to-device copy).
    rows = torch.cat([torch.arange(r.start, r.start + r.buffers.width) for r in requests])
    values = torch.cat([r.root + r.buffers.depth[0] for r in requests])
    device = runner.positions.device
    runner.positions[rows.to(device, non_blocking=True)] = values.to(device, non_blocking=True)
    step = TreeStep(num_tokens=scheduler_output.total_num_scheduled_tokens, requests=requests)
    metadata_buffers = getattr(runner.drafter, "tree_metadata_buffers", None)
    if metadata_buffers is not None:
        num_draft = [len(spec.get(req_id, ())) for req_id in batch.req_ids]
        logits0 = np.concatenate([[0], np.cumsum(np.asarray(num_draft) + 1)])
        draft0 = np.concatenate([[0], np.cumsum(num_draft)])
        step.device = metadata_buffers.build(step, [int(logits0[r.index]) for r in requests],
                                             [int(draft0[r.index]) for r in requests])
    return step


def host_slots(block_row: np.ndarray, block_size: int, root: int, n1: int) -> Tensor:
    """KV slots [n1] long of positions ``root .. root + n1 - 1`` of one request, from the host
    copy of its block-table row: ``block * block_size + offset``, what vLLM's slot-mapping
    kernel computes on the device without context parallelism (refused by the front end)."""
    pos = np.arange(root, root + n1)
    return torch.from_numpy(block_row[pos // block_size].astype(np.int64) * block_size + pos % block_size)


@functools.lru_cache(maxsize=256)
def tree_buffers(parent: tuple[int, ...]) -> TreeBuffers:
    """:func:`tree.single_tree_buffers` (a batch of one), cached: a static tree and its
    scheduler-truncated prefixes repeat every step. Treat as read-only."""
    return single_tree_buffers(parent)


# ============================================================================ attention
def cache_views(impl: Any, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(key, value) views [num_blocks, block_size, Hkv, D] of one layer's cache, by the KV
    layout of the attention impl (``attention_backend.kv_layout``): CPU_ATTN
    (:func:`cpu_cache_views`) or FlashAttention (``attention_backend.flash_cache_views``)."""
    from vllm_clover.engine.attention_backend import FLASH_LAYOUT, flash_cache_views, kv_layout

    if kv_layout(impl) == FLASH_LAYOUT:
        return flash_cache_views(kv_cache, impl.head_size)
    return cpu_cache_views(kv_cache, impl.head_size)


def cpu_cache_views(kv_cache: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
    """vLLM's CPU KV cache of one layer -> (key, value) views [num_blocks, block_size, Hkv, D].

    ``kv_cache`` is [num_blocks, Hkv, block_size, 2*D]; CPU_ATTN splits each (block, head)
    into a key half and a value half (``cpu_attn.py``: view [.., 2*block_size, D], chunk).
    With the ``vec``/``vec16`` ISAs the key half is stored transposed, [D, block_size], and
    the value half as [block_size, D] (verified against ``cpu_attn_reshape_and_cache``,
    :func:`check_cpu_kv_layout`). The ``amx`` ISA packs both halves for AMX tile loads,
    which no strided view expresses: :func:`cpu_cache_tokens` copies them out.
    """
    nb, hkv, bs, _ = kv_cache.shape
    halves = kv_cache.view(nb, hkv, 2, bs * head_size)
    key = halves[:, :, 0].view(nb, hkv, head_size, bs).permute(0, 3, 1, 2)
    value = halves[:, :, 1].view(nb, hkv, bs, head_size).permute(0, 2, 1, 3)
    return key, value


def cpu_cache_tokens(kv_cache: Tensor, head_size: int, isa: str) -> tuple[Tensor, Tensor]:
    """(key, value) [num_blocks, block_size, Hkv, D] of one layer's CPU cache in the layout of
    ``isa``: :func:`cpu_cache_views` for vec/vec16; for amx, copies (read-only use: tests and
    the start-up layout check). AMX order per (block, head), as the C++ kernel reads it:
    key (t, e) at (t//16)*16*D + (e//2)*32 + (t%16)*2 + e%2, value (t, e) at
    (e//16)*16*block_size + (t//2)*32 + (e%16)*2 + t%2 (vLLM's ``cpu_attn_amx.hpp``)."""
    if isa != "amx":
        return cpu_cache_views(kv_cache, head_size)
    nb, hkv, bs, _ = kv_cache.shape
    d = head_size
    halves = kv_cache.view(nb, hkv, 2, bs * d)
    key = halves[:, :, 0].reshape(nb, hkv, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5)
    value = halves[:, :, 1].reshape(nb, hkv, d // 16, bs // 2, 16, 2).permute(0, 3, 5, 1, 2, 4)
    return key.reshape(nb, bs, hkv, d), value.reshape(nb, bs, hkv, d)


def check_cpu_kv_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Write known K/V with vLLM's own ``cpu_attn_reshape_and_cache`` and read them back
    through :func:`cpu_cache_tokens`; raise NotImplementedError naming the ISA on mismatch,
    or for amx without the C++ kernel (the PyTorch path reads strided views only)."""
    from vllm import _custom_ops as ops

    why = (f"tree verification on CPU reads the KV cache directly and supports the "
           f"{CPU_TREE_ISAS} attention kernels; this engine uses {isa!r} ({dtype}, head size "
           f"{head_size}). Use dtype float32, or chain drafting (leave out the tree option)")
    if isa not in CPU_TREE_ISAS:
        raise NotImplementedError(why)
    if isa not in CPU_VIEW_ISAS and not cpu_kernel_enabled():
        raise NotImplementedError(
            f"tree verification reads the {isa!r} KV layout ({dtype}) with the C++ kernel only, and "
            f"VLLM_CLOVER_CPU_TREE_KERNEL=0 turns it off; unset it, use dtype float32, or chain drafting")
    gen = torch.Generator().manual_seed(0)
    kv = torch.zeros(2, 2, block_size, 2 * head_size, dtype=dtype)
    key_half, value_half = kv.view(2, 2, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.tensor([0, 1, block_size + 3, 2 * block_size - 1])
    k = torch.randn(len(slots), 2, head_size, generator=gen).to(dtype)
    v = torch.randn(len(slots), 2, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, key_half, value_half, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    kc, vc = cpu_cache_tokens(kv, head_size, isa)
    blk, off = slots // block_size, slots % block_size
    if not (torch.equal(kc[blk, off], k) and torch.equal(vc[blk, off], v)):
        raise NotImplementedError(why + " (KV layout check failed)")


def tree_attention_rows(impl: Any, query: Tensor, kv_cache: Tensor, attn_metadata: Any,
                        output: Tensor, step: TreeStep, isa: str = "vec") -> None:
    """Overwrite the attention output of every tree request's rows with tree-masked
    attention: row i sees the paged prefix ``0 .. root-1`` and the tree rows of its
    ancestors and itself (their K/V were just written at slots ``root + n``).

    query [T, Hq, D]; output [T, Hq*D] or [T, Hq, D] (written in place); ``isa``: the CPU
    attention ISA of the layer (``layer.isa``), which fixes the CPU cache layout.
    """
    from vllm_clover.engine.attention_backend import FLASH_LAYOUT, flash_tree_rows, kv_layout

    if kv_layout(impl) == FLASH_LAYOUT:
        # FlashAttention's layout (GPU, or CPU tensors in the tests): every tree row of the
        # step in one varlen launch, from the step's device metadata (the CUSTOM backend's
        # metadata carries the same object).
        tree = getattr(attn_metadata, "clover_tree", None) or step.device
        if tree is None:
            raise RuntimeError("vllm-clover: a tree step in FlashAttention's layout has no device metadata")
        flash_tree_rows(query, kv_cache, attn_metadata.block_table, output, tree, impl.num_heads,
                        impl.head_size, impl.scale)
        return
    d = impl.head_size
    out = output.view(output.shape[0], impl.num_heads, d)
    if query.device.type == "cpu" and cpu_kernel_enabled():
        # One C++ call for all tree rows, reading the paged cache in place (no gather).
        if step.cpu_kernel_inputs is None:
            step.cpu_kernel_inputs = cpu_kernel_inputs(step)
        meta, anc = step.cpu_kernel_inputs
        tree_attention_paged_cpu(query.view(query.shape[0], impl.num_heads, d), kv_cache, out, meta,
                                 attn_metadata.block_table, anc, impl.scale, isa)
        return
    if query.device.type == "cpu" and isa not in CPU_VIEW_ISAS:
        raise NotImplementedError(f"the PyTorch tree path cannot read the {isa!r} KV layout")
    key_cache, value_cache = cpu_cache_views(kv_cache, impl.head_size)
    for r in step.requests:
        n1 = r.buffers.width
        rows = slice(r.start, r.start + n1)
        hkv = key_cache.shape[2]
        group = impl.num_heads // hkv
        if r.kv_index is None:
            length = r.root + n1
            pos = torch.arange(length)
            bs = key_cache.shape[1]
            r.kv_index = (attn_metadata.block_table[r.index].long()[pos // bs], pos % bs)
            allowed = torch.ones(n1, length, dtype=torch.bool)
            allowed[:, r.root:] = r.buffers.ancestor_mask[0]
            # Additive mask, rows ordered (node, head-in-group) like the grouped queries below.
            mask = torch.zeros(n1, length, dtype=query.dtype).masked_fill_(~allowed, float("-inf"))
            r.attn_mask = mask.repeat_interleave(group, 0)
        blk, off = r.kv_index
        k = key_cache[blk, off]  # [L, Hkv, D]
        v = value_cache[blk, off]
        # GQA: query head h reads KV head h // group; one bmm per KV head, not SDPA with
        # enable_gqa and a bool mask (its math path): 2x faster (docs/tree-verification.md).
        q = query[rows].view(n1, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, n1 * group, d)
        scores = torch.baddbmm(r.attn_mask, q, k.permute(1, 2, 0), alpha=impl.scale)
        o = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))  # [Hkv, n1*group, D]
        out[rows] = o.view(hkv, n1, group, d).permute(1, 0, 2, 3).reshape(n1, impl.num_heads, d).to(out.dtype)


def cpu_kernel_inputs(step: TreeStep) -> tuple[Tensor, Tensor]:
    """(meta [R, 4] int64, anc [R, NMAX, NMAX] uint8) of a step for the C++ kernel."""
    width = max(r.buffers.width for r in step.requests)
    meta = torch.tensor([[r.start, r.buffers.width, r.root, r.index] for r in step.requests], dtype=torch.long)
    anc = torch.zeros(len(step.requests), width, width, dtype=torch.uint8)
    for k, r in enumerate(step.requests):
        n1 = r.buffers.width
        anc[k, :n1, :n1] = r.buffers.ancestor_mask[0]
    return meta, anc


# ============================================================================ acceptance
def chain_only_reason(sampling_params: Any) -> str | None:
    """Why a request must draft a chain instead of a tree (None: a tree is fine).

    vLLM applies these per draft *position*, assuming draft j's context is drafts < j
    (``rejection_sampler.py`` ``apply_logits_processors``, the scheduler's grammar check),
    which a BFS-flattened tree is not."""
    sp = sampling_params
    if sp is None:
        return None
    if sp.logprobs is not None:
        return "logprobs"
    if sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0:
        return "penalties"
    if getattr(sp, "bad_words", None) or getattr(sp, "_bad_words_token_ids", None):
        return "bad_words"
    if sp.allowed_token_ids:
        return "allowed_token_ids"
    if sp.min_tokens:
        return "min_tokens"
    if getattr(sp, "structured_outputs", None) is not None:
        return "structured output"
    return None


def chain_metadata(num_draft: list[int], draft_ids: list[int], device: torch.device) -> Any:
    """vLLM ``SpecDecodeMetadata`` for chains laid out request after request: request i owns
    ``num_draft[i] + 1`` consecutive logits rows (draft rows, then its bonus row)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n = np.asarray(num_draft, dtype=np.int32)
    cu_sampled = np.cumsum(n + 1, dtype=np.int32)
    starts = cu_sampled - (n + 1)
    target = np.concatenate([s + np.arange(k, dtype=np.int32) for s, k in zip(starts, n)]) \
        if len(n) else np.zeros(0, np.int32)

    def t(a: Any) -> Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.int32), device=device)

    return SpecDecodeMetadata(
        draft_token_ids=t(draft_ids), num_draft_tokens=[int(k) for k in n],
        cu_num_draft_tokens=t(np.cumsum(n, dtype=np.int32)), cu_num_sampled_tokens=t(cu_sampled),
        target_logits_indices=t(target), bonus_logits_indices=t(starts + n),
        logits_indices=t(np.arange(int(cu_sampled[-1]) if len(n) else 0)))


def rows_argmax(logits: Tensor) -> Tensor:
    """The target's greedy token at every logits row [R, V] -> int64 [R] on the CPU.

    ``max(-1).indices`` is argmax (first maximal index, NaN wins: the same rule) at a third
    of argmax's time on the CPU; the C++ kernel (``kernels.tree_attention_cpu.rows_argmax_cpu``)
    is 4-8x faster again (docs/tree-verification.md).
    """
    if logits.device.type == "cpu" and logits.stride(-1) == 1 and cpu_kernel_enabled():
        return rows_argmax_cpu(logits)
    return logits.max(-1).indices.cpu()


class CloverRejectionSampler(torch.nn.Module):
    """Replaces ``runner.rejection_sampler`` in every Clover engine.

    A step in which no request drafted (drafting off at this batch size:
    ``disable_by_batch_size``) goes to vLLM's plain ``Sampler``, as a non-speculative engine
    runs: vLLM 0.32 builds spec-decode metadata and runs its rejection sampler on every step
    of a speculative engine, drafts or not, at about three times the plain sampler's cost
    (it samples the bonus rows with full-vocabulary logits kept for logprobs;
    docs/tree-verification.md). Other steps without tree requests go to vLLM's rejection
    sampler. Otherwise each tree request picks its accepted path here (greedy: :func:`tree.greedy_accept`; temperature > 0:
    :func:`tree.sample_accept`, one-hot rule, lossless for top-k candidates), its target KV
    is compacted, and vLLM's sampler then runs on every request with tree requests reduced
    to their accepted path as a chain: for greedy rows it reproduces the same tokens, for
    sampled rows our tokens overwrite its row. Output layout, logprobs of the other
    requests, penalties, roll-back and metrics therefore stay vLLM's.
    """

    def __init__(self, inner: torch.nn.Module, kv_layers: Any, context: TreeStepContext | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.context = context if context is not None else TreeStepContext()  # this engine's tree plan
        self._kv_layers = kv_layers  # () -> list of (impl, kv_cache, CPU isa or None), target layers
        self._layers: list[tuple[Any, Tensor, str | None]] | None = None  # built once (bound at start-up)
        self._isa: str | None = None  # their CPU attention ISA (one for all), with _layers
        self._caches: list[Tensor] | None = None  # their K/V views, built once
        self._table: Tensor | None = None  # base addresses of _caches (kernels.cache_table), built once

    def forward(self, metadata: Any, draft_probs: Tensor | None, logits: Tensor,
                sampling_metadata: Any) -> Any:
        step = self.context.step
        if step is None:
            if not any(metadata.num_draft_tokens):
                # One logits row per request, nothing to verify: the same tokens and
                # logprobs as the rejection sampler's bonus path (test_tree_verify.py).
                return self.inner.sampler(logits=logits, sampling_metadata=sampling_metadata)
            return self.inner(metadata, draft_probs, logits, sampling_metadata)
        num_draft = list(metadata.num_draft_tokens)
        row0 = np.concatenate([[0], np.cumsum(np.asarray(num_draft) + 1)])
        draft0 = np.concatenate([[0], np.cumsum(num_draft)])
        drafts = metadata.draft_token_ids.cpu().long()
        probs = None
        target_argmax: Tensor | None = None  # [rows] on CPU, one argmax for all greedy rows
        sampled_rows: dict[int, Tensor] = {}
        on_device = step.device is not None and all(_is_greedy(sampling_metadata, r.index) for r in step.requests)
        if on_device:
            self._accept_on_device(step, metadata, logits, num_draft)
        for r in [] if on_device else step.requests:
            i = r.index
            n1 = r.buffers.width
            if num_draft[i] + 1 != n1:
                raise RuntimeError(f"vllm-clover: tree request row {i} has {num_draft[i]} drafts "
                                   f"scheduled but {n1 - 1} planned")
            tokens = torch.zeros(1, n1, dtype=torch.long)
            tokens[0, 1:] = drafts[draft0[i]:draft0[i] + n1 - 1]
            rows = torch.arange(int(row0[i]), int(row0[i]) + n1, device=logits.device)
            if _is_greedy(sampling_metadata, i):
                if target_argmax is None:
                    target_argmax = rows_argmax(logits)
                result = greedy_accept(tokens, target_argmax[int(row0[i]):int(row0[i]) + n1][None], r.buffers)
            else:
                if probs is None:
                    probs = _target_probs(logits, metadata, sampling_metadata)
                gen = sampling_metadata.generators.get(i)
                result = sample_accept(tokens.to(logits.device), probs[rows][None],
                                       _to(r.buffers, logits.device), generator=gen)
                sampled_rows[i] = result.output_tokens[0]
            a = int(result.num_accepted[0])
            r.path = result.accepted_nodes[0, : a + 1].tolist()
        if not on_device:
            self.compact(step)
        if _plain_greedy_tree_batch(step, sampling_metadata, len(num_draft)):
            return self._greedy_output(step, drafts, draft0, row0, logits, sampling_metadata)
        order, chain_num, chain_ids = [], [], []
        for i, n in enumerate(num_draft):
            r = step.by_index.get(i)
            nodes = r.path if r is not None else list(range(n + 1))
            order.extend(int(row0[i]) + k for k in nodes)
            chain_num.append(len(nodes) - 1)
            chain_ids.extend(int(drafts[draft0[i] + k - 1]) for k in nodes[1:])
        chained = chain_metadata(chain_num, chain_ids, logits.device)
        sm = sampling_metadata
        if sm.spec_token_ids is not None:
            sm = dataclasses.replace(sm, spec_token_ids=_chain_spec_ids(sm.spec_token_ids, step))
        out = self.inner(chained, None, logits[torch.as_tensor(order, device=logits.device)], sm)
        for i, row in sampled_rows.items():
            w = min(row.numel(), out.sampled_token_ids.shape[1])
            out.sampled_token_ids[i].fill_(-1)
            out.sampled_token_ids[i, :w] = row[:w].to(out.sampled_token_ids.dtype)
        return out

    def _greedy_output(self, step: TreeStep, drafts: Tensor, draft0: np.ndarray, row0: np.ndarray,
                       logits: Tensor, sampling_metadata: Any) -> Any:
        """vLLM's sampler output for a batch of greedy tree requests without logits processing
        (:func:`_plain_greedy_tree_batch`), built directly: row i = the drafts of its accepted
        path, then its bonus token, -1 padded ([B, max accepted + 1] int32, as
        ``rejection_sample``). vLLM's rejection sampler would take the same drafts (the target's
        argmax matched each) and give the same bonus; the bonus still comes from vLLM's
        ``Sampler`` (logit_bias and other bonus-only processors stay vLLM's). Saves the
        re-gather, float copy and rejection pass of the chained logits (docs/tree-verification.md)."""
        from vllm.v1.outputs import SamplerOutput

        reqs = [step.by_index[i] for i in range(len(row0) - 1)]
        ends = [int(row0[r.index]) + r.path[-1] for r in reqs]
        bonus = self.inner.sampler(logits=logits[torch.as_tensor(ends, device=logits.device)],
                                   sampling_metadata=sampling_metadata, predict_bonus_token=True)
        width = max(len(r.path) for r in reqs)
        out = torch.full((len(reqs), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        for r in reqs:
            accepted = [int(drafts[draft0[r.index] + k - 1]) for k in r.path[1:]]
            out[r.index, : len(accepted)] = torch.tensor(accepted, dtype=torch.int32)
        out[torch.arange(len(reqs)), torch.tensor([len(r.path) - 1 for r in reqs])] = (
            bonus.sampled_token_ids[:, 0].cpu().to(torch.int32))
        return SamplerOutput(sampled_token_ids=out.to(logits.device), logprobs_tensors=None)

    def _accept_on_device(self, step: TreeStep, metadata: Any, logits: Tensor, num_draft: list[int]) -> None:
        """Greedy tree requests with device metadata (FlashAttention layout): acceptance of all
        of them and the KV compaction of every layer on the device
        (``attention_backend.device_greedy_accept``, ``compaction_moves``, one
        ``kernels.kv_compact_layers`` launch), then one read-back of the accepted paths, which
        vLLM's output and the trunk view need on the host."""
        from vllm_clover.engine.attention_backend import compaction_moves, device_greedy_accept

        for r in step.requests:
            if num_draft[r.index] + 1 != r.buffers.width:
                raise RuntimeError(f"vllm-clover: tree request row {r.index} has {num_draft[r.index]} drafts "
                                   f"scheduled but {r.buffers.width - 1} planned")
        accepted, _ = device_greedy_accept(step.device, metadata.draft_token_ids, logits.argmax(dim=-1))
        self._compact_on_device(*compaction_moves(step.device, accepted))
        for r, row in zip(step.requests, accepted.cpu()):
            r.path = row[row >= 0].tolist()

    def _compact_on_device(self, src: Tensor, dst: Tensor) -> None:
        """``kernels.kv_compact_layers`` over the K and V views of every target layer."""
        from vllm_clover.kernels import cache_table, kv_compact_layers

        if self._caches is None:
            self._layers = self._kv_layers()
            self._caches = [view for impl, kv_cache, _ in self._layers for view in cache_views(impl, kv_cache)]
        if self._table is None:
            self._table = cache_table(self._caches)
        kv_compact_layers(self._caches, self._table, src, dst)

    def compact(self, step: TreeStep) -> None:
        """Move the target KV of each accepted node n_j (slot of root + n_j) to the slot of
        root + j, for every target layer (Clover's trunk writes its own KV contiguously)."""
        moves = [(r.slots[r.path[j]], r.slots[j]) for r in step.requests
                 for j in range(1, len(r.path)) if r.path[j] != j]
        if not moves:
            return
        from vllm_clover.kernels import kv_compact

        src = torch.stack([m[0] for m in moves])[None]
        dst = torch.stack([m[1] for m in moves])[None]
        if self._layers is None:
            self._layers = self._kv_layers()
            isas = {isa for _, _, isa in self._layers}
            if len(isas) != 1:
                raise RuntimeError(f"vllm-clover: target layers with different CPU KV layouts {sorted(map(str, isas))}")
            self._isa = isas.pop()
        layers = self._layers
        from vllm_clover.engine.attention_backend import CPU_LAYOUT, kv_layout

        if kv_layout(layers[0][0]) == CPU_LAYOUT and layers[0][1].device.type == "cpu" and cpu_kernel_enabled():
            kv_compact_cpu([kv_cache for _, kv_cache, _ in layers], src, dst, self._isa)  # one C++ call
            return
        if self._caches is None:
            self._caches = [view for impl, kv_cache, _ in layers for view in cache_views(impl, kv_cache)]
        caches = self._caches
        kv_compact(caches, src.to(caches[0].device), dst.to(caches[0].device))


def _plain_greedy_tree_batch(step: TreeStep, sampling_metadata: Any, batch_size: int) -> bool:
    """True when vLLM's rejection sampler could only confirm our greedy acceptance: every
    request of the batch is a tree request (so none needs logprobs, penalties, bad words,
    allowed tokens, min_tokens or structured output: :func:`chain_only_reason`), all are
    greedy, and no thinking-token budget is tracked."""
    sm = sampling_metadata
    if not sm.all_greedy or sm.max_num_logprobs is not None or sm.logprob_token_ids:
        return False
    if len(step.by_index) != batch_size:
        return False
    holder = getattr(sm, "thinking_budget_state_holder", None)
    return holder is None or not holder.has_tracked_requests()


def _is_greedy(sampling_metadata: Any, i: int) -> bool:
    return bool(sampling_metadata.all_greedy) or float(sampling_metadata.temperature[i]) == GREEDY_TEMPERATURE


def _target_probs(logits: Tensor, metadata: Any, sampling_metadata: Any) -> Tensor:
    """Temperature / top-k / top-p processed target distribution of every logits row, with
    vLLM's own ``apply_sampling_constraints`` (rows grouped per request by cu_num_sampled)."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    processed = apply_sampling_constraints(logits.to(torch.float32).clone(), metadata.cu_num_sampled_tokens,
                                           sampling_metadata)
    return torch.softmax(processed, dim=-1)


def _to(buffers: TreeBuffers, device: torch.device) -> TreeBuffers:
    return TreeBuffers(**{f.name: getattr(buffers, f.name).to(device) for f in dataclasses.fields(buffers)})


def _chain_spec_ids(spec_token_ids: list[list[int]], step: TreeStep) -> list[list[int]]:
    """``SamplingMetadata.spec_token_ids`` (used for penalties / bad words) with each tree
    request's drafts replaced by its accepted path, matching the chained metadata."""
    out = []
    for i, ids in enumerate(spec_token_ids):
        r = step.by_index.get(i)
        out.append(ids if r is None else [ids[k - 1] for k in r.path[1:]])
    return out


# ============================================================================ drafter side
def trunk_view(step: TreeStep | None, query_start_loc: np.ndarray, num_reqs: int,
               slot_mapping: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """Rows for Clover's trunk after a tree step: every scheduled row of non-tree requests,
    and only the accepted path of each tree request (root first), laid out as a chain.

    Returns (rows [M] long: indices into this step's scheduled rows, query_start_loc [B+1]
    int32 of the view, slots [M] long: the KV slots the trunk writes), or None when the
    step had no tree request (the trunk then runs on the step as scheduled).
    """
    if step is None or not step.requests:
        return None
    rows: list[Tensor] = []
    slots: list[Tensor] = []
    counts = []
    slot_mapping = slot_mapping.cpu().long()
    for i in range(num_reqs):
        s, e = int(query_start_loc[i]), int(query_start_loc[i + 1])
        r = step.by_index.get(i)
        if r is None:
            rows.append(torch.arange(s, e))
            slots.append(slot_mapping[s:e])
        else:
            path = torch.as_tensor(r.path, dtype=torch.long)
            rows.append(s + path)
            slots.append(r.slots[: len(r.path)])  # the contiguous slots root .. root + a
        counts.append(len(rows[-1]))
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(counts), 0)
    return torch.cat(rows), qsl, torch.cat(slots)


def select_tree(tree: StaticTree, batch_size: int, token_budget: int, max_nodes: int) -> StaticTree:
    """The tree for this step: the configured one while ``B * (N + 1) <= token_budget`` and
    it fits the scheduler's draft allowance, else the longest chain that fits (at least 1).

    Why: verifying costs B * (N + 1) target tokens; a 2-core CPU is compute-bound after a
    few dozen tokens (measured: docs/tree-verification.md), so large batches get chains."""
    if tree.num_nodes <= max_nodes and batch_size * (tree.num_nodes + 1) <= token_budget:
        return tree
    k = max(1, min(tree.max_depth, max_nodes, token_budget // batch_size - 1))
    return get_tree(f"chain{k}")


def spine(parent: list[int]) -> list[int]:
    """Node indices of the top-1 path (the first child at every depth), depth 1 first, from
    BFS parent pointers (root first, siblings in rank order): a request that must draft a
    chain gets these tokens of its tree."""
    path, node = [], 0
    while True:
        child = next((m for m in range(node + 1, len(parent)) if parent[m] == node), None)
        if child is None:
            return path
        path.append(child)
        node = child
