"""``CloverProposer``: Clover chain drafting inside vLLM's V1 model runner.

The runner hooks (vllm_clover/engine/runner_hooks.py) install it in place of vLLM's
``MedusaProposer`` and route ``propose_draft_token_ids`` to :meth:`propose_clover`,
which runs once per engine step, after the target forward, the rejection sampler and
the runner's bookkeeping (medusa timing), with:

* ``aux_hidden_states[0]`` [N, H]: the target's last-layer residual stream before its
  final norm (Clover's x_t) for all N scheduled rows (prefill chunks and verified drafts);
* the runner's persistent batch, whose ``token_ids_cpu`` already holds every committed
  token, including the ones just accepted / sampled.

Per step: (1) the trunk runs over all N rows with the EAGLE shift, y[t] = the token at
position(t)+1 of t's request, writing the Augmenting-Block KV cache through vLLM's paged
attention (same blocks and slots as the target); (2) the heads draft K tokens for every
request at once from z at its last accepted row. See docs/design-proposer.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.forward_context import set_forward_context
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.v1.spec_decode.medusa import MedusaProposer

from vllm_clover.model.checkpoint import CloverCheckpointError
from vllm_clover.cpu.linear import (draft_matmul_dtype, drafter_product, onednn_available, pack_linears,
                                    repack_vllm_linears)
from vllm_clover.drafting.datastore import NgramDatastore, load_datastore
from vllm_clover.model.draft_vocab import load_draft_vocab
from vllm_clover.engine.options import ADAPTIVE, DYNAMIC, CloverOptions
from vllm_clover.drafting.lookup import graft_retrieval, lookup_continuation, retrieval_chain
from vllm_clover.drafting.tree import StaticTree, build_dynamic_tree, dynamic_budget, expand_static_tree
from vllm_clover.engine.tree_verify import (GREEDY_TEMPERATURE, TreeStep, TreeStepContext, chain_only_reason,
                                            select_tree, spine, trunk_view)
from vllm_clover.engine.vllm_model import CloverForSpeculativeDecoding
from vllm_clover.engine.vocab_parallel import TargetVocab

logger = logging.getLogger(__name__)

Tensor = torch.Tensor
# The adaptive tree's shape when it drafts lookup tokens only: the root, no heads' node.
_ROOT_ONLY = StaticTree((), name="lookup-only")


def trunk_inputs(token_ids: Tensor, num_tokens: Tensor, positions: Tensor,
                 query_start_loc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """EAGLE-shifted trunk tokens and per-request gather indices (CPU, no Python loop): the
    definition, read straight from the committed tokens; the proposer runs
    :func:`device_trunk_inputs`, which gives the same values without reading positions back
    from the device.

    token_ids [R, L]: the persistent batch's committed tokens (row i = request i);
    num_tokens [B]: committed tokens per request (prompt + outputs, drafts excluded);
    positions [N]: position of each scheduled row; query_start_loc [B+1].

    Returns
      y [N] long: the token at position+1 of the row's request, i.e. the next input
        token within a chunk, the newly sampled token at the last accepted row, the next
        prompt token for a partial prefill; 0 for rows past the last accepted one
        (rejected drafts: their trunk KV is rewritten next step, when vLLM rolls back).
      last [B] long: index of each request's last accepted row (head-0 input);
      first [B] long: each request's last committed token (y at that row).
    """
    b = query_start_loc.numel() - 1
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    num_tokens = num_tokens[:b].long()
    positions = positions.long()
    row_req = torch.repeat_interleave(torch.arange(b), ends - starts)
    nxt = positions + 1
    valid = nxt < num_tokens[row_req]
    y = token_ids[row_req, nxt.clamp(max=token_ids.shape[1] - 1)].long()
    y = torch.where(valid, y, torch.zeros_like(y))
    # The row at position num_tokens-2 is the last one whose successor is committed;
    # partial prefills (successor still a prompt token past the chunk) use their last row.
    last = starts + (num_tokens - 2 - positions[starts])
    last = torch.minimum(torch.maximum(last, starts), ends - 1)
    first = token_ids[torch.arange(b), (num_tokens - 1).clamp(min=0)].long()
    return y, last, first


@dataclasses.dataclass
class TrunkInputs:
    """The trunk's inputs of one step, as :func:`trunk_inputs` defines them, built without
    reading any device tensor back (:func:`device_trunk_inputs`)."""

    y: Tensor               # [N] long, on the device: EAGLE-shifted token of every row
    last: Tensor            # [B] long, on the device: each request's last accepted row
    first: Tensor           # [B] long, on the device: each request's last committed token
    last_positions: Tensor  # [B] long, on the CPU: the position of row ``last``


def request_trunk_inputs(token_ids: Tensor, num_tokens: Tensor, first_positions: Tensor,
                         query_start_loc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The per-request half of :func:`device_trunk_inputs`, from the runner's host-side
    bookkeeping only (CPU tensors, B values each).

    token_ids [R, L], num_tokens [B] as in :func:`trunk_inputs`; first_positions [B]: the
    position of each request's first scheduled row (``num_computed_tokens``, exact on the
    host under synchronous scheduling, which Clover's medusa slot has; rows of a request
    then sit at consecutive positions, also in a ``trunk_view`` of accepted tree paths);
    query_start_loc [B+1].

    Returns (last [B], first [B], next_token [B]: the token after row ``last``,
    last_positions [B]), all long."""
    b = query_start_loc.numel() - 1
    starts = query_start_loc[:-1].long()
    counts = query_start_loc[1:].long() - starts
    num_tokens = num_tokens[:b].long()
    first_positions = first_positions[:b].long()
    offset = torch.minimum(torch.clamp(num_tokens - 2 - first_positions, min=0), counts - 1)
    last_positions = first_positions + offset
    rows = torch.arange(b)
    next_token = token_ids[rows, (last_positions + 1).clamp(max=token_ids.shape[1] - 1)].long()
    first = token_ids[rows, (num_tokens - 1).clamp(min=0)].long()
    return starts + offset, first, next_token, last_positions


def device_trunk_inputs(token_ids: Tensor, num_tokens: Tensor, first_positions: Tensor,
                        query_start_loc: Tensor, input_ids: Tensor, positions: Tensor) -> TrunkInputs:
    """:func:`trunk_inputs` with the per-row work on the device and no host sync.

    Host side (:func:`request_trunk_inputs`): B values per request, copied to the device in one
    non-blocking transfer. Device side, per row t of request r: y[t] = the next row's input
    token (``input_ids[t + 1]``) while t is before r's last accepted row (that token is
    committed: an accepted draft or a prompt token, at position(t) + 1), the request's next
    token at its last accepted row (the token just sampled, or the next prompt token of a
    partial prefill), 0 past it (rejected drafts), exactly as :func:`trunk_inputs` reads them
    from the committed tokens (tests/unit/engine/test_trunk_inputs.py).

    input_ids [N] and positions [N]: the scheduled rows' tokens and positions on the device
    (in a trunk view, the kept rows); the other arguments as in :func:`request_trunk_inputs`."""
    last, first, next_token, last_positions = request_trunk_inputs(token_ids, num_tokens, first_positions,
                                                                   query_start_loc)
    b = last.numel()
    host = torch.stack([last, first, next_token, num_tokens[:b].long(), query_start_loc[1:].long()])
    dev = host.to(positions.device, non_blocking=True)  # [5, B]
    n = positions.numel()
    row = torch.arange(n, device=positions.device)
    # Request of every row: rows before query_start_loc[r + 1] belong to r or earlier.
    row_req = torch.searchsorted(dev[4], row, right=True)
    valid = positions.long() + 1 < dev[3][row_req]
    shifted = input_ids[(row + 1).clamp(max=max(n - 1, 0))].long()
    y = torch.where(row == dev[0][row_req], dev[2][row_req], shifted)
    y = torch.where(valid, y, torch.zeros_like(y))
    return TrunkInputs(y=y, last=dev[0], first=dev[1], last_positions=last_positions)


class CloverProposer(MedusaProposer):
    """Clover drafter for the medusa slot of vLLM's V1 ``GPUModelRunner`` (and CPU runner).

    Subclassing MedusaProposer keeps every ``isinstance(drafter, MedusaProposer)`` check
    and the medusa timing (after bookkeeping, CPU token lists) of the runner.
    """

    is_clover = True  # what runner_hooks tests (no import of this module needed there)

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.options = CloverOptions.from_vllm_config(vllm_config)
        self.model: CloverForSpeculativeDecoding | None = None
        self._layer_names: set[str] = set()
        # Reduced draft vocabulary (draft_vocab.py): its ids [N] and LM-head rows [N, H]
        # (under tensor parallelism this rank's rows, zeros for the other ranks').
        self.draft_ids: Tensor | None = None
        self.draft_weight: Tensor | None = None
        # The target's LM head rows this rank holds (all of them without tensor parallelism).
        self.vocab: TargetVocab | None = None
        # The LM-head product over the draft vocabulary ([B, H] -> [B, N]): the target's own
        # (packed on CPU) for the full vocabulary, a packed or plain product over draft_weight.
        self._draft_lm_head: Any = None
        # dtype of the drafter's packed products on CPU (draft_dtype option; else the model's).
        self.matmul_dtype: torch.dtype = self.dtype
        # Wall time of propose_clover (CloverWorkerExtension.clover_timing). On a GPU the
        # clock stops after a synchronize only when VLLM_CLOVER_PROFILE=1 (it stalls the stream).
        self.timing = {"draft_s": 0.0, "calls": 0}
        # Whether the last drafting call gave any request a draft (None: none ran this step); the
        # worker marks its output with it so the EngineCore skips the draft fetch (runner_hooks).
        self.drafted: bool | None = None
        self._sync = os.environ.get("VLLM_CLOVER_PROFILE") == "1" and torch.device(device).type == "cuda"
        # Draft log for tests and debugging (CloverWorkerExtension.clover_record_drafts):
        # None = off; else a list of (req_id, committed token ids, draft token ids).
        self.records: list[tuple[str, list[int], list[int]]] | None = None
        # With records on, tree steps also log (req_id, committed ids, node tokens, parents).
        self.tree_records: list[tuple[str, list[int], list[int], tuple[int, ...]]] = []
        # Tree mode (tree_verify.py): the configured tree, and per request the tokens and
        # parent pointers of the tree drafted last, read when its drafts come back scheduled.
        self.tree: StaticTree | str | None = self.options.drafting_tree() if self.options.tree else None
        self.tree_drafts: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        # This engine's tree plan of the step in flight: published by the runner hooks, read by
        # the target's attention layers (bound in load_model) and the rejection sampler.
        self.tree_context = TreeStepContext()
        # FlashAttention layout: the tree steps' device metadata (attention_backend.py), sized
        # for max_num_seqs trees of K + 1 rows; set in load_model.
        self.tree_metadata_buffers: Any = None
        # Retrieval drafts where the prompt lookup finds nothing (datastore.py), or None.
        self.datastore: NgramDatastore | None = None
        # tree "adaptive" (engine/adaptive.py): the per-step chooser, built by calibrate().
        self.adaptive: Any = None

    # ------------------------------------------------------------------ loading
    def load_model(self, target_model: nn.Module) -> None:
        """Load the drafter, bind the target's lm_head (E = lm_head weight, as the
        official code), and ask the target for its pre-final-norm residual stream."""
        super().load_model(target_model)  # get_model() on the draft ModelConfig
        if not isinstance(self.model, CloverForSpeculativeDecoding):
            raise CloverCheckpointError(
                f"draft model is {type(self.model).__name__}, expected CloverForSpeculativeDecoding")
        cfg = self.model.config
        target_cfg = self.vllm_config.model_config.hf_text_config
        problem = cfg.target_mismatch(target_cfg)
        if problem:
            raise CloverCheckpointError(f"Clover checkpoint {self.spec_config.model} {problem}")
        if not supports_eagle3(target_model):
            raise CloverCheckpointError(
                f"target {type(target_model).__name__} cannot return its pre-norm hidden states "
                "(no SupportsEagle3 interface), which Clover needs")
        head = getattr(target_model, "lm_head", None)
        weight = getattr(head, "weight", None)
        vocab_rows = getattr(head, "org_vocab_size", None if weight is None else weight.shape[0])
        if weight is None or vocab_rows < cfg.vocab_size or weight.shape[1] != cfg.hidden_size:
            raise CloverCheckpointError(
                f"target lm_head weight {None if weight is None else tuple(weight.shape)} does not "
                f"fit the Clover checkpoint (vocab {cfg.vocab_size}, hidden {cfg.hidden_size})")
        # ParallelLMHead pads the vocabulary and, under tensor parallelism, splits it over the
        # ranks; Clover's E and LMHead are the real rows (vocab_parallel.py).
        self.vocab = TargetVocab.of(head, cfg.vocab_size)
        if self.vocab.sharded:
            self.model.drafter.bind_vocab(self.vocab)
        else:
            self.model.bind_target(self.vocab.full_weight)
        if self.options.draft_vocab_size:
            ids = load_draft_vocab(self.options.checkpoint, self.options.draft_vocab_size, cfg.vocab_size)
            self.draft_ids = ids.to(weight.device)
            self.draft_weight = self.vocab.draft_rows(self.draft_ids)
        self._draft_lm_head = self._build_draft_lm_head(head, cfg.vocab_size)
        # Read by the runner's _setup_eagle3_aux_hidden_state_outputs right after this:
        # aux index num_layers = hidden + residual after the last layer = x_t.
        self.spec_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids = [
            target_cfg.num_hidden_layers]
        self._layer_names = set(self.model.attn_layer_names)
        for module in self.model.modules():
            if getattr(module, "layer_name", None) in self._layer_names:
                module.clover_trunk = True  # tree_verify's attention hook leaves these alone
        if self.tree is not None:
            self._check_tree_support(target_model)
            self._bind_tree_context(target_model)
            if _uses_flash_layout(target_model):
                from vllm_clover.engine.attention_backend import TreeMetadataBuffers, bind_tree_context

                self.tree_metadata_buffers = TreeMetadataBuffers(
                    self.vllm_config.scheduler_config.max_num_seqs, self.num_speculative_tokens + 1, self.device)
                bind_tree_context(self.tree_context)
        if self.options.datastore:
            self.datastore = load_datastore(self.options.datastore, cfg.vocab_size)

    def _bind_tree_context(self, target_model: nn.Module) -> None:
        """Give every target attention layer this engine's :class:`TreeStepContext`: the
        attention hook (runner_hooks ``wrap_tree_attention``) gets the layer from vLLM and
        reads the step's plan there. Clover's trunk layers are not in the target model."""
        from vllm.model_executor.layers.attention import Attention

        for module in target_model.modules():
            if isinstance(module, Attention):
                module.clover_tree_context = self.tree_context

    def _check_tree_support(self, target_model: nn.Module) -> None:
        """Refuse at start-up what tree verification cannot do right: an attention backend
        without the tree hook, a CPU KV layout our views do not read, full CUDA graphs; and
        build the CPU tree-attention kernel before serving (its build errors surface here)."""
        _check_tree_attention_backends(target_model)
        device = torch.device(self.device).type
        if device == "cpu":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            from vllm_clover.engine.tree_verify import check_cpu_kv_layout

            mc = self.vllm_config.model_config
            block_size = self.vllm_config.cache_config.block_size
            isa = _get_attn_isa(mc.dtype, block_size, mc.get_head_size(), self.vllm_config.cache_config.cache_dtype)
            check_cpu_kv_layout(isa, mc.dtype, mc.get_head_size(), block_size)
            from vllm_clover.kernels import tree_attention_cpu

            if tree_attention_cpu.enabled():
                tree_attention_cpu.load()  # compile now (first run: ~1 min), fail at start-up
        elif device == "cuda":
            mode = self.vllm_config.compilation_config.cudagraph_mode
            if mode is not None and mode.has_full_cudagraphs():
                # The tree hooks are Python around the attention call; a replayed full graph
                # would skip them and verify the tree rows with a causal mask.
                raise NotImplementedError(
                    "vllm-clover: tree verification on GPU needs --enforce-eager (or a "
                    f"cudagraph_mode without full graphs), got {mode.name}")

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose_clover(self, runner: Any, scheduler_output: Any, sampled_token_ids: list[list[int]],
                       sampling_metadata: Any, aux_hidden_states: list[Tensor] | None,
                       common_attn_metadata: Any, slot_mappings: Any,
                       tree_step: TreeStep | None = None) -> tuple[Tensor | list[list[int]], Tensor | None]:
        """One drafting step. Returns drafts [B, K] (long) and, when temperature>0 requests
        draft by sampling, their draft distributions [B, K, V] (float32), else None. In a
        tree step the drafts are per-request lists (tree nodes in BFS order, or a chain) and
        the distributions None. ``tree_step``: this step's verified trees (their accepted
        paths are the trunk's rows)."""
        t0 = time.perf_counter()
        if self.adaptive is not None:
            self.adaptive.begin(t0, runner.input_batch.req_ids, scheduler_output, sampled_token_ids)
        try:
            drafts, probs = self._propose(runner, scheduler_output, sampling_metadata, aux_hidden_states,
                                          common_attn_metadata, slot_mappings, tree_step)
            self.drafted = any(drafts) if isinstance(drafts, list) else drafts.numel() > 0
            return drafts, probs
        finally:
            if self._sync:
                torch.cuda.synchronize()
            spent = time.perf_counter() - t0
            self.timing["draft_s"] += spent
            self.timing["calls"] += 1
            if self.adaptive is not None:
                self.adaptive.end(t0, spent)

    def _propose(self, runner: Any, scheduler_output: Any, sampling_metadata: Any,
                 aux_hidden_states: list[Tensor] | None, common_attn_metadata: Any,
                 slot_mappings: Any, tree_step: TreeStep | None) -> tuple[Tensor | list[list[int]], Tensor | None]:
        if not aux_hidden_states:
            raise RuntimeError("vllm-clover: the target returned no aux hidden states")
        batch = runner.input_batch
        b = batch.num_reqs
        n = scheduler_output.total_num_scheduled_tokens
        x = aux_hidden_states[0][:n]
        k = min(scheduler_output.num_spec_tokens_to_schedule, self.num_speculative_tokens)
        if k <= 0:
            # Speculation is off for this batch size (disable_by_batch_size / vLLM's dynamic
            # schedule): skip the trunk too, so a large batch pays nothing for Clover. These
            # positions get no trunk KV; drafts made later over them attend to zeros or stale
            # entries there: lower acceptance for those requests, never a wrong output.
            self.tree_drafts = {}
            return torch.zeros((b, 0), dtype=torch.long, device=x.device), None
        if self.options.adaptive and not self._adaptive_plan(runner).on:
            # The adaptive tree (or chain) found no shape that beats plain decoding here: as above.
            self.tree_drafts = {}
            return torch.zeros((b, 0), dtype=torch.long, device=x.device), None
        positions = runner.positions[:n]
        input_ids = runner.input_ids.gpu[:n]
        cm = common_attn_metadata
        qsl = cm.query_start_loc_cpu[: b + 1]
        # Positions of the first scheduled rows (sync scheduling: exact on the host).
        first_positions = batch.num_computed_tokens_cpu_tensor[:b]
        view = trunk_view(tree_step, qsl.numpy(), b, cm.slot_mapping[:n])
        if view is not None:
            # After a tree step: only the accepted paths, as chains on contiguous slots.
            rows, qsl, slots = view
            rows_dev = rows.to(x.device)
            x, positions, input_ids = x[rows_dev], positions[rows_dev], input_ids[rows_dev]
            cm, slot_mappings = _chain_view_metadata(cm, qsl, slots, first_positions), None
            n = rows.numel()
        inputs = device_trunk_inputs(batch.token_ids_cpu_tensor, batch.num_tokens_no_spec_cpu_tensor,
                                     first_positions, qsl, input_ids, positions)
        z = self._run_trunk(runner, x, inputs.y, positions, cm, slot_mappings, n)
        z_last, first = z[inputs.last], inputs.first
        if self.tree is not None:
            drafted = self._draft_tree(runner, z_last, first, b, k, inputs.last_positions)
            if drafted is not None:
                return drafted, None
            k = self._chain_length(b, k)  # the batch is too large for a tree: a chain
        elif self.adaptive is not None:
            k = min(k, self.adaptive.shape.tree.max_depth)  # adaptive_chain: this step's chain
        self.tree_drafts = {}
        drafts, probs = self._draft(z_last, first, k, sampling_metadata, b)
        if self.adaptive is not None:
            chain, rows = self.adaptive.shape.tree, drafts.tolist()
            for i, req_id in enumerate(batch.req_ids):
                self.adaptive.remember(req_id, i, rows[i], chain, rows[i], 0)
        if self.records is not None:
            self._record(batch, inputs.last_positions, drafts.cpu())
        return drafts, probs

    def _chain_length(self, b: int, k: int) -> int:
        """Chain length when the batch's token budget has no room for a tree (adaptive: the
        step's tree is a chain without lookup tokens)."""
        if self.tree == ADAPTIVE:
            return max(1, min(k, self.adaptive.shape.tree.max_depth))
        depth = self.model.config.num_heads if self.tree == DYNAMIC else self.tree.max_depth
        return max(1, min(depth, k, self.options.tree_token_budget // b - 1))

    def _draft_tree(self, runner: Any, z_last: Tensor, first: Tensor, b: int, k: int,
                    last_positions: Tensor) -> list[list[int]] | None:
        """Draft this step's tree for every request (one batched head call per depth),
        or return None when the batch only has room for a chain (``select_tree`` /
        ``dynamic_budget``: B * (N + 1) <= tree_token_budget).

        Static trees take each head's top-k children over the draft vocabulary; the
        dynamic tree (Clover-1) keeps children by top-p / sibling ratio and ranks them by
        joint probability under a per-request node budget. Both are deterministic, so
        verification uses the one-hot rule. Requests that cannot be verified as a tree
        (``chain_only_reason``) get its top-1 spine as a chain. Returns one draft list per
        request and remembers each tree (``tree_drafts``). The draft log (``records``) gets
        the spine, which equals chain drafting of the same depth."""
        shape = self._tree_shape(b, k)
        if shape is None:
            return None
        tree, lookup, leaf = shape
        drafted, parents = self._expand_tree(z_last, first, tree, b)
        return self._request_drafts(runner, drafted, parents, lookup, leaf, last_positions)

    def _tree_shape(self, b: int, k: int) -> tuple[StaticTree | int, int, int] | None:
        """This step's tree (the static tree, or the dynamic tree's node budget per request)
        and the prompt-lookup and per-leaf lookup tokens that fit beside it; None when the
        step only has room for a chain and no lookup token (vLLM verifies that chain)."""
        token_budget = self.options.tree_token_budget
        lookup = self.options.prompt_lookup_tokens
        if self.tree == ADAPTIVE:
            shape = self.adaptive.shape
            tree = shape.tree if shape.tree is not None else _ROOT_ONLY
            if tree.num_nodes == tree.max_depth and not shape.lookup:
                return None  # a chain: vLLM verifies it as one
            return tree, min(shape.lookup, max(0, k - tree.num_nodes)), 0
        if self.tree == DYNAMIC:
            tree = budget = dynamic_budget(b, token_budget, max(1, min(k - lookup, self.options.dynamic_tree_nodes)))
            is_chain = budget <= 1
        else:
            tree = select_tree(self.tree, b, token_budget, max(1, k - lookup))
            budget, is_chain = tree.num_nodes, tree.num_nodes == tree.max_depth
        # Prompt lookup fills the verify tokens the tree leaves (lookup.py, tree first), then
        # the leaf lookups if all of them fit.
        room = min(k, token_budget // b - 1) - budget
        lookup = max(0, min(lookup, room))
        leaf = self.options.leaf_lookup_tokens if self.tree != DYNAMIC else 0
        if leaf and (not lookup or leaf * tree.retrieve_paths.shape[0] > room - lookup):
            leaf = 0
        if is_chain and not lookup:
            return None
        return tree, lookup, leaf

    def _expand_tree(self, z_last: Tensor, first: Tensor, tree: StaticTree | int,
                     b: int) -> tuple[list[list[int]], list[tuple[int, ...]]]:
        """The heads' tree of every request: node tokens (BFS order, root excluded) and
        parent pointers (root first). ``tree``: a static tree, or the dynamic tree's budget."""

        def head(state: Tensor, prev: Tensor, i: int) -> tuple[Tensor, Tensor]:
            state, o = self.model.head_step(state, prev, i)
            return state, self._draft_logits(o)

        if self.tree == DYNAMIC:
            dt = build_dynamic_tree(head, z_last, first, tree, self.model.config.num_heads,
                                    vocab_ids=self.draft_ids)
            counts = dt.buffers.num_nodes.tolist()
            parents = [tuple(p[:c]) for p, c in zip(dt.buffers.parent.tolist(), counts)]
            return [t[1:c] for t, c in zip(dt.tokens.tolist(), counts)], parents

        def topk(logits: Tensor, n: int) -> tuple[Tensor, None]:
            local = logits.topk(n, dim=-1).indices
            return (local if self.draft_ids is None else self.draft_ids[local]), None

        drafted = expand_static_tree(head, z_last, first, tree, topk).tokens[:, 1:].tolist()
        return drafted, [tuple(tree.parent.tolist())] * b

    def _request_drafts(self, runner: Any, drafted: list[list[int]], parents: list[tuple[int, ...]],
                        lookup: int, leaf: int, last_positions: Tensor) -> list[list[int]]:
        """Per request: its tree with the lookup tokens grafted in (remembered in
        ``tree_drafts``), or its spine where it must draft a chain."""
        batch = runner.input_batch
        table: dict[str, tuple[list[int], tuple[int, ...]]] = {}
        out, spines = [], []
        for i, (req_id, tokens, parent) in enumerate(zip(batch.req_ids, drafted, parents)):
            top1 = [tokens[n - 1] for n in spine(parent)]
            spines.append(top1)
            state = runner.requests.get(req_id)
            reason = chain_only_reason(getattr(state, "sampling_params", None))
            if reason is None:
                if lookup or self.records is not None:
                    # The committed tokens, the root (just sampled) last; a numpy view.
                    committed = batch.token_ids_cpu_tensor[i, : int(batch.num_tokens_no_spec_cpu_tensor[i])].numpy()
                heads_tokens = tokens
                if lookup:
                    tokens, parent = graft_retrieval(tokens, parent, committed, self._step_retrieval(i), lookup, leaf)
                table[req_id] = (tokens, parent)
                if self.adaptive is not None:
                    self.adaptive.remember(req_id, i, tokens, self.adaptive.shape.tree, heads_tokens, lookup)
                if self.records is not None:
                    self.tree_records.append((req_id, committed.tolist(), tokens, parent))
                out.append(tokens)
            else:
                logger.debug("vllm-clover: request %s drafts a chain (tree verification cannot do %s)",
                             req_id, reason)
                out.append(top1)
        self.tree_drafts = table
        if self.records is not None:
            depth = min(len(t) for t in spines)
            self._record(batch, last_positions, torch.tensor([t[:depth] for t in spines]))
        return out

    def _step_retrieval(self, i: int) -> Any:
        """The retrieval function for batch row ``i``: :meth:`_retrieve`, or with the adaptive
        tree the chain it looked up before choosing the step's shape."""
        if self.adaptive is None:
            return self._retrieve
        return lambda committed, k: np.asarray(self.adaptive.chain(i, k), dtype=np.int64)

    def _adaptive_plan(self, runner: Any) -> Any:
        """This step's :class:`adaptive.Shape`, from every request's retrieval chain (looked up
        here, before the choice) and the batch size."""
        if self.adaptive is None:
            raise RuntimeError("vllm-clover: the adaptive tree has no cost curve (patch "
                               "worker-calibrate-after-warm-up did not run)")
        batch = runner.input_batch
        ids = list(batch.req_ids)

        def committed(i: int) -> np.ndarray:
            return batch.token_ids_cpu_tensor[i, : int(batch.num_tokens_no_spec_cpu_tensor[i])].numpy()

        ok = [chain_only_reason(getattr(runner.requests.get(r), "sampling_params", None)) is None for r in ids]
        return self.adaptive.plan(ids, committed, ok, self._retrieve_with_source)

    def _retrieve_with_source(self, committed: np.ndarray, k: int) -> tuple[np.ndarray, str]:
        """:meth:`_retrieve` and where its tokens came from ("prompt" or "datastore")."""
        o = self.options
        chain = lookup_continuation(committed, o.prompt_lookup_min, o.prompt_lookup_max, k)
        if chain.size or self.datastore is None:
            return chain, "prompt"
        return self.datastore.continuation(committed, k, o.datastore_min_confidence), "datastore"

    @torch.inference_mode()
    def calibrate(self, runner: Any) -> None:
        """With the adaptive tree: the cost curve of this engine (measured now, or cached) and
        the chooser built on it (engine/calibration.py, engine/adaptive.py). Called after vLLM's
        warm-up (patch ``worker-calibrate-after-warm-up``)."""
        if not self.options.adaptive or self.adaptive is not None:
            return
        from vllm_clover.engine.adaptive import (CHAIN_RANKS, RANKS, AcceptanceStats, AdaptiveDrafting,
                                                 AdaptiveTree, heads_prior)
        from vllm_clover.engine.calibration import calibrate

        o = self.options
        curve = calibrate(runner, self)
        prior = heads_prior(o.checkpoint, self.model.config.num_heads, o.draft_vocab_size)
        if o.adaptive_chain:  # chains of up to K heads tokens, no lookup (verified by vLLM)
            nodes, lookup, ranks = min(self.num_speculative_tokens, self.model.config.num_heads), 0, CHAIN_RANKS
        else:
            nodes, lookup, ranks = o.adaptive_max_nodes, o.prompt_lookup_tokens, RANKS
        tree = AdaptiveTree(curve=curve, stats=AcceptanceStats(prior, lookup), max_nodes=nodes,
                            max_lookup=lookup, ranks=ranks)
        self.adaptive = AdaptiveDrafting(tree)

    def _retrieve(self, committed: np.ndarray, k: int) -> np.ndarray:
        """Up to ``k`` retrieval tokens after ``committed``: prompt lookup, else the datastore."""
        o = self.options
        return retrieval_chain(committed, k, o.prompt_lookup_min, o.prompt_lookup_max, self.datastore,
                               o.datastore_min_confidence)

    def _record(self, batch: Any, last_positions: Tensor, drafts: Tensor) -> None:
        """Log (req_id, committed tokens, drafts) for every request whose whole committed
        sequence has been through the trunk (partial prefills are skipped: the scheduler
        drops their drafts)."""
        num_tokens = batch.num_tokens_no_spec_cpu_tensor
        for i, req_id in enumerate(batch.req_ids):
            n = int(num_tokens[i])
            if int(last_positions[i]) == n - 2:
                self.records.append((req_id, batch.token_ids_cpu_tensor[i, :n].tolist(),
                                     drafts[i].tolist()))

    def _run_trunk(self, runner: Any, x: Tensor, y: Tensor, positions: Tensor, cm: Any,
                   slot_mappings: Any, n: int) -> Tensor:
        """Trunk over all n scheduled rows with paged attention on the Clover layers."""
        metadata = {}
        for groups in runner.attn_groups:
            for group in groups:
                mine = self._layer_names.intersection(group.layer_names)
                if not mine:
                    continue
                if group.kv_cache_group_id != 0:
                    # cm is built for KV-cache group 0 when the drafter is not EAGLE-like.
                    raise NotImplementedError(
                        "vllm-clover: Clover layers landed in KV-cache group "
                        f"{group.kv_cache_group_id}; only single-group targets are supported")
                built = group.build_metadata(cm)
                metadata.update(dict.fromkeys(mine, built))
        missing = self._layer_names - set(metadata)
        if missing:
            raise RuntimeError(f"vllm-clover: no attention group holds {sorted(missing)}")
        by_layer = slot_mappings if isinstance(slot_mappings, dict) else {}
        slots = {name: by_layer.get(name, cm.slot_mapping)[:n] for name in self._layer_names}
        with set_forward_context(metadata, self.vllm_config, num_tokens=n, slot_mapping=slots):
            return self.model.trunk(x, y, positions)

    def _draft(self, z_last: Tensor, first: Tensor, k: int, sampling_metadata: Any,
               b: int) -> tuple[Tensor, Tensor | None]:
        """Chain of k heads over all B requests at once (loop over heads only).

        Greedy requests (and every request with draft_sampling="greedy") take each head's
        argmax: one-hot drafts, which vLLM's rejection sampler handles exactly when no
        probabilities are given. With draft_sampling="sample" and any temperature>0
        request in the batch, those requests draw each draft from q = softmax(logits/T)
        and q is returned for the rejection sampler, which then accepts with min(1, p/q)
        and resamples from max(0, p-q): exactly the target distribution, higher acceptance
        than one-hot drafts when the heads are good.
        """
        sample = self.options.draft_sampling == "sample" and not sampling_metadata.all_greedy
        if sample:
            temp = sampling_metadata.temperature[:b].to(torch.float32)
            greedy = temp == GREEDY_TEMPERATURE
            inv_temp = torch.where(greedy, torch.ones_like(temp), temp).reciprocal().unsqueeze(1)
            generators = sampling_metadata.generators
        state, token = z_last, first
        tokens, probs = [], []
        for i in range(k):
            state, o = self.model.head_step(state, token, i)
            logits = self._draft_logits(o)  # [B, N] float32 (N = draft vocabulary size)
            local = logits.argmax(dim=-1)
            if sample:
                q = torch.softmax(logits * inv_temp, dim=-1)
                local = torch.where(greedy, local, _sample_rows(q, generators))
                probs.append(q)
            token = local if self.draft_ids is None else self.draft_ids[local]
            tokens.append(token)
        drafts = torch.stack(tokens, dim=1)
        if not sample:
            return drafts, None
        q = torch.stack(probs, dim=1)  # [B, K, N]
        if self.draft_ids is not None:  # vLLM wants [B, K, V]: zero outside the draft vocabulary
            full = q.new_zeros(*q.shape[:2], self.model.config.vocab_size)
            q = full.index_copy_(2, self.draft_ids, q)
        return drafts, q.contiguous()

    def _build_draft_lm_head(self, target_head: nn.Module, vocab_size: int) -> Any:
        """The draft LM-head product o [B, H] -> [B, N]. On vLLM's CPU build the drafter's
        ``nn.Linear``s and the draft-vocabulary rows are packed for the float32 kernel or oneDNN
        (cpu_linear.drafter_product) and the full vocabulary reuses the target's own packed LM
        head; elsewhere plain products. Under tensor parallelism each rank's product covers the
        rows it holds: the draft vocabulary's partial logits are summed over the ranks, the full
        vocabulary's gathered (vocab_parallel.py)."""
        aug_weights = self.model.take_aug_linear_weights()
        if not onednn_available():
            if self.draft_weight is None:
                return self.model.logits
            weight = self.draft_weight
            return self._summed_over_ranks(lambda o: torch.nn.functional.linear(o.to(weight.dtype), weight))
        # draft_dtype (cpu_linear.py): the products in bfloat16 halve the bytes drafting streams.
        # Without a reduced draft vocabulary the heads keep the target's own (float32) LM head.
        self.matmul_dtype = draft_matmul_dtype(self.options.draft_dtype, self.dtype)
        compute = None if self.matmul_dtype == self.dtype else self.matmul_dtype
        packed = pack_linears(self.model.drafter, compute)
        if compute is not None:
            packed += repack_vllm_linears(aug_weights, compute)
        draft_lm_head = None if self.draft_weight is None else drafter_product(self.draft_weight, compute_dtype=compute)
        logger.info("vllm-clover: drafter products in %s (draft_dtype=%s), %d linears repacked, draft LM head: %s",
                    str(self.matmul_dtype).removeprefix("torch."), self.options.draft_dtype, packed,
                    type(draft_lm_head).__name__ if draft_lm_head is not None else "the target's")
        if draft_lm_head is not None:
            return self._summed_over_ranks(draft_lm_head)
        method = getattr(target_head, "quant_method", None)
        if method is None or not hasattr(method, "apply"):
            return self.model.logits
        # ParallelLMHead pads its rows (and splits them over the ranks); gather_logits keeps the
        # real vocabulary, Clover's LM head.
        return lambda o: self.vocab.gather_logits(method.apply(target_head, o.to(target_head.weight.dtype)))

    def _summed_over_ranks(self, product: Any) -> Any:
        """``product`` (o -> this rank's partial draft logits) summed over the TP ranks."""
        if not self.vocab.sharded:
            return product
        return lambda o: self.vocab.reduce_draft_logits(product(o))

    def _draft_logits(self, o: Tensor) -> Tensor:
        """Head output o [B, H] -> float32 logits over the draft vocabulary [B, N] (N = V
        without a reduced draft vocabulary)."""
        return self._draft_lm_head(o).float()

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, **_: Any) -> None:
        """Heads on zero states (the trunk needs paged-attention metadata, so it is
        exercised by real steps only). vLLM 0.32 does not call this for medusa drafters."""
        if self.model is None or not self.model.drafter.bound:
            return
        rows = max(1, min(num_tokens, self.vllm_config.scheduler_config.max_num_seqs))
        state = torch.zeros((rows, self.hidden_size), dtype=self.dtype, device=self.device)
        token = torch.zeros(rows, dtype=torch.long, device=self.device)
        for i in range(self.model.config.num_heads):
            state, o = self.model.head_step(state, token, i)
            token = self._draft_logits(o).argmax(dim=-1)
            token = token if self.draft_ids is None else self.draft_ids[token]


def _check_tree_attention_backends(target_model: nn.Module) -> None:
    """Tree rows are only right where the tree-attention hook runs (patch
    ``attention-tree-rows``, vllm_clover/patches/runner.py): refuse any other backend at start-up, never verify wrong."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    for module in target_model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(module, Attention) and not isinstance(impl, (CPUAttentionBackendImpl, FlashAttentionImpl)):
            raise NotImplementedError(
                f"vllm-clover: tree verification supports the CPU and FLASH_ATTN attention backends; "
                f"{module.layer_name} uses {type(impl).__name__} (use --attention-backend FLASH_ATTN, "
                "or chain drafting)")


def _uses_flash_layout(target_model: nn.Module) -> bool:
    """Do the target's attention layers keep FlashAttention's KV layout (FLASH_ATTN, or the
    plugin's CUSTOM tree backend, whose impl is FlashAttention's)?"""
    from vllm.model_executor.layers.attention import Attention

    from vllm_clover.engine.attention_backend import FLASH_LAYOUT, kv_layout

    return any(isinstance(m, Attention) and kv_layout(m.impl) == FLASH_LAYOUT for m in target_model.modules())


def _chain_view_metadata(cm: Any, query_start_loc: Tensor, slots: Tensor, num_computed: Tensor) -> Any:
    """``cm`` restricted to the rows of a :func:`tree_verify.trunk_view` (query_start_loc
    [B+1] of the view, slots [M]; num_computed [B]: the requests' computed tokens before the
    step, on the host): each request's sequence ends at its last kept row."""
    num_computed = num_computed.long()
    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_lens = (num_computed + counts).to(torch.int32)
    dev = cm.seq_lens.device
    fields = dict(query_start_loc=query_start_loc.to(dev), query_start_loc_cpu=query_start_loc,
                  seq_lens=seq_lens.to(dev), num_actual_tokens=int(counts.sum()),
                  max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
                  slot_mapping=slots.to(cm.slot_mapping.device))
    if getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
        fields["seq_lens_cpu_upper_bound"] = seq_lens
    return dataclasses.replace(cm, **fields)


def _sample_rows(q: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """One token per row of q [B, V]; rows with a per-request generator (seeded
    requests) draw from it, so seeded outputs stay reproducible."""
    out = torch.multinomial(q, 1).squeeze(1)
    for row, gen in generators.items():
        if row < q.shape[0]:
            out[row] = torch.multinomial(q[row], 1, generator=gen)[0]
    return out
