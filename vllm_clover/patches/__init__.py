"""Every place where vllm-clover touches vLLM, in one catalogue.

House rule (after ArcticInference): one thin entry point (``plugin.register``) applies the
patches listed here; each entry says what it changes, why, and when it can be removed;
``tests/unit/patches/test_patches.py`` checks each target still exists with the expected shape in the
installed vLLM, so an upgrade fails loudly instead of silently misbehaving.

A patch is applied at most once per process (``apply_all`` is idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # dotted path of the vLLM object touched ("" if none)
    why: str
    remove_when: str
    apply: Callable[[], None]
    # Raises AssertionError if the vLLM target no longer has the shape the patch relies
    # on (run by tests/unit/patches/test_patches.py without applying anything).
    check: Callable[[], None] | None = None


def _install_dist_alias() -> None:
    import vllm_clover_dist_alias

    vllm_clover_dist_alias.install()


def _params(obj: object) -> list[str]:
    import inspect

    return list(inspect.signature(obj).parameters)


def _register_model() -> None:
    from vllm import ModelRegistry

    from vllm_clover.model.config import ARCHITECTURE

    # Lazy "module:Class" string: no torch-heavy import in processes that never build it.
    ModelRegistry.register_model(ARCHITECTURE, "vllm_clover.engine.vllm_model:CloverForSpeculativeDecoding")


def _check_register_model() -> None:
    from vllm import ModelRegistry

    assert _params(ModelRegistry.register_model)[:2] == ["model_arch", "model_cls"]


def _install_cli_flags() -> None:
    from vllm_clover.engine import frontend
    frontend.install_cli_flags()


def _check_cli_flags() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    assert isinstance(EngineArgs.__dict__["add_cli_args"], staticmethod)
    assert _params(EngineArgs.add_cli_args) == ["parser"]
    # Our flags reuse these dests; vLLM must still read them in create_speculative_config.
    fields = EngineArgs.__dataclass_fields__
    assert {"spec_model", "spec_tokens", "spec_method", "speculative_config", "additional_config"} <= set(fields)
    assert "load_general_plugins()" in _source(AsyncEngineArgs.add_cli_args)


def _install_translation() -> None:
    from vllm_clover.engine import frontend
    frontend.install_translation()


def _check_translation() -> None:
    import typing

    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.configs.medusa import MedusaConfig

    fn = getattr(EngineArgs.create_speculative_config, "__wrapped__", EngineArgs.create_speculative_config)
    assert _params(fn) == ["self", "target_model_config", "target_parallel_config"]
    assert "medusa" in typing.get_args(SpeculativeConfig.__dataclass_fields__["method"].type) or \
        "medusa" in str(SpeculativeConfig.__dataclass_fields__["method"].type)
    # MedusaConfig keeps "architectures" (our registered class resolves), renames top-level
    # num*heads / num*layers keys (why our config.json nests the rest), and maps
    # num_lookahead_tokens onto num_heads (so vLLM sets num_heads = K).
    cfg = MedusaConfig(hidden_size=8, vocab_size=16, num_heads=3, architectures=["X"], clover={"a": 1})
    assert cfg.architectures == ["X"] and cfg.to_dict()["clover"] == {"a": 1}
    cfg.num_lookahead_tokens = 2
    assert cfg.num_heads == 2
    src = _source(MedusaConfig.from_pretrained)
    assert '"num" in k' in src and 'config_dict["num_heads"]' in src


def _install_block_drop() -> None:
    from vllm_clover.engine import frontend
    frontend.install_block_drop()


def _check_block_drop() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler

    assert _params(SpeculativeConfig.use_eagle_block_drop) == ["self"]
    assert "disable_eagle_block_drop" in SpeculativeConfig.__dataclass_fields__
    sched = _source(Scheduler.__init__)
    assert "speculative_config.use_eagle_block_drop()" in sched
    assert "use_eagle=self.use_eagle_block_drop" in sched
    # With no KV-cache group flagged as EAGLE's, every group gets the drop (ours share
    # the target's group 0).
    assert "if use_eagle and not self.eagle_group_ids" in _source(KVCacheCoordinator.__init__)


def _install_serve_errors() -> None:
    from vllm_clover.engine import frontend
    frontend.install_serve_errors()


def _check_serve_errors() -> None:
    import importlib

    module = importlib.import_module("vllm.entrypoints.cli.serve")
    cls = module.ServeSubcommand
    assert isinstance(cls.__dict__["cmd"], staticmethod)
    assert _params(cls.cmd) == ["args"]
    # main() imports every command module before building parsers (which load plugins)
    # and reads dispatch_function=cmd.cmd after subparser_init, i.e. after our wrap.
    main_src = _source(importlib.import_module("vllm.entrypoints.cli.main").main)
    assert "import vllm.entrypoints.cli.serve" in main_src
    assert "cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)" in main_src


def _install_runner_init() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_init()


def _check_runner_init() -> None:
    from vllm.v1.spec_decode.medusa import MedusaProposer
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner)
    assert _params(GPUModelRunner.__init__)[:3] == ["self", "vllm_config", "device"]
    src = _source(GPUModelRunner.__init__)
    assert "MedusaProposer(" in src and "use_aux_hidden_state_outputs" in src
    assert _params(MedusaProposer.__init__) == ["self", "vllm_config", "device"]
    assert _params(MedusaProposer.load_model) == ["self", "target_model"]
    for name in ("load_model", "_setup_eagle3_aux_hidden_state_outputs", "_get_eagle3_aux_layers_from_config"):
        assert callable(getattr(GPUModelRunner, name)), name
    assert "eagle_aux_hidden_state_layer_ids" in _source(GPUModelRunner._get_eagle3_aux_layers_from_config)
    # The CPU runner loads the drafter before setting up aux hidden states.
    cpu_load = _source(CPUModelRunner.load_model)
    assert cpu_load.index("drafter.load_model") < cpu_load.index("_setup_eagle3_aux_hidden_state_outputs")


def _install_runner_propose() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_propose()


def _check_runner_propose() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    assert _params(GPUModelRunner.propose_draft_token_ids) == [
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
        "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
        "common_attn_metadata", "slot_mappings"]
    probs = _source(GPUModelRunner._get_spec_decode_draft_probs)
    assert "self._draft_probs" in probs and "self._draft_prob_req_ids" in probs
    assert _params(AttentionGroup.build_metadata)[:2] == ["self", "common_attn_metadata"]
    assert {"layer_names", "kv_cache_group_id"} <= set(AttentionGroup.__dataclass_fields__)
    init = _source(InputBatch.__init__)
    assert "self.token_ids_cpu_tensor" in init and "self.num_tokens_no_spec_cpu_tensor" in init


def _install_runner_fits() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_fits()


def _check_runner_fits() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert _params(GPUModelRunner._input_fits_in_drafter) == ["self", "common_attn_metadata"]
    src = _source(GPUModelRunner.sample_tokens)
    assert "self._input_fits_in_drafter(" in src and "if input_fits_in_drafter:" in src
    # Drafts near max_model_len are clipped by the scheduler, whatever the drafter proposes.
    assert "self.max_model_len" in _source(Scheduler.schedule)


def _install_runner_sample_tokens() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_sample_tokens()


def _check_runner_sample_tokens() -> None:
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert _params(GPUModelRunner.sample_tokens) == ["self", "grammar_output"]
    book = _source(GPUModelRunner._bookkeeping_sync)
    assert "self.discard_request_mask.np[:num_reqs]" in book
    assert "self.input_batch.generators.get(int(i))" in book and "set_offset" in book
    # The sampler reads the very same dict (popping hides a row from it too).
    assert "generators=self.generators" in _source(InputBatch._make_sampling_metadata)
    assert "execute_model_state" in _source(GPUModelRunner.sample_tokens)


def _install_tree_prepare_inputs() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_prepare_inputs()


def _check_tree_prepare_inputs() -> None:
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.block_table import BlockTable
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert _params(GPUModelRunner._prepare_inputs)[:2] == ["self", "scheduler_output"]
    src = _source(GPUModelRunner._prepare_inputs)
    # Slots are computed from the sequential positions inside _prepare_inputs, so positions
    # overwritten afterwards change RoPE only (each tree node keeps its own slot).
    assert src.index("self.positions[:total_num_scheduled_tokens] = (") < src.index("compute_slot_mapping(")
    assert "slot_mapping" in _source(BlockTable.__init__)
    # The rejection sampler is a plain attribute, called as (metadata, draft_probs, logits, sm).
    assert "self.rejection_sampler = RejectionSampler(" in _source(GPUModelRunner.__init__)
    assert "self.rejection_sampler(" in _source(GPUModelRunner._sample)
    # Steps with no drafts go to the rejection sampler's own plain sampler (logits, sm).
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    assert "self.sampler = sampler" in _source(RejectionSampler.__init__)
    assert _params(Sampler.forward)[:3] == ["self", "logits", "sampling_metadata"]
    assert {"draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens", "cu_num_sampled_tokens",
            "target_logits_indices", "bonus_logits_indices", "logits_indices"} == \
        set(SpecDecodeMetadata.__dataclass_fields__)
    # Drafts may be returned as per-request lists (variable length).
    assert "isinstance(self._draft_token_ids, list)" in _source(GPUModelRunner._get_draft_token_ids_cpu)


def _install_tree_attention() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_tree_attention()


def _check_tree_attention() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    for impl in (CPUAttentionBackendImpl, FlashAttentionImpl):
        assert _params(impl.forward)[:8] == [
            "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
        assert {"num_heads", "head_size", "scale"} <= set(_source(impl.__init__).replace("self.", " ").split())
    # K/V are written before forward (do_kv_cache_update), and the layouts our views read.
    assert CPUAttentionBackend.forward_includes_kv_cache_update is False
    src = _source(CPUAttentionBackendImpl.forward)
    assert "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in src
    assert "kv_cache.chunk(2, dim=2)" in src
    fa = _source(FlashAttentionImpl.forward)
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in fa
    assert "block_table = attn_metadata.block_table" in fa


def _install_cpu_expand_fix() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_cpu_expand_fix()


def _check_cpu_expand_fix() -> None:
    import importlib

    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    from vllm_clover.engine.runner_hooks import EXPAND_KERNEL

    # The bug worked around: int64 copies of output and input, the result never copied back.
    body = _file_function_source("vllm.utils.cpu_triton_utils", "_expand_kernel_impl")
    assert "_ensure_int64(output)" in body and ".copy_(" not in body, \
        "vLLM's CPU expand_kernel fallback changed (fixed?): re-check, maybe drop this patch"
    assert "cpu_tl._expand_kernel_impl" in _source(CpuPlatform.register_triton_kernel_overrides)
    module, name = EXPAND_KERNEL.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name)
    assert callable(dispatcher.register_kernels) and isinstance(dispatcher._registry, dict)


def _install_cgroup_usage_fix() -> None:
    from vllm_clover.cpu import env as cpu_env
    cpu_env.install_cgroup_usage_fix()


def _check_cgroup_usage_fix() -> None:
    usage = _file_function_source("vllm.utils.cpu_resource_utils", "get_cgroup_memory_usage")
    assert '"/sys/fs/cgroup/memory.current"' in usage and "memory.usage_in_bytes" in usage
    assert "inactive_file" not in usage and "memory.stat" not in usage, \
        "vLLM's cgroup usage now looks at memory.stat (page cache handled?): re-check, maybe drop"
    node = _file_function_source("vllm.utils.cpu_resource_utils", "get_memory_node_info")
    assert "cgroup_usage = get_cgroup_memory_usage()" in node
    assert "cgroup_limit - (cgroup_usage or 0)" in node


def _set_cpu_env() -> None:
    from vllm_clover.cpu import env as cpu_env
    if cpu_env.is_cpu_platform():
        cpu_env.set_cpu_env_for_children()


def _check_cpu_env() -> None:
    import inspect

    from vllm.utils import ompmultiprocessing

    src = inspect.getsource(ompmultiprocessing)
    # The reservation we undo on small machines, and the variable that overrides it.
    assert "self.reserve_cpu_num = (\n            self.local_world_size" in src, \
        "vLLM's CPU core reservation for the EngineCore changed: re-measure, maybe drop"
    assert "self.reserve_cpu_num = envs.VLLM_CPU_NUM_OF_RESERVED_CPU" in src
    # The OpenMP runtime check that libiomp5 must not be doubled with libgomp.
    assert "assert not (self.use_iomp and self.use_gomp)" in src


def _install_engine_draft_fetch() -> None:
    from vllm_clover.engine import runner_hooks
    runner_hooks.install_engine_draft_fetch()


def _check_engine_draft_fetch() -> None:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    assert _params(EngineCore.post_step) == ["self", "model_executed"]
    post = _source(EngineCore.post_step)
    assert "self.model_executor.take_draft_token_ids()" in post and "not self.async_scheduling" in post
    assert "num_spec_tokens_to_schedule" in SchedulerOutput.__dataclass_fields__
    sched = _source(Scheduler.schedule)
    # Scheduled requests lose their drafts at scheduling; K comes from the dynamic schedule.
    assert "request.spec_token_ids = []" in sched and "self.dynamic_sd_lookup[" in sched
    # post_step follows the step it belongs to only without a batch queue.
    assert "self.batch_queue = deque(" in _source(EngineCore.__init__)
    assert "self.post_step(model_executed)" in _source(EngineCoreProc._process_engine_step)


def _check_cpu_linear_dispatch() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    # The call we replace, and the dispatch that frees the weight we keep a reference to.
    assert "layer.cpu_linear(x, weight, bias)" in _source(cpu_unquantized_gemm)
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in _source(
        UnquantizedLinearMethod.process_weights_after_loading)


def _install_fp32_linear_kernel() -> None:
    from vllm_clover.cpu import env as cpu_env
    if cpu_env.is_cpu_platform():
        from vllm_clover.cpu import linear as cpu_linear
        cpu_linear.install_fp32_linear_kernel()


def _check_fp32_linear_kernel() -> None:
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    # The function we wrap, and its two callers, which import it from the module at call time
    # (so they see the wrapper).
    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__wrapped__", utils.dispatch_cpu_unquantized_gemm)
    assert _params(original) == ["layer", "remove_weight"]
    for method in (UnquantizedLinearMethod.process_weights_after_loading,
                   UnquantizedEmbeddingMethod.process_weights_after_loading):
        src = _source(method)
        assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in src, method
    # What we set in its place (how vLLM calls it: _check_cpu_linear_dispatch).
    body = _file_function_source("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
    assert "layer.cpu_linear = lambda x, weight, bias:" in body and "ops.create_onednn_mm(" in body


def _check_custom_op_dispatch() -> None:
    from vllm.model_executor.custom_op import CustomOp

    # One forward method chosen at construction and called by forward(); disabled ops get a
    # (compiled) forward_native, enabled ones the platform's, in the order _platform_forward follows.
    assert "self._forward_method = self.dispatch_forward(" in _source(CustomOp.__init__)
    assert "return self._forward_method(*args, **kwargs)" in _source(CustomOp.forward)
    dispatch = _source(CustomOp.dispatch_forward)
    assert "self.maybe_compile(self.forward_native" in dispatch
    order = ["is_rocm()", "is_cpu()", "is_tpu()", "is_xpu()", "is_out_of_tree()", "return self.forward_cuda"]
    assert [dispatch.index(k) for k in order] == sorted(dispatch.index(k) for k in order)
    # On CPU the drafter's RMSNorms call torch.ops._C directly, as RMSNorm.forward_cuda does
    # (vllm_model._cpu_rms_norm_forward): only while RMSNorm has no CPU kernel path of its own.
    from vllm.model_executor.layers.layernorm import RMSNorm

    assert "forward_cpu" not in RMSNorm.__dict__, "RMSNorm now has forward_cpu: use it for the drafter"


def _file_function_source(module: str, function: str) -> str:
    """A top-level function's text as in vLLM's file (the module attribute may be ours)."""
    import importlib.util
    from pathlib import Path

    src = Path(importlib.util.find_spec(module).origin).read_text()
    body = src[src.index(f"def {function}("):]
    return body[: body.index("\ndef ", 1)]


def _source(obj: object) -> str:
    import inspect

    return inspect.getsource(inspect.unwrap(obj))


CATALOGUE: list[Patch] = [
    Patch(
        name="cpu-env-for-spawned-processes",
        target="vllm.utils.ompmultiprocessing (environment read by the EngineCore and workers)",
        why=(
            "CPU only, environment of processes vLLM spawns afterwards (cpu_env.py): "
            "LD_PRELOAD starts with Intel OpenMP (vLLM warns speculative decoding is much "
            "slower without it) and, with at most 2 usable CPUs, VLLM_CPU_NUM_OF_RESERVED_CPU=0 "
            "so the worker binds every core instead of leaving one to the EngineCore (on 2 "
            "cores: one model thread; plain vLLM 1.4-1.6x faster without the reservation, "
            "docs/cpu-defaults.md). A variable the user set is left alone."
        ),
        remove_when="vLLM's CPU worker finds Intel OpenMP itself and stops reserving a core "
                    "for the EngineCore on small machines (check fails then)",
        apply=_set_cpu_env,
        check=_check_cpu_env,
    ),
    Patch(
        name="vllm-cpu-dist-alias",
        target="importlib.metadata (sys.meta_path); read by vllm.entrypoints.cli.main",
        why=(
            "vllm-cpu is published as distribution 'vllm-cpu' but vLLM's CLI calls "
            "importlib.metadata.version('vllm') and crashes; a finder answers for 'vllm' "
            "only when no real 'vllm' distribution exists. Also installed at interpreter "
            "start by vllm_clover_dist_alias.pth, since the CLI crashes before plugins load."
        ),
        remove_when="vllm-cpu's CLI stops asking for the 'vllm' distribution by name",
        apply=_install_dist_alias,
    ),
    Patch(
        name="clover-model-architecture",
        target="vllm.ModelRegistry.register_model",
        why=(
            "Registers CloverForSpeculativeDecoding (vllm_clover.engine.vllm_model, lazily) so the "
            "draft ModelConfig that vLLM builds in the front end, and get_model() in the "
            "worker, resolve a Clover checkpoint's config.json architecture. Public API."
        ),
        remove_when="never (public registration API)",
        apply=_register_model,
        check=_check_register_model,
    ),
    Patch(
        name="cli-speculative-model-flags",
        target="vllm.engine.arg_utils.EngineArgs.add_cli_args",
        why=(
            "Adds --speculative-model (clover:<dir>) and --num-speculative-tokens to every "
            "EngineArgs parser (vllm serve ...), reusing the dests spec_model / spec_tokens. "
            "Plugins load before it runs (AsyncEngineArgs.add_cli_args)."
        ),
        remove_when="vLLM offers these flags, or a hook for plugin CLI arguments",
        apply=_install_cli_flags,
        check=_check_cli_flags,
    ),
    Patch(
        name="speculative-config-clover-translation",
        target="vllm.engine.arg_utils.EngineArgs.create_speculative_config",
        why=(
            "SpeculativeConfig.method is a closed Literal; translates method 'clover' / "
            "'clover:<dir>' into method 'medusa' with the Clover directory, stashes Clover-only "
            "options in additional_config['clover'], and validates the checkpoint in the "
            "front-end process (one clear line before engine processes spawn)."
        ),
        remove_when="vLLM lets plugins register speculative methods",
        apply=_install_translation,
        check=_check_translation,
    ),
    Patch(
        name="clover-prefix-cache-block-drop",
        target="vllm.config.speculative.SpeculativeConfig.use_eagle_block_drop",
        why=(
            "The trunk KV at position p depends on token p+1 (EAGLE shift), outside p's block "
            "hash; like EAGLE, Clover needs the last matched block of a prefix-cache hit "
            "recomputed (scheduler/KV coordinator 'EAGLE block drop'), else drafts after a "
            "hit see a stale trunk entry (acceptance only). Honours disable_eagle_block_drop."
        ),
        remove_when="vLLM keys the block drop on 'drafter uses target hidden states', not the method",
        apply=_install_block_drop,
        check=_check_block_drop,
    ),
    Patch(
        name="serve-clover-errors-one-line",
        target="vllm.entrypoints.cli.serve.ServeSubcommand.cmd",
        why=(
            "In the `vllm serve` process only, a Clover configuration error (bad checkpoint, "
            "K > heads, target mismatch) raised by the translation ends the CLI with one "
            "'vllm serve: error: ...' line and exit 2 instead of a traceback; LLM(...) users "
            "still get the exception. No-op in processes that did not import the CLI."
        ),
        remove_when="vLLM prints ValueErrors from engine configuration without a traceback",
        apply=_install_serve_errors,
        check=_check_serve_errors,
    ),
    Patch(
        name="runner-init-clover-proposer",
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__ (inherited by CPUModelRunner)",
        why=(
            "For a Clover checkpoint in the medusa slot, swaps the MedusaProposer for "
            "CloverProposer (a subclass, so isinstance checks and medusa timing hold) and "
            "sets use_aux_hidden_state_outputs so the target returns its pre-norm residual."
        ),
        remove_when="vLLM can build a plugin-provided proposer with aux hidden states",
        apply=_install_runner_init,
        check=_check_runner_init,
    ),
    Patch(
        name="runner-propose-clover",
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids",
        why=(
            "The medusa branch passes one post-norm row per request; Clover's trunk needs the "
            "pre-norm rows of all scheduled tokens, positions, attention metadata and committed "
            "tokens. Routes Clover drafters to CloverProposer.propose_clover and publishes draft "
            "probabilities via the runner's _draft_probs/_draft_prob_req_ids contract."
        ),
        remove_when="vLLM passes full target state to plugin proposers",
        apply=_install_runner_propose,
        check=_check_runner_propose,
    ),
    Patch(
        name="cpu-rejection-sampler-expand-kernel",
        target="vllm.utils.cpu_triton_utils._expand_kernel_impl (registered for rejection_sampler.expand_kernel)",
        why=(
            "vLLM 0.32 CPU bug, every speculative method: the C++ fallback of the rejection "
            "sampler's expand_kernel writes into an int64 copy of its output, so per-token "
            "temperature / top-k / top-p of verification rows are uninitialised memory and "
            "sampling (T > 0) is not lossless. Replaced by a torch implementation, "
            "process-wide (a platform kernel, not engine behaviour)."
        ),
        remove_when="vLLM's CPU expand_kernel fallback copies its result back (check fails then)",
        apply=_install_cpu_expand_fix,
        check=_check_cpu_expand_fix,
    ),
    Patch(
        name="cpu-cgroup-usage-excludes-page-cache",
        target="vllm.utils.cpu_resource_utils.get_cgroup_memory_usage",
        why=(
            "vLLM 0.32 CPU: under a cgroup memory limit, available memory = limit - usage, "
            "and usage counts the page cache, so a container whose cache filled up (pip "
            "install, file copies) refuses every engine start ('Available memory ... less "
            "than requested memory for kv'). Our usage subtracts the reclaimable file pages "
            "and slab listed in memory.stat, as vLLM's node-level figure already does. "
            "Process-wide, every engine (a platform fix, not engine behaviour)."
        ),
        remove_when="vLLM's cgroup usage excludes reclaimable memory (check fails then)",
        apply=_install_cgroup_usage_fix,
        check=_check_cgroup_usage_fix,
    ),
    Patch(
        name="runner-clover-always-drafts",
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._input_fits_in_drafter",
        why=(
            "vLLM skips the drafter for the whole batch once any request is within K tokens "
            "of max_model_len (EAGLE drafts at positions past the sequence). Clover's trunk "
            "runs only at scheduled positions and the scheduler clips drafts, so Clover "
            "engines always draft; else other requests' trunk KV for that step stays unwritten."
        ),
        remove_when="vLLM asks the proposer whether it needs positions past the sequence",
        apply=_install_runner_fits,
        check=_check_runner_fits,
    ),
    Patch(
        name="runner-tree-positions-and-sampler",
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs (+ runner.rejection_sampler)",
        why=(
            "Tree verification (Clover engines with the tree option): after vLLM computed the "
            "KV slots from sequential positions, the rows of tree requests get RoPE positions "
            "root + depth, and the step's tree plan is published for the attention hook and "
            "the CloverRejectionSampler (set as runner.rejection_sampler at init of every Clover "
            "engine), which picks the accepted path, compacts its KV and hands vLLM's sampler a "
            "chain; on steps where no request drafted it calls vLLM's plain Sampler (vLLM runs "
            "its rejection sampler on every step of a speculative engine: +2 ms/step at batch 32)."
        ),
        remove_when="vLLM verifies token trees itself (its 2025 tree attention came back)",
        apply=_install_tree_prepare_inputs,
        check=_check_tree_prepare_inputs,
    ),
    Patch(
        name="attention-tree-rows",
        target=("vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward and "
                "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward"),
        why=(
            "vLLM's CPU and FlashAttention kernels know only causal masks. While a tree plan is active "
            "(target forward of a tree step, never Clover's trunk), the rows of tree requests "
            "are recomputed with their ancestor mask over the paged KV (tree_verify.tree_attention_rows)."
            " On CPU, when tree rows are every row of the step, the causal kernel is skipped "
            "(its output would be overwritten; it writes nothing else). A no-op in every engine "
            "without a tree plan."
        ),
        remove_when="vLLM's CPU attention takes arbitrary masks, or vLLM verifies trees itself",
        apply=_install_tree_attention,
        check=_check_tree_attention,
    ),
    Patch(
        name="runner-cpu-seeded-partial-prefill",
        target="vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens",
        why=(
            "vLLM 0.32 bug on CPU: a seeded request in a partial prefill chunk kills the "
            "engine ('CPU Generator does not use offset' in _bookkeeping_sync's generator "
            "rewind). For Clover engines, the CPU generators of such rows are hidden during "
            "the step (their samples and drafts are discarded), which is what the rewind means."
        ),
        remove_when="vLLM's generator rewind supports CPU generators",
        apply=_install_runner_sample_tokens,
        check=_check_runner_sample_tokens,
    ),
    Patch(
        name="cpu-fp32-linear-kernel",
        target="vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
        why=(
            "CPU with AVX-512 or AVX2, float32 weights (the CPU default dtype): every linear layer and the "
            "LM head run through vllm_clover/kernels/linear_cpu.py instead of oneDNN, in every engine of the "
            "process (plain vLLM too, so comparisons stay like for like). At 1 to ~40 rows oneDNN's "
            "float32 matmul costs ~1.3 ms per extra row for the default model's 30 layers on a "
            "2-core AVX-512 Xeon, this kernel ~0.8 (on a 2-core AVX2 EPYC rows 2-6 cost it nearly "
            "nothing), and a row's result does not depend on the row count (docs/cpu-linear.md). "
            "VLLM_CLOVER_CPU_LINEAR=0 turns it off."
        ),
        remove_when="vLLM's CPU float32 GEMM costs the same per row at small row counts",
        apply=_install_fp32_linear_kernel,
        check=_check_fp32_linear_kernel,
    ),
    Patch(
        name="drafter-cpu-linear-dtype",
        target=("cpu_linear of the drafter's own vLLM linear layers (set by "
                "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm)"),
        why=(
            "CPU, draft_dtype bfloat16 (the default for float32 models on AVX512-BF16 or AMX CPUs and "
            "wherever the float32 linear kernel runs, AVX2 included): the Augmenting-Block layers' "
            "products run over bfloat16 copies of their weights (oneDNN's bf16 primitive where the "
            "CPU multiplies bf16 natively, else the kernel's linear_bf16w), which halves the bytes "
            "drafting streams (cpu_linear.repack_vllm_linears, drafter_product). Applied per "
            "drafter at load by the proposer, never to the target's layers; vLLM frees these "
            "weights after packing, so CloverForSpeculativeDecoding.load_weights keeps them."
        ),
        remove_when="vLLM lets a draft model's linears run in their own dtype on CPU",
        apply=lambda: None,
        check=_check_cpu_linear_dispatch,
    ),
    Patch(
        name="drafter-custom-ops-eager",
        target="vllm.model_executor.custom_op.CustomOp._forward_method of the drafter's own layers",
        why=(
            "The Augmenting-Block layers' RMSNorm, rotary embedding and SiluAndMul call their "
            "platform kernels (forward_cpu / forward_cuda, as an enabled custom op) instead of "
            "the torch.compile-wrapped forward_native vLLM gives disabled ops when the target "
            "is compiled: the drafter runs eagerly, and each compiled-region call cost 115-215 us "
            "(trunk 2.98 -> 2.47 ms per step without them, 2-core Xeon, bf16). On CPU the RMSNorms "
            "call torch.ops._C.rms_norm / fused_add_rms_norm (RMSNorm has no forward_cpu; its "
            "IR-op native path is 7 PyTorch ops, 21-34 us vs 4-8 us a call). Set per drafter at "
            "construction (vllm_model.run_custom_ops_natively), never on the target's layers."
        ),
        remove_when="vLLM compiles draft models with the target, or lets a module opt into its custom ops",
        apply=lambda: None,
        check=_check_custom_op_dispatch,
    ),
    Patch(
        name="engine-no-draft-fetch-when-drafting-off",
        target="vllm.v1.engine.core.EngineCore.post_step (+ vllm.v1.core.sched.scheduler.Scheduler.schedule)",
        why=(
            "EngineCore side, Clover engines only: after a step scheduled with no drafts "
            "(num_spec_tokens_to_schedule == 0: disable_by_batch_size reached), skip the "
            "take_draft_token_ids RPC vLLM makes after every speculative step; those drafts are "
            "empty and scheduled requests' spec_token_ids are already cleared. ~1 ms per step "
            "at batch 32 on 2 CPU cores, where vanilla makes two RPCs a step "
            "(runner_hooks.install_engine_draft_fetch). Schedule records the step's K."
        ),
        remove_when="vLLM skips the draft fetch itself when the dynamic schedule gives K = 0",
        apply=_install_engine_draft_fetch,
        check=_check_engine_draft_fetch,
    ),
]

_applied: set[str] = set()


def apply_all() -> None:
    for patch in CATALOGUE:
        if patch.name not in _applied:
            patch.apply()
            _applied.add(patch.name)


def describe() -> str:
    """Human-readable catalogue (``vllm-clover patches``)."""
    lines = []
    for p in CATALOGUE:
        lines += [f"- {p.name}", f"    target: {p.target}", f"    why: {p.why}",
                  f"    remove when: {p.remove_when}"]
    return "\n".join(lines)
