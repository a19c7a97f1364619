"""Model-runner and EngineCore patches: the Clover proposer, its inputs, tree verification and
the draft fetch. The wrapper bodies live in vllm_clover/engine/runner_hooks.py (tree attention:
vllm_clover/engine/tree_verify.py)."""

from __future__ import annotations

import functools

from vllm_clover.patches.patching import Patch, params, source, wrap

PROPOSER_UPSTREAM = "vllm-project/vllm#36219 (RFC: a unified proposer interface and registry)"
TREE_UPSTREAM = "vllm-project/vllm#18327 (tree attention for speculative decoding)"


def _runner() -> type:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


# ------------------------------------------------------------------ runner __init__
def install_init() -> None:
    from vllm_clover.engine import runner_hooks

    wrap(_runner(), "__init__", runner_hooks.wrap_init, RUNNER_INIT)


def check_init() -> None:
    from vllm.v1.spec_decode.medusa import MedusaProposer
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner)
    assert params(GPUModelRunner.__init__)[:3] == ["self", "vllm_config", "device"]
    src = source(GPUModelRunner.__init__)
    assert "MedusaProposer(" in src and "use_aux_hidden_state_outputs" in src
    assert params(MedusaProposer.__init__) == ["self", "vllm_config", "device"]
    assert params(MedusaProposer.load_model) == ["self", "target_model"]
    for name in ("load_model", "_setup_eagle3_aux_hidden_state_outputs", "_get_eagle3_aux_layers_from_config"):
        assert callable(getattr(GPUModelRunner, name)), name
    assert "eagle_aux_hidden_state_layer_ids" in source(GPUModelRunner._get_eagle3_aux_layers_from_config)
    check_runner_choice()
    # The CPU runner loads the drafter before setting up aux hidden states.
    cpu_load = source(CPUModelRunner.load_model)
    assert cpu_load.index("drafter.load_model") < cpu_load.index("_setup_eagle3_aux_hidden_state_outputs")


def check_runner_choice() -> None:
    """The patches wrap the V1 ``GPUModelRunner``: vLLM must keep choosing it for the medusa
    slot. ``VllmConfig.use_v2_model_runner`` (config/vllm.py) takes V2 only when
    ``VLLM_USE_V2_MODEL_RUNNER`` forces it (the front end refuses that) or no V2-unsupported
    feature is listed, and medusa is one; both workers build the runner by that property."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    choice = source(VllmConfig.use_v2_model_runner.fget)
    assert "envs.VLLM_USE_V2_MODEL_RUNNER" in choice
    assert "self._get_v2_model_runner_unsupported_features()" in choice and "return False" in choice
    unsupported = source(VllmConfig._get_v2_model_runner_unsupported_features)
    assert '"medusa"' in unsupported and "speculative_config.method in (" in unsupported
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in source(Worker.__init__)
    cpu_init = source(CPUWorker.init_device)
    assert "if self.use_v2_model_runner:" in cpu_init and "CPUModelRunner(self.vllm_config" in cpu_init


def check_sync_scheduling() -> None:
    """Drafts reach the scheduler through ``EngineCore.post_step`` only without async
    scheduling, which the proposer and the draft-fetch patch rely on. vLLM turns async
    scheduling off for medusa (``VllmConfig.__post_init__``: only EAGLE/MTP, n-gram GPU,
    draft-model, DSpark and DFlash methods keep it; an explicit request is an error), and the
    CPU platform always does."""
    from typing import get_args

    from vllm.config import VllmConfig
    from vllm.config.speculative import EagleModelTypes, NgramGPUTypes
    from vllm.platforms.cpu import CpuPlatform

    assert "medusa" not in get_args(EagleModelTypes) + get_args(NgramGPUTypes)
    post_init = source(VllmConfig.__post_init__)
    rule = post_init[post_init.index("elif self.scheduler_config.async_scheduling is None:"):]
    method = rule.index("self.speculative_config.method not in get_args(EagleModelTypes)")
    warned = rule.index("Async scheduling not supported with", method)
    assert rule.index("self.scheduler_config.async_scheduling = False", warned) < rule.index("elif", warned)
    assert "only supported" in post_init[post_init.index("if self.scheduler_config.async_scheduling:"):]
    assert "scheduler_config.async_scheduling = False" in source(CpuPlatform.check_and_update_config)


RUNNER_INIT = Patch(
    name="runner-init-clover-proposer",
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__ (inherited by CPUModelRunner)",
    why=("For a Clover checkpoint in the medusa slot, replaces the MedusaProposer with CloverProposer "
         "(a subclass, so vLLM's isinstance checks hold) and turns on aux hidden states, so the "
         "target also returns its pre-norm residual."),
    upstream=PROPOSER_UPSTREAM,
    remove_when="vLLM can build a plugin-provided proposer with aux hidden states",
    apply=install_init,
    check=check_init,
)


# ------------------------------------------------------------------ propose
def install_propose() -> None:
    from vllm_clover.engine import runner_hooks

    wrap(_runner(), "propose_draft_token_ids", runner_hooks.wrap_propose, RUNNER_PROPOSE)


def check_propose() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    assert params(GPUModelRunner.propose_draft_token_ids) == [
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
        "common_attn_metadata", "slot_mappings"]
    probs = source(GPUModelRunner._get_spec_decode_draft_probs)
    assert "self._draft_probs" in probs and "self._draft_prob_req_ids" in probs
    assert params(AttentionGroup.build_metadata)[:2] == ["self", "common_attn_metadata"]
    assert {"layer_names", "kv_cache_group_id"} <= set(AttentionGroup.__dataclass_fields__)
    init = source(InputBatch.__init__)
    assert "self.token_ids_cpu_tensor" in init and "self.num_tokens_no_spec_cpu_tensor" in init


RUNNER_PROPOSE = Patch(
    name="runner-propose-clover",
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids",
    why=("vLLM's medusa branch passes one post-norm row per request, while Clover's trunk needs the "
         "pre-norm rows of every scheduled token, positions, attention metadata and committed tokens; "
         "routes Clover drafters to CloverProposer.propose_clover and publishes their draft "
         "probabilities through the runner's _draft_probs / _draft_prob_req_ids."),
    upstream=PROPOSER_UPSTREAM,
    remove_when="vLLM passes full target state to plugin proposers",
    apply=install_propose,
    check=check_propose,
)


# ------------------------------------------------------------------ input fits in drafter
def install_fits() -> None:
    from vllm_clover.engine import runner_hooks

    wrap(_runner(), "_input_fits_in_drafter", runner_hooks.wrap_fits, RUNNER_FITS)


def check_fits() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner._input_fits_in_drafter) == ["self", "common_attn_metadata"]
    src = source(GPUModelRunner.sample_tokens)
    assert "self._input_fits_in_drafter(" in src and "if input_fits_in_drafter:" in src
    # Drafts near max_model_len are clipped by the scheduler, whatever the drafter proposes.
    assert "self.max_model_len" in source(Scheduler.schedule)


RUNNER_FITS = Patch(
    name="runner-clover-always-drafts",
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._input_fits_in_drafter",
    why=("vLLM skips the drafter for the whole batch once any request is within K tokens of "
         "max_model_len; Clover's trunk runs only at scheduled positions and the scheduler clips "
         "drafts, so Clover engines always draft (else that step's trunk KV stays unwritten)."),
    upstream="none known",
    remove_when="vLLM asks the proposer whether it needs positions past the sequence",
    apply=install_fits,
    check=check_fits,
)


# ------------------------------------------------------------------ tree positions and sampler
def install_prepare_inputs() -> None:
    from vllm_clover.engine import runner_hooks

    wrap(_runner(), "_prepare_inputs", runner_hooks.wrap_prepare_inputs, TREE_PREPARE_INPUTS)


def check_prepare_inputs() -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner._prepare_inputs)[:2] == ["self", "scheduler_output"]
    src = source(GPUModelRunner._prepare_inputs)
    # Slots are computed from the sequential positions inside _prepare_inputs, so positions
    # overwritten afterwards change RoPE only (each tree node keeps its own slot).
    assert src.index("self.positions[:total_num_scheduled_tokens] = (") < src.index("compute_slot_mapping(")
    assert "slot_mapping" in source(BlockTable.__init__)
    # The rejection sampler is a plain attribute, called as (metadata, draft_probs, logits, sm).
    assert "self.rejection_sampler = RejectionSampler(" in source(GPUModelRunner.__init__)
    assert "self.rejection_sampler(" in source(GPUModelRunner._sample)
    # Steps with no drafts go to the rejection sampler's own plain sampler (logits, sm).
    assert "self.sampler = sampler" in source(RejectionSampler.__init__)
    assert params(Sampler.forward)[:3] == ["self", "logits", "sampling_metadata"]
    assert {"draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
            "target_logits_indices", "bonus_logits_indices", "logits_indices"} == \
        set(SpecDecodeMetadata.__dataclass_fields__)
    # Drafts may be returned as per-request lists (variable length).
    assert "isinstance(self._draft_token_ids, list)" in source(GPUModelRunner._get_draft_token_ids_cpu)


TREE_PREPARE_INPUTS = Patch(
    name="runner-tree-positions-and-sampler",
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs (+ runner.rejection_sampler)",
    why=("Tree verification: after vLLM computed the KV slots from sequential positions, tree rows get "
         "RoPE positions root + depth and the step's tree plan is published for the attention hook and "
         "the CloverRejectionSampler (runner.rejection_sampler of every Clover engine), which accepts a "
         "path, compacts its KV and hands vLLM's sampler a chain (docs/tree-verification.md)."),
    upstream=TREE_UPSTREAM,
    remove_when="vLLM verifies token trees itself",
    apply=install_prepare_inputs,
    check=check_prepare_inputs,
)


# ------------------------------------------------------------------ tree attention
def install_tree_attention() -> None:
    """The tree-rows hook on the attention backends tree verification supports: CPU_ATTN,
    and FlashAttention on GPU builds (same forward signature; its module imports on CPU too)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from vllm_clover.engine import runner_hooks

    wrap(CPUAttentionBackendImpl, "forward",
         functools.partial(runner_hooks.wrap_tree_attention, skip_covered=True), TREE_ATTENTION)
    wrap(FlashAttentionImpl, "forward", runner_hooks.wrap_tree_attention, TREE_ATTENTION)


def check_tree_attention() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    for impl in (CPUAttentionBackendImpl, FlashAttentionImpl):
        assert params(impl.forward)[:8] == [
            "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
        assert {"num_heads", "head_size", "scale"} <= set(source(impl.__init__).replace("self.", " ").split())
    # K/V are written before forward (do_kv_cache_update), and the layouts our views read.
    assert CPUAttentionBackend.forward_includes_kv_cache_update is False
    src = source(CPUAttentionBackendImpl.forward)
    assert "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in src
    assert "kv_cache.chunk(2, dim=2)" in src
    fa = source(FlashAttentionImpl.forward)
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in fa
    assert "block_table = attn_metadata.block_table" in fa


TREE_ATTENTION = Patch(
    name="attention-tree-rows",
    target=("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward and "
            "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward"),
    why=("vLLM's CPU and FlashAttention kernels know only causal masks: while a tree plan is active "
         "(the target pass of a tree step), the rows of tree requests are recomputed with their "
         "ancestor mask over the paged KV (tree_verify.tree_attention_rows). A no-op in every engine "
         "without a tree plan."),
    upstream=TREE_UPSTREAM,
    remove_when="vLLM's CPU attention takes arbitrary masks, or vLLM verifies trees itself",
    apply=install_tree_attention,
    check=check_tree_attention,
)


# ------------------------------------------------------------------ tree backend (CUSTOM)
def install_custom_backend() -> None:
    from vllm_clover.engine.attention_backend import register_custom_backend

    register_custom_backend()


def check_custom_backend() -> None:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    assert params(register_backend)[:2] == ["backend", "class_path"]
    assert AttentionBackendEnum.CUSTOM.name == "CUSTOM"
    # The backend is resolved by class path (our module's __getattr__ defines the class).
    assert "resolve_obj_by_qualname(self.get_path())" in source(AttentionBackendEnum.get_class)
    assert params(FlashAttentionMetadataBuilder.build) == ["self", "common_prefix_len", "common_attn_metadata",
                                                           "fast_build"]
    assert "return FlashAttentionMetadataBuilder" in source(FlashAttentionBackend.get_builder_cls)
    assert "return FlashAttentionImpl" in source(FlashAttentionBackend.get_impl_cls)


CUSTOM_BACKEND = Patch(
    name="tree-attention-custom-backend",
    target="vllm.v1.attention.backends.registry.AttentionBackendEnum.CUSTOM (register_backend, public API)",
    why=("Registers CloverTreeAttentionBackend, FlashAttention's backend whose metadata builder attaches the "
         "step's tree metadata (persistent device buffers) to FlashAttention's metadata; the front end "
         "selects it for trees on a GPU when no backend is chosen (vllm_clover/engine/attention_backend.py)."),
    upstream=TREE_UPSTREAM,
    remove_when="vLLM verifies token trees itself",
    apply=install_custom_backend,
    check=check_custom_backend,
)


# ------------------------------------------------------------------ seeded partial prefills
def install_sample_tokens() -> None:
    from vllm_clover.engine import runner_hooks

    wrap(_runner(), "sample_tokens", runner_hooks.wrap_sample_tokens, SAMPLE_TOKENS)


def check_sample_tokens() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner.sample_tokens) == ["self", "grammar_output"]
    book = source(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in book
    assert "self.input_batch.generators.get(int(i))" in book and "set_offset" in book
    # The sampler reads the very same dict (popping hides a row from it too).
    assert "generators=self.generators" in source(InputBatch._make_sampling_metadata)
    assert "execute_model_state" in source(GPUModelRunner.sample_tokens)


SAMPLE_TOKENS = Patch(
    name="runner-cpu-seeded-partial-prefill",
    target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens",
    why=("vLLM bug on CPU: a seeded request in a partial prefill chunk kills the engine ('CPU Generator "
         "does not use offset' in _bookkeeping_sync's generator rewind). For Clover engines the CPU "
         "generators of such rows are hidden during the step, whose samples and drafts are discarded."),
    upstream="none known (the rewind is CUDA-specific since vllm-project/vllm#10097)",
    remove_when="vLLM's generator rewind supports CPU generators",
    apply=install_sample_tokens,
    check=check_sample_tokens,
)


# ------------------------------------------------------------------ EngineCore draft fetch
def install_engine_draft_fetch() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from vllm_clover.engine import runner_hooks

    wrap(Scheduler, "schedule", runner_hooks.wrap_schedule, ENGINE_DRAFT_FETCH)
    wrap(EngineCore, "post_step", runner_hooks.wrap_post_step, ENGINE_DRAFT_FETCH)


def check_engine_draft_fetch() -> None:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    assert params(EngineCore.post_step) == ["self", "model_executed"]
    post = source(EngineCore.post_step)
    assert "self.model_executor.take_draft_token_ids()" in post and "not self.async_scheduling" in post
    assert "num_spec_tokens_to_schedule" in SchedulerOutput.__dataclass_fields__
    sched = source(Scheduler.schedule)
    # Scheduled requests lose their drafts at scheduling; K comes from the dynamic schedule.
    assert "request.spec_token_ids = []" in sched and "self.dynamic_sd_lookup[" in sched
    # post_step follows the step it belongs to only without a batch queue.
    assert "self.batch_queue = deque(" in source(EngineCore.__init__)
    assert "self.post_step(model_executed)" in source(EngineCoreProc._process_engine_step)
    check_sync_scheduling()


ENGINE_DRAFT_FETCH = Patch(
    name="engine-no-draft-fetch-when-drafting-off",
    target="vllm.v1.engine.core.EngineCore.post_step (+ vllm.v1.core.sched.scheduler.Scheduler.schedule)",
    why=("In the EngineCore of a Clover engine, after a step scheduled with no drafts "
         "(disable_by_batch_size reached) or whose proposer drafted nothing (the adaptive choice was no "
         "speculation: the mark of spec-decode-metrics-by-tree-depth's step report), skips the "
         "take_draft_token_ids RPC vLLM makes after every speculative step: its drafts are empty and "
         "already cleared (docs/design-proposer.md)."),
    upstream="none known",
    remove_when="vLLM skips the draft fetch itself when the dynamic schedule gives K = 0",
    apply=install_engine_draft_fetch,
    check=check_engine_draft_fetch,
)


# ------------------------------------------------------------------ calibration after warm-up
def _workers() -> list[type]:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return [Worker, CPUWorker]


def install_calibrate() -> None:
    from vllm_clover.engine.calibration import wrap_compile_or_warm_up

    for worker in _workers():
        wrap(worker, "compile_or_warm_up_model", wrap_compile_or_warm_up, CALIBRATE)


def check_calibrate() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for worker in _workers():
        assert "compile_or_warm_up_model" in vars(worker), worker
        assert params(worker.compile_or_warm_up_model) == ["self"], worker
    dummy = params(GPUModelRunner._dummy_run)
    assert dummy[:2] == ["self", "num_tokens"], dummy
    # calibration.measure times the first output (every row's hidden state) through compute_logits.
    assert "return hidden_states, hidden_states[logit_indices_device]" in source(GPUModelRunner._dummy_run)
    from vllm.v1.core.sched.output import SchedulerOutput

    assert {"scheduled_spec_decode_tokens", "total_num_scheduled_tokens"} <= set(SchedulerOutput.__dataclass_fields__)


CALIBRATE = Patch(
    name="worker-calibrate-after-warm-up",
    target="vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model, "
           "vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model",
    why=("After vLLM's warm-up, a Clover drafter with the adaptive tree times the target over 1-128 "
         "verify tokens and its own head step and trunk (a few seconds, cached per model, dtype, "
         "machine and vLLM version), the costs the tree is chosen from at every step."),
    remove_when="vLLM has a start-up hook for proposers (or speculation that prices its own rows)",
    apply=install_calibrate,
    check=check_calibrate,
)
