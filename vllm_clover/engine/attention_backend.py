"""Tree verification in FlashAttention's KV layout: the step's tree metadata in persistent
device buffers, the tree rows of all requests in one varlen launch, greedy acceptance and KV
compaction on the device; and the CUSTOM attention backend that carries the metadata.

Why this shape (docs/gpu.md): on a GPU every host read of a device tensor stalls the stream,
and CUDA graphs replay fixed addresses. So everything a tree step needs is built on the host
from the scheduler's data and the runner's host-side bookkeeping (the plan of
``tree_verify.plan_tree_step``), written into pinned host mirrors and copied to buffers that
live as long as the engine (:class:`TreeMetadataBuffers`); kernels read only those.

* :class:`TreeMetadataBuffers` / :class:`TreeAttentionMetadata`: per tree request of the step,
  ``meta`` [R, 4] int32 (first query row, n1 = rows with the root, root position, batch row),
  the ancestor bitmask [R, NMAX, W] int32 (kernels.tree_attention, "varlen"), and for
  acceptance and compaction the parents, depths, dense ancestor mask, node KV slots and the
  logits row of every node.
* :func:`flash_tree_rows`: the tree rows of every request of the step, every query head, in one
  Triton launch per layer (``kernels.tree_attention_varlen``), for the layout
  :func:`kv_layout` calls ``"flash"``. Which branch runs depends on the layout the attention
  impl uses, never on the device: the CPU suite runs this one under ``TRITON_INTERPRET=1``.
* :func:`device_greedy_accept`: ``drafting.acceptance.greedy_accept``'s rule over the padded batch,
  with the depth bound from the host (no ``.max()`` read back); :func:`compaction_moves`: the
  step's KV moves as two [R * D] slot tensors, -1 where nothing moves, for the one-launch
  ``kernels.kv_compact_layers``.
* :func:`backend_class`: ``CloverTreeAttentionBackend``, FlashAttention's backend with a metadata
  builder that attaches the step's :class:`TreeAttentionMetadata` to FlashAttention's metadata
  (``clover_tree``). Defined on first use, where vLLM's FlashAttention module imports, and
  registered as ``AttentionBackendEnum.CUSTOM`` by :func:`register_custom_backend`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from vllm_clover.drafting.acceptance import _path_to_nodes

Tensor = torch.Tensor
# The tree hooks' KV layouts: FlashAttention's (the CUSTOM backend's impl is FlashAttention's)
# and CPU_ATTN's (tree_verify.cpu_cache_views).
FLASH_LAYOUT = "flash"
CPU_LAYOUT = "cpu"
FLASH_IMPL = "FlashAttentionImpl"
CUSTOM_BACKEND_PATH = "vllm_clover.engine.attention_backend.CloverTreeAttentionBackend"


def kv_layout(impl: Any) -> str:
    """The KV layout of an attention impl: FlashAttention's for ``FlashAttentionImpl`` and its
    subclasses (by class name, so this check imports nothing), else CPU_ATTN's. Tree
    verification refuses every other backend at start-up (proposer
    ``_check_tree_attention_backends``), so no third layout reaches the hooks."""
    return FLASH_LAYOUT if any(cls.__name__ == FLASH_IMPL for cls in type(impl).__mro__) else CPU_LAYOUT


def flash_cache_views(kv_cache: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
    """FlashAttention's (key, value) views [num_blocks, block_size, Hkv, D] of one layer's
    cache [num_blocks, Hkv, block_size, 2 * D], as ``FlashAttentionImpl.forward`` takes them."""
    key, value = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key, value


# ============================================================================ metadata
@dataclass
class TreeAttentionMetadata:
    """The tree requests of one step on the device (views of :class:`TreeMetadataBuffers`;
    R requests, NMAX = the widest tree's rows, D = the deepest path). Host ints only."""

    num_requests: int
    max_nodes: int
    max_depth: int
    meta: Tensor        # [R, 4] int32: first query row, n1, root position, batch row
    anc_bits: Tensor    # [R, NMAX, W] int32 ancestor bitmask (kernels.tree_attention, varlen)
    ancestors: Tensor   # [R, NMAX, NMAX] bool, the same mask dense (acceptance)
    parent: Tensor      # [R, NMAX] long, -1 at the root and padding
    depth: Tensor       # [R, NMAX] long
    valid: Tensor       # [R, NMAX] bool
    slots: Tensor       # [R, NMAX] long: KV slot of node n (position root + n); -1 padding
    logits_rows: Tensor  # [R, NMAX] long: the logits row of node n (padding: the root's)
    draft_index: Tensor  # [R, NMAX] long: node n >= 1's index in the step's draft tokens (0: root/padding)


class TreeMetadataBuffers:
    """Persistent buffers for up to ``max_requests`` tree requests of up to ``max_nodes`` rows
    each (one engine's ``max_num_seqs`` and K + 1), on ``device``, with host mirrors (pinned on
    CUDA). :meth:`build` fills the mirrors from a plan and copies them over without a sync; the
    device tensors never move, so their addresses may be captured.

    Reuse is safe because a step's copies are ordered before its kernels on the stream, and
    the next build happens after the step's sampled tokens were read back (vLLM reads them
    every step), which waits for those copies."""

    def __init__(self, max_requests: int, max_nodes: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_requests = max_requests
        self.max_nodes = max_nodes
        words = (max_nodes + 31) // 32
        pin = self.device.type == "cuda"
        specs = {"meta": ((max_requests, 4), torch.int32), "anc_bits": ((max_requests, max_nodes, words), torch.int32),
                 "ancestors": ((max_requests, max_nodes, max_nodes), torch.bool),
                 "parent": ((max_requests, max_nodes), torch.long), "depth": ((max_requests, max_nodes), torch.long),
                 "valid": ((max_requests, max_nodes), torch.bool), "slots": ((max_requests, max_nodes), torch.long),
                 "logits_rows": ((max_requests, max_nodes), torch.long),
                 "draft_index": ((max_requests, max_nodes), torch.long)}
        self.host = {k: torch.zeros(shape, dtype=dt, pin_memory=pin) for k, (shape, dt) in specs.items()}
        self.dev = {k: torch.zeros(shape, dtype=dt, device=self.device) for k, (shape, dt) in specs.items()}

    def build(self, step: Any, logits_start: list[int] | None = None,
              draft_start: list[int] | None = None) -> TreeAttentionMetadata:
        """The device metadata of ``step`` (a ``tree_verify.TreeStep``; its requests' host
        fields only). ``logits_start[k]`` / ``draft_start[k]``: the first logits row and the
        first draft-token index of tree request k (default: its first query row, and the same
        minus the requests before it, one bonus row each: vLLM's spec-decode layout when every
        scheduled row is a logits row)."""
        from vllm_clover.kernels.tree_attention import ancestor_bits

        reqs = step.requests
        r = len(reqs)
        nmax = max(q.buffers.width for q in reqs)
        if r > self.max_requests or nmax > self.max_nodes:
            raise RuntimeError(f"vllm-clover: tree step of {r} requests x {nmax} rows exceeds the "
                               f"buffers ({self.max_requests} x {self.max_nodes})")
        h = self.host
        for name in ("parent", "slots"):
            h[name][:r, :nmax].fill_(-1)
        for name in ("ancestors", "valid", "depth", "logits_rows", "draft_index"):
            h[name][:r, :nmax].zero_()
        max_depth = 0
        for k, q in enumerate(reqs):
            b, n1 = q.buffers, q.buffers.width
            first_logit = q.start if logits_start is None else logits_start[k]
            first_draft = q.start - k if draft_start is None else draft_start[k]
            h["meta"][k] = torch.tensor([q.start, n1, q.root, q.index], dtype=torch.int32)
            h["ancestors"][k, :n1, :n1] = b.ancestor_mask[0]
            h["parent"][k, :n1] = b.parent[0]
            h["depth"][k, :n1] = b.depth[0]
            h["valid"][k, :n1] = b.valid[0]
            h["slots"][k, :n1] = q.slots
            h["logits_rows"][k, :n1] = first_logit + torch.arange(n1)
            h["logits_rows"][k, n1:nmax] = first_logit
            h["draft_index"][k, 1:n1] = first_draft + torch.arange(n1 - 1)
            max_depth = max(max_depth, int(b.depth[0].max()))
        words = (nmax + 31) // 32
        h["anc_bits"][:r, :nmax, :words] = ancestor_bits(h["ancestors"][:r, :nmax, :nmax])
        shape = {"meta": (r,), "anc_bits": (r, nmax, words), "ancestors": (r, nmax, nmax)}
        views = {}
        for name, host in h.items():
            index = tuple(slice(0, k) for k in shape.get(name, (r, nmax)))
            dst = self.dev[name][index]
            dst.copy_(host[index], non_blocking=True)
            views[name] = dst
        return TreeAttentionMetadata(num_requests=r, max_nodes=nmax, max_depth=max_depth, **views)


# ============================================================================ attention
def flash_tree_rows(query: Tensor, kv_cache: Tensor, block_table: Tensor, output: Tensor,
                    tree: TreeAttentionMetadata, num_heads: int, head_size: int, scale: float) -> None:
    """Overwrite the attention output of every tree row of the step (FlashAttention layout):
    one ``kernels.tree_attention_varlen`` launch. query [T, Hq, D]; output [T, Hq * D] or
    [T, Hq, D], written in place; block_table [B, max_blocks] int32."""
    from vllm_clover.kernels import tree_attention_varlen

    key, value = flash_cache_views(kv_cache, head_size)
    out = output.view(output.shape[0], num_heads, head_size)
    q = query.view(query.shape[0], num_heads, head_size)
    tree_attention_varlen(q, key, value, out, block_table, tree.meta, tree.anc_bits, scale)


# ============================================================================ acceptance
def device_greedy_accept(tree: TreeAttentionMetadata, draft_token_ids: Tensor,
                         target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance of every tree request at once, on the device, with
    ``drafting.acceptance.greedy_accept``'s rule (longest matching path, ties to the lower node).

    draft_token_ids [num drafts]: the step's draft tokens (vLLM's spec-decode metadata);
    target_argmax [num logits rows]: the target's greedy token at every logits row.
    Returns (accepted_nodes [R, D+1] long, root first, -1 padded; bonus [R] long: the argmax
    at the path's end)."""
    n = tree.max_nodes
    tokens = draft_token_ids.long()[tree.draft_index]  # column 0 (root) is never compared
    argmax = target_argmax.long()[tree.logits_rows]  # [R, NMAX]: row n predicts after node n
    par = tree.parent.clamp(min=0)
    match = (tokens == argmax.gather(1, par)) & tree.valid
    match[:, 0] = True
    path_ok = ~(tree.ancestors & ~match[:, None, :]).any(-1)
    idx = torch.arange(n, device=tokens.device)
    score = torch.where(path_ok, tree.depth * (n + 1) + (n - idx), torch.full_like(tree.depth, -1))
    best = score.argmax(-1)
    rows = torch.arange(tree.num_requests, device=tokens.device)
    accepted = _path_to_nodes(tree.ancestors[rows, best], tree.depth, tree.max_depth)
    return accepted, argmax[rows, best]


def compaction_moves(tree: TreeAttentionMetadata, accepted_nodes: Tensor) -> tuple[Tensor, Tensor]:
    """KV moves that make each accepted path contiguous: node ``accepted[r, j]``'s slot ->
    node j's slot (the position root + j), for j >= 1; -1 where nothing moves. Returns
    (src, dst) [R * D] long on the device, for ``kernels.kv_compact_layers``."""
    node = accepted_nodes[:, 1:]
    j = torch.arange(1, node.shape[1] + 1, device=node.device).expand_as(node)
    moves = (node >= 0) & (node != j)
    src = tree.slots.gather(1, node.clamp(min=0))
    dst = tree.slots.gather(1, j.clamp(max=tree.max_nodes - 1))
    none = torch.full_like(src, -1)
    return torch.where(moves, src, none).reshape(-1), torch.where(moves, dst, none).reshape(-1)


# ============================================================================ CUSTOM backend
# The engine's TreeStepContext, for the CUSTOM backend's metadata builder (vLLM builds it
# with the KV spec, layer names, config and device only). One Clover engine per worker
# process; bound by CloverProposer.load_model.
_CONTEXT: dict[str, Any] = {}


def bind_tree_context(context: Any) -> None:
    _CONTEXT["tree"] = context


def current_tree_metadata() -> TreeAttentionMetadata | None:
    """The device metadata of the tree step in flight (None: no tree request in it)."""
    context = _CONTEXT.get("tree")
    step = None if context is None else context.step
    return None if step is None else step.device


@functools.lru_cache(maxsize=1)
def backend_class() -> type:
    """``CloverTreeAttentionBackend``: FlashAttention's backend under the name ``CUSTOM`` whose
    metadata builder sets ``clover_tree`` (the step's :class:`TreeAttentionMetadata`, or None)
    on the FlashAttention metadata it builds. Its impl is FlashAttention's, whose forward the
    tree-rows hook wraps (patch ``attention-tree-rows``). Defined where vLLM's FlashAttention
    module imports (GPU and CPU builds of vLLM 0.32)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder

    class CloverTreeAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
            metadata.clover_tree = current_tree_metadata()
            return metadata

    class CloverTreeAttentionBackend(FlashAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_builder_cls() -> type:
            return CloverTreeAttentionMetadataBuilder

    for cls in (CloverTreeAttentionBackend, CloverTreeAttentionMetadataBuilder):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return CloverTreeAttentionBackend


def register_custom_backend() -> None:
    """Register :func:`backend_class` as vLLM's ``AttentionBackendEnum.CUSTOM`` (public API,
    ``vllm.v1.attention.backends.registry.register_backend``; resolved by class path, so it
    imports this module in the process that selects it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, CUSTOM_BACKEND_PATH)


def __getattr__(name: str) -> Any:
    # ``CloverTreeAttentionBackend`` is defined on first access (it imports FlashAttention).
    if name == "CloverTreeAttentionBackend":
        return backend_class()
    raise AttributeError(name)
