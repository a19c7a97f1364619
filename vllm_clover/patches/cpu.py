"""CPU patches: the environment of spawned processes, the ``vllm`` distribution alias, three vLLM
CPU fixes, the float32 linear kernel and the drafter's own CPU dispatch. The code they install
lives in vllm_clover/cpu/ (env, linear, lora_ops), vllm_clover/engine/ and vllm_clover_dist_alias.py."""

from __future__ import annotations

from vllm_clover.patches.patching import Patch, file_function_source, params, patched_by, replace, source, wrap


# ------------------------------------------------------------------ environment of spawned processes
def set_cpu_env() -> None:
    from vllm_clover.cpu import env as cpu_env

    if cpu_env.is_cpu_platform():
        cpu_env.set_cpu_env_for_children()


def check_cpu_env() -> None:
    import inspect

    from vllm.utils import ompmultiprocessing

    src = inspect.getsource(ompmultiprocessing)
    # The reservation we undo on small machines, and the variable that overrides it.
    assert "self.reserve_cpu_num = (\n            self.local_world_size" in src, \
        "vLLM's CPU core reservation for the EngineCore changed: re-measure, maybe drop"
    assert "self.reserve_cpu_num = envs.VLLM_CPU_NUM_OF_RESERVED_CPU" in src
    # The OpenMP runtime check that libiomp5 must not be doubled with libgomp.
    assert "assert not (self.use_iomp and self.use_gomp)" in src


CPU_ENV = Patch(
    name="cpu-env-for-spawned-processes",
    target="vllm.utils.ompmultiprocessing (environment read by the EngineCore and workers)",
    why=("CPU only, the environment of processes vLLM spawns afterwards (cpu/env.py): LD_PRELOAD starts "
         "with Intel OpenMP, which vLLM's CPU worker wants for speculative decoding, and with at most 2 "
         "usable CPUs VLLM_CPU_NUM_OF_RESERVED_CPU=0 gives the worker every core instead of keeping one "
         "for the EngineCore (docs/cpu-defaults.md). A variable the user set is left alone."),
    upstream="none known",
    remove_when="vLLM's CPU worker finds Intel OpenMP itself and stops reserving a core "
                "for the EngineCore on small machines (check fails then)",
    apply=set_cpu_env,
    check=check_cpu_env,
)


# ------------------------------------------------------------------ the vllm distribution alias
def install_dist_alias() -> None:
    import vllm_clover_dist_alias

    vllm_clover_dist_alias.install()


DIST_ALIAS = Patch(
    name="vllm-cpu-dist-alias",
    target="importlib.metadata (sys.meta_path); read by vllm.entrypoints.cli.main",
    why=("vllm-cpu is published as distribution 'vllm-cpu' but vLLM's CLI asks "
         "importlib.metadata.version('vllm') and crashes, so a finder answers for 'vllm' when no real "
         "'vllm' distribution exists. vllm_clover_dist_alias.pth also installs it at interpreter start, "
         "since the CLI crashes before plugins load."),
    upstream="none known",
    remove_when="vllm-cpu's CLI stops asking for the 'vllm' distribution by name",
    apply=install_dist_alias,
    no_check=("touches no vLLM object; tests/unit/test_plugin.py runs the stock `vllm --version` "
              "and the alias in a fresh interpreter"),
)


# ------------------------------------------------------------------ rejection sampler expand_kernel
def install_expand_fix() -> None:
    """Swap vLLM's CPU fallback (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) for
    ``runner_hooks.expand_kernel_impl``. Plugins load before the worker registers its CPU kernel
    overrides (``worker_base.py`` ``init_worker``), which reads the module attribute; if the
    overrides are already registered in this process, ours is registered again."""
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    from vllm_clover.engine import runner_hooks

    if patched_by(cpu_triton_utils._expand_kernel_impl) == EXPAND_FIX.name:
        return
    ours = replace(cpu_triton_utils, "_expand_kernel_impl", runner_hooks.expand_kernel_impl, EXPAND_FIX)
    registered = dispatcher._registry.get(runner_hooks.EXPAND_KERNEL)
    if registered is not None and patched_by(registered[1]) != EXPAND_FIX.name:
        dispatcher.register_kernels({runner_hooks.EXPAND_KERNEL: ours})


def check_expand_fix() -> None:
    import importlib

    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import dispatcher

    from vllm_clover.engine.runner_hooks import EXPAND_KERNEL

    # The bug worked around: int64 copies of output and input, the result never copied back.
    body = file_function_source("vllm.utils.cpu_triton_utils", "_expand_kernel_impl")
    assert "_ensure_int64(output)" in body and ".copy_(" not in body, \
        "vLLM's CPU expand_kernel fallback changed (fixed?): re-check, maybe drop this patch"
    assert "cpu_tl._expand_kernel_impl" in source(CpuPlatform.register_triton_kernel_overrides)
    module, name = EXPAND_KERNEL.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name)
    assert callable(dispatcher.register_kernels) and isinstance(dispatcher._registry, dict)


EXPAND_FIX = Patch(
    name="cpu-rejection-sampler-expand-kernel",
    target="vllm.utils.cpu_triton_utils._expand_kernel_impl (registered for rejection_sampler.expand_kernel)",
    why=("vLLM CPU bug, every speculative method: the C++ fallback of the rejection sampler's "
         "expand_kernel writes into an int64 copy of its output, so per-token temperature / top-k / "
         "top-p of verification rows are uninitialised and sampling (T > 0) is not lossless. Replaced "
         "by a torch implementation, process-wide."),
    upstream="none known",
    remove_when="vLLM's CPU expand_kernel fallback copies its result back (check fails then)",
    apply=install_expand_fix,
    check=check_expand_fix,
)


# ------------------------------------------------------------------ cgroup memory usage
def cgroup_memory_usage() -> int | None:
    """Stands in for vLLM's ``get_cgroup_memory_usage`` (same signature, no arguments)."""
    from vllm_clover.cpu import env as cpu_env

    return cpu_env.cgroup_memory_usage_without_page_cache()


def install_cgroup_fix() -> None:
    from vllm.utils import cpu_resource_utils

    replace(cpu_resource_utils, "get_cgroup_memory_usage", cgroup_memory_usage, CGROUP_FIX)


def check_cgroup_fix() -> None:
    usage = file_function_source("vllm.utils.cpu_resource_utils", "get_cgroup_memory_usage")
    assert '"/sys/fs/cgroup/memory.current"' in usage and "memory.usage_in_bytes" in usage
    assert "inactive_file" not in usage and "memory.stat" not in usage, \
        "vLLM's cgroup usage now looks at memory.stat (page cache handled?): re-check, maybe drop"
    node = file_function_source("vllm.utils.cpu_resource_utils", "get_memory_node_info")
    assert "cgroup_usage = get_cgroup_memory_usage()" in node
    assert "cgroup_limit - (cgroup_usage or 0)" in node


CGROUP_FIX = Patch(
    name="cpu-cgroup-usage-excludes-page-cache",
    target="vllm.utils.cpu_resource_utils.get_cgroup_memory_usage",
    why=("vLLM CPU: under a cgroup memory limit available memory is limit - usage, and usage counts the "
         "page cache, so a container whose cache filled up refuses every engine start. Our usage "
         "subtracts the reclaimable file pages and slab of memory.stat, as vLLM's node-level figure "
         "already does (docs/cpu-defaults.md)."),
    upstream="none known",
    remove_when="vLLM's cgroup usage excludes reclaimable memory (check fails then)",
    apply=install_cgroup_fix,
    check=check_cgroup_fix,
)


# ------------------------------------------------------------------ LoRA rows without an adapter
def install_lora_ops_fix() -> None:
    """Wrap the CPU LoRA ops where they are looked up: in ``lora_ops`` (the ``sgmv_*`` ops call
    them there), the ``torch_ops`` package (``punica_cpu`` imports them from it) and, if it is
    already imported, ``punica_cpu`` itself (importing it here would cost seconds per process)."""
    import sys

    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops

    from vllm_clover.cpu import env as cpu_env
    from vllm_clover.cpu.lora_ops import OPS, skip_rows_without_adapter

    if not cpu_env.is_cpu_platform():
        return
    owners = [lora_ops, torch_ops]
    if "vllm.lora.punica_wrapper.punica_cpu" in sys.modules:
        owners.append(sys.modules["vllm.lora.punica_wrapper.punica_cpu"])
    for name in OPS:
        original = getattr(lora_ops, name)
        ours = original if patched_by(original) == LORA_OPS_FIX.name else skip_rows_without_adapter(original)
        for owner in owners:
            replace(owner, name, ours, LORA_OPS_FIX)


def check_lora_ops_fix() -> None:
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.platforms.cpu import CpuPlatform

    from vllm_clover.cpu.lora_ops import OPS

    for name in OPS:
        body = source(getattr(lora_ops, name))
        assert "lora_b_weights[lora_indices_tensor]" in body and "-1" not in body, \
            f"vLLM's CPU LoRA op {name} changed (no-adapter rows handled?): re-check, maybe drop this patch"
    for name in ("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"):
        assert f"\n    b{name[1:]}(" in source(getattr(lora_ops, name)), name
    assert "PunicaWrapperCPU" in source(CpuPlatform.get_punica_wrapper)
    import importlib.util
    from pathlib import Path

    punica = Path(importlib.util.find_spec("vllm.lora.punica_wrapper.punica_cpu").origin).read_text()
    assert "from vllm.lora.ops.torch_ops import (" in punica


LORA_OPS_FIX = Patch(
    name="cpu-lora-no-adapter-rows",
    target="vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink / bgmv_expand / bgmv_expand_slice (PunicaWrapperCPU)",
    why=("vLLM CPU bug, every engine with --enable-lora: the PyTorch LoRA ops index the adapter weights "
         "with the no-adapter index -1, which selects the last adapter slot, so a request without an "
         "adapter batched next to one with it gets the adapter's update (with max_loras=1 always). Rows "
         "without an adapter are left untouched, as vLLM's Triton kernels do (cpu/lora_ops.py)."),
    upstream="vllm-project/vllm#48421 (skip no-LoRA tokens in the CPU torch bgmv ops)",
    remove_when="vLLM's CPU LoRA ops skip index -1 (check fails then)",
    apply=install_lora_ops_fix,
    check=check_lora_ops_fix,
)


# ------------------------------------------------------------------ float32 linear kernel
def install_fp32_linear_kernel() -> None:
    """Route vLLM's CPU linear dispatch through ``cpu.linear.wrap_dispatch`` (every process on
    vLLM's CPU build; the wrapper itself decides per layer)."""
    from vllm.model_executor.layers import utils

    from vllm_clover.cpu import linear as cpu_linear

    wrap(utils, "dispatch_cpu_unquantized_gemm", cpu_linear.wrap_dispatch, FP32_LINEAR)


def _apply_fp32_linear_kernel() -> None:
    from vllm_clover.cpu import env as cpu_env

    if cpu_env.is_cpu_platform():
        install_fp32_linear_kernel()


def check_fp32_linear_kernel() -> None:
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    # The function we wrap, and its two callers, which import it from the module at call time
    # (so they see the wrapper).
    original = getattr(utils.dispatch_cpu_unquantized_gemm, "__wrapped__", utils.dispatch_cpu_unquantized_gemm)
    assert params(original) == ["layer", "remove_weight"]
    for method in (UnquantizedLinearMethod.process_weights_after_loading,
                   UnquantizedEmbeddingMethod.process_weights_after_loading):
        src = source(method)
        assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in src, method
    # What we set in its place (how vLLM calls it: check_cpu_linear_dispatch).
    body = file_function_source("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
    assert "layer.cpu_linear = lambda x, weight, bias:" in body and "ops.create_onednn_mm(" in body


FP32_LINEAR = Patch(
    name="cpu-fp32-linear-kernel",
    target="vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
    why=("CPU with AVX-512 or AVX2 and float32 weights: every linear layer and the LM head run through "
         "vllm_clover/kernels/linear_cpu.py instead of oneDNN, in every engine of the process, plain vLLM "
         "too; it costs less per row at 1 to ~40 rows (docs/cpu-linear.md). VLLM_CLOVER_CPU_LINEAR=0 "
         "turns it off."),
    upstream="none known",
    remove_when="vLLM's CPU float32 GEMM costs the same per row at small row counts",
    apply=_apply_fp32_linear_kernel,
    check=check_fp32_linear_kernel,
)


# ------------------------------------------------------------------ the drafter's own CPU dispatch
def check_cpu_linear_dispatch() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    # The call we replace, and the dispatch that frees the weight we keep a reference to.
    assert "layer.cpu_linear(x, weight, bias)" in source(cpu_unquantized_gemm)
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in source(
        UnquantizedLinearMethod.process_weights_after_loading)


def _applied_per_drafter() -> None:
    """Nothing to install process-wide: the proposer applies it to each drafter it loads."""


DRAFTER_LINEAR_DTYPE = Patch(
    name="drafter-cpu-linear-dtype",
    target=("cpu_linear of the drafter's own vLLM linear layers (set by "
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm)"),
    why=("CPU, draft_dtype bfloat16: the Augmenting-Block layers' products run over bfloat16 copies of "
         "their weights (cpu_linear.repack_vllm_linears), halving the bytes drafting streams. Applied per "
         "drafter at load by the proposer, never to the target's layers; "
         "CloverForSpeculativeDecoding.load_weights keeps the weights vLLM frees after packing."),
    upstream="none known",
    remove_when="vLLM lets a draft model's linears run in their own dtype on CPU",
    apply=_applied_per_drafter,
    check=check_cpu_linear_dispatch,
)


def check_custom_op_dispatch() -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    # One forward method chosen at construction and called by forward(); disabled ops get a
    # (compiled) forward_native, enabled ones the platform's, in the order _platform_forward follows.
    assert "self._forward_method = self.dispatch_forward(" in source(CustomOp.__init__)
    assert "return self._forward_method(*args, **kwargs)" in source(CustomOp.forward)
    dispatch = source(CustomOp.dispatch_forward)
    assert "self.maybe_compile(self.forward_native" in dispatch
    order = ["is_rocm()", "is_cpu()", "is_tpu()", "is_xpu()", "is_out_of_tree()", "return self.forward_cuda"]
    assert [dispatch.index(k) for k in order] == sorted(dispatch.index(k) for k in order)
    # On CPU the drafter's RMSNorms call torch.ops._C directly, as RMSNorm.forward_cuda does
    # (vllm_model._cpu_rms_norm_forward): only while RMSNorm has no CPU kernel path of its own.
    assert "forward_cpu" not in RMSNorm.__dict__, "RMSNorm now has forward_cpu: use it for the drafter"


DRAFTER_CUSTOM_OPS = Patch(
    name="drafter-custom-ops-eager",
    target="vllm.model_executor.custom_op.CustomOp._forward_method of the drafter's own layers",
    why=("The Augmenting-Block layers' RMSNorm, rotary embedding and SiluAndMul call their platform "
         "kernels instead of the torch.compile-wrapped forward_native vLLM gives disabled ops when the "
         "target is compiled, so the drafter runs eagerly without a compiled-region call per op "
         "(docs/tree-verification.md). Set per drafter at construction "
         "(vllm_model.run_custom_ops_natively), never on the target's layers."),
    upstream="none known",
    remove_when="vLLM compiles draft models with the target, or lets a module opt into its custom ops",
    apply=_applied_per_drafter,
    check=check_custom_op_dispatch,
)
