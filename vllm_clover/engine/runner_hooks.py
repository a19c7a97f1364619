"""The wraps on vLLM's V1 ``GPUModelRunner`` (``CPUModelRunner`` inherits them).

Both act only when the engine runs a Clover checkpoint through the medusa slot
(``frontend.is_clover_vllm_config``); every other engine runs vLLM's code unchanged.

* ``__init__``: replace the ``MedusaProposer`` vLLM just built with a ``CloverProposer``
  and turn on aux hidden states, so the target also returns its pre-final-norm residual.
* ``propose_draft_token_ids``: vLLM's medusa branch hands the drafter one post-norm row
  per request; Clover needs the pre-norm rows of every scheduled token, the positions,
  the attention metadata and the committed tokens, so route to ``propose_clover`` and
  publish its draft probabilities through the runner's own contract
  (``_draft_probs`` / ``_draft_prob_req_ids``, read by ``_get_spec_decode_draft_probs``).
* ``_input_fits_in_drafter``: vLLM skips the drafter for the *whole batch* when any
  request is within K tokens of the drafter's max length (EAGLE drafts at positions past
  the sequence). Clover's trunk only runs at scheduled positions and the scheduler clips
  drafts at max_model_len, so Clover always drafts: otherwise the other requests' trunk
  KV for that step would never be written (stale entries, lower acceptance).
* ``sample_tokens``: works around a vLLM 0.32 CPU bug. For a seeded request in a partial
  prefill chunk, ``_bookkeeping_sync`` rewinds its generator with ``set_offset``, which
  CPU generators do not have ("CPU Generator does not use offset"): the engine dies (plain
  vLLM too; Clover's prefix-cache block drop makes such chunks more frequent). For Clover
  engines the generators of those rows are hidden for the step: their sampled token and
  drafts are discarded anyway, and the request's generator is left exactly as the rewind
  intends (untouched by the partial step).

Tree verification (Clover engines with the ``tree`` option; vllm_clover/engine/tree_verify.py):

* ``_prepare_inputs``: after vLLM computed the KV slots from sequential positions, tree rows
  get RoPE positions ``root + depth`` and the step's tree plan is published;
* the attention backends' ``forward`` (CPU_ATTN, FlashAttention): while a plan is active,
  the rows of tree requests are recomputed with their ancestor mask;
* ``runner.rejection_sampler`` (an attribute, set in ``__init__`` of every Clover engine):
  ``CloverRejectionSampler`` (also: vLLM's plain sampler on steps where nothing was drafted).

Plus one CPU kernel fix (process-wide, every engine): vLLM 0.32's C++ fallback for the
rejection sampler's ``expand_kernel`` casts its *output* to int64 and never copies the
result back, so the per-token temperatures / top-k / top-p of the verification rows are
uninitialised memory whenever a batch samples with temperature > 0: speculative decoding
with sampling is not lossless on CPU, for every method. :func:`expand_kernel_impl`
replaces it.

And one EngineCore-side wrap (``Scheduler.schedule`` + ``EngineCore.post_step``): after a
step scheduled with no drafts, the EngineCore of a Clover engine does not ask the worker
for drafts (patch ``engine-no-draft-fetch-when-drafting-off``).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

from vllm_clover.engine.frontend import is_clover_vllm_config
from vllm_clover.engine.metrics import SCHEDULER_DRAFTED

def wrap_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: Any, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, vllm_config, device, *args, **kwargs)
        if is_clover_vllm_config(vllm_config) and hasattr(self, "drafter"):
            from vllm_clover.engine.proposer import CloverProposer

            self.drafter = CloverProposer(vllm_config, device)
            self.use_aux_hidden_state_outputs = True
            from vllm_clover.engine.tree_verify import CloverRejectionSampler

            self.rejection_sampler = CloverRejectionSampler(
                self.rejection_sampler, functools.partial(target_kv_layers, vllm_config), self.drafter.tree_context)

    return __init__


def wrap_propose(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: Any, sample_hidden_states: Any,
                                aux_hidden_states: Any, spec_decode_metadata: Any,
                                common_attn_metadata: Any, slot_mappings: Any) -> Any:
        if not getattr(getattr(self, "drafter", None), "is_clover", False):
            return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                        sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                        common_attn_metadata, slot_mappings)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        # The target pass of this step is over: its tree plan goes to the drafter (accepted
        # paths) and must not reach the trunk's attention.
        tree_step = self.drafter.tree_context.take()
        drafts, probs = self.drafter.propose_clover(
            self, scheduler_output, sampled_token_ids, sampling_metadata, aux_hidden_states,
            common_attn_metadata, slot_mappings, tree_step)
        if probs is not None:
            self._draft_probs = probs
            self._draft_prob_req_ids = self.input_batch.req_ids.copy()
        return drafts

    return propose_draft_token_ids


def wrap_fits(orig: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(orig)
    def _input_fits_in_drafter(self: Any, common_attn_metadata: Any) -> bool:
        if getattr(getattr(self, "drafter", None), "is_clover", False):
            return common_attn_metadata is not None
        return orig(self, common_attn_metadata)

    return _input_fits_in_drafter


def wrap_sample_tokens(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        hidden = hide_discarded_cpu_generators(self)
        try:
            return orig(self, grammar_output)
        finally:
            if hidden:
                self.input_batch.generators.update(hidden)

    return sample_tokens


def wrap_prepare_inputs(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, scheduler_output, *args, **kwargs)
        if getattr(getattr(self, "drafter", None), "tree", None) is not None:
            from vllm_clover.engine.tree_verify import plan_tree_step

            self.drafter.tree_context.publish(plan_tree_step(self, scheduler_output))
        return result

    return _prepare_inputs


def wrap_tree_attention(orig: Callable[..., Any], skip_covered: bool = False) -> Callable[..., Any]:
    """Attention forward that recomputes the rows of this step's tree requests with their
    ancestor mask (``tree_attention_rows``) after the backend's causal kernel.

    ``skip_covered`` (CPU_ATTN): when tree rows are every row of the step (batch 1 with a
    tree: most of its steps), the causal kernel's output would be overwritten row for row,
    so it is not run (about 1.5 ms per step of the default model here). Sound only for a
    backend whose forward writes nothing but ``output`` (K/V are written before it,
    ``forward_includes_kv_cache_update`` is False: checked by the patch catalogue)."""

    @functools.wraps(orig)
    def forward(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                attn_metadata: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_clover.engine.tree_verify import tree_attention_rows

        context = getattr(layer, "clover_tree_context", None)  # bound by CloverProposer.load_model
        step = None if context is None else context.step
        if (step is None or attn_metadata is None or attn_metadata.num_actual_tokens != step.num_tokens
                or getattr(layer, "clover_trunk", False) or self.attn_type != "decoder"):
            return orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        result = output
        # Extra arguments (output_scale, output_block_scale: fused output quantisation, which
        # the backend refuses) go to the backend, never skipped.
        extras = any(a is not None for a in (*args, *kwargs.values()))
        if not (skip_covered and step.covers_all_rows) or extras:
            result = orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        tree_attention_rows(self, query, kv_cache, attn_metadata, output, step, getattr(layer, "isa", "vec"))
        return result

    return forward


def target_kv_layers(vllm_config: Any) -> list[tuple[Any, Any, str | None]]:
    """(attention impl, kv_cache, CPU attention ISA or None) of every target attention layer
    (Clover's trunk excluded). The ISA (``layer.isa``, set by CPU_ATTN's metadata builder)
    fixes the CPU cache layout."""
    from vllm.model_executor.layers.attention import Attention

    layers = vllm_config.compilation_config.static_forward_context.values()
    return [(m.impl, m.kv_cache, getattr(m, "isa", None)) for m in layers
            if isinstance(m, Attention) and not getattr(m, "clover_trunk", False) and m.kv_cache.numel()]


def hide_discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Pop (and return) the CPU generators of rows whose sampled token this step will
    discard (partial prefills), for Clover engines; the sampler's metadata holds the same
    dict, so those rows sample from the global RNG for this step."""
    if not getattr(getattr(runner, "drafter", None), "is_clover", False):
        return {}
    if getattr(runner, "execute_model_state", None) is None:
        return {}
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discard = runner.discard_request_mask.np[:num_reqs]
    rows = [i for i, gen in generators.items()
            if i < num_reqs and discard[i] and gen.device.type == "cpu"]
    return {i: generators.pop(i) for i in rows}


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any,
                       replace_to: Any, MAX_NUM_TOKENS: Any = None) -> None:  # noqa: N803 (kernel arg)
    """CPU ``expand_kernel``: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to),
    in the output's own dtype (float temperatures / top-p, int top-k)."""
    import torch

    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device),
                         input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))




# ============================================================================ EngineCore side
# vLLM 0.32's EngineCore fetches drafts with one more RPC to the worker after every step of
# a speculative engine without async scheduling (``EngineCore.post_step`` ->
# ``take_draft_token_ids``), also after steps scheduled with no drafts (drafting off at
# this batch size: Clover's ``disable_by_batch_size`` is vLLM's dynamic schedule). Those
# steps' drafts are empty, and the scheduler already cleared every scheduled request's
# ``spec_token_ids``, so the RPC changes nothing; skipping it saves ~1 ms per step here
# (0.92-1.20 ms at batch 32 against 0.05 ms for a post_step without it, measured in the
# EngineCore on this 2-core CPU), where vanilla's engine makes two RPCs a step.
#
# The same holds after a step scheduled with drafts whose proposer drafted nothing (the adaptive
# tree or chain chose no speculation at this batch): the worker marks its ModelRunnerOutput and
# the scheduler records the mark (engine/metrics.py, the step report of patch
# spec-decode-metrics-by-tree-depth, which wraps both ends already), and post_step skips the fetch.
_LAST_K = "clover_num_spec_tokens_scheduled"


def wrap_schedule(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        setattr(self, _LAST_K, out.num_spec_tokens_to_schedule)
        return out

    return schedule


def wrap_post_step(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def post_step(self: Any, model_executed: bool) -> None:
        # Only one batch in flight (no batch queue): the last schedule is the step just run.
        if (self.batch_queue is None and is_clover_vllm_config(self.vllm_config)
                and (getattr(self.scheduler, _LAST_K, None) == 0
                     or getattr(self.scheduler, SCHEDULER_DRAFTED, True) is False)):
            return
        orig(self, model_executed)

    return post_step




class CloverWorkerExtension:
    """Worker mixin for ``worker_extension_cls`` (``LLM(..., worker_extension_cls=
    "vllm_clover.engine.runner_hooks.CloverWorkerExtension")``), reached with
    ``llm.collective_rpc("clover_...")``: no insecure serialization needed.

    Used by the tests to compare the drafts vLLM's Clover proposer made with the
    pure-PyTorch reference; handy for debugging a checkpoint too.
    """

    def _clover_drafter(self) -> Any:
        drafter = getattr(getattr(self, "model_runner", None), "drafter", None)
        if not getattr(drafter, "is_clover", False):
            raise RuntimeError("vllm-clover: this engine runs no Clover drafter")
        return drafter

    def clover_record_drafts(self, enable: bool = True) -> bool:
        """Start (clearing the log) or stop logging every drafting step."""
        drafter = self._clover_drafter()
        drafter.records, drafter.tree_records = ([] if enable else None), []
        return enable

    def clover_take_drafts(self) -> list[tuple[str, list[int], list[int]]]:
        """Return and clear the log: (request id, committed token ids, drafts) per
        request and step, for requests whose whole committed sequence was processed."""
        drafter = self._clover_drafter()
        records = drafter.records or []
        if drafter.records is not None:
            drafter.records = []
        return records

    def clover_take_tree_drafts(self) -> list[tuple[str, list[int], list[int], tuple[int, ...]]]:
        """Return and clear the tree log (while drafts are recorded): (request id,
        committed token ids, node tokens in BFS order, parent pointers) per tree request
        and step, prompt-lookup branches included."""
        drafter = self._clover_drafter()
        records, drafter.tree_records = drafter.tree_records, []
        return records

    def clover_drafter_info(self) -> dict[str, str]:
        """How this drafter runs: ``matmul_dtype``, the dtype of its packed products on CPU
        (the draft_dtype option resolved; the model's dtype elsewhere)."""
        return {"matmul_dtype": str(self._clover_drafter().matmul_dtype).removeprefix("torch.")}

    def clover_adaptive_force(self, shapes: list[tuple[int, int]]) -> int:
        """With the adaptive tree: draft (heads nodes, lookup tokens) ``shapes[s % len]`` at
        step s instead of the chosen shape ((0, 0): no drafts); [] returns to choosing. For
        tests that change the shape between steps. Returns the number of shapes set."""
        adaptive = self._clover_drafter().adaptive
        if adaptive is None:
            raise RuntimeError("vllm-clover: this engine does not run the adaptive tree")
        adaptive.tree.forced = [(int(n), int(k)) for n, k in shapes]
        return len(adaptive.tree.forced)

    def clover_adaptive_state(self) -> dict:
        """With the adaptive tree: its cost curve (as stored in the calibration cache), the
        current acceptance estimates and the learnt overheads (for reports and tests)."""
        adaptive = self._clover_drafter().adaptive
        if adaptive is None:
            raise RuntimeError("vllm-clover: this engine does not run the adaptive tree")
        tree = adaptive.tree
        return {"curve": json.loads(tree.curve.to_json()), "head_rates": tree.stats.head_rates().tolist(),
                "lookup_rates": {s: tree.stats.lookup_rates(s).tolist() for s in tree.stats.lookup_trials},
                "plain_overhead_ms": {str(b): v for b, v in sorted(tree.clock.plain_ms.items())},
                "row_overhead_ms": {str(b): v for b, v in sorted(tree.clock.row_ms.items())},
                "draft_ratio": tree.clock.draft_ratio, "steps": tree.steps,
                "chosen": [[b, n, k, c] for (b, n, k), c in sorted(tree.chosen.items())]}

    def clover_timing(self, reset: bool = True) -> dict[str, float]:
        """Seconds spent in Clover drafting (trunk + heads) and the number of drafting
        calls since the last reset (vllm_clover/benchmarks/bench.py: draft cost per step)."""
        drafter = self._clover_drafter()
        timing = dict(drafter.timing)
        if reset:
            drafter.timing = {"draft_s": 0.0, "calls": 0}
        return timing
