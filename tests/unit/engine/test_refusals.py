"""Settings Clover cannot run right are refused in the front end, before any engine process
starts, each with one line naming the setting (``frontend.refuse_unsupported``): the V2 model
runner, pipeline stages, a quantised KV cache with a tree, and on a GPU a tree on an
attention backend without tree rows or in float32. Each runs vLLM's own
``EngineArgs.create_engine_config`` (the front-end half of ``LLM(...)`` / ``vllm serve``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_clover.engine.options import CloverSpecError


def _engine_config(model_dir: Path, spec: dict, dtype: str = "float32", **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype=dtype, max_model_len=512, speculative_config=spec, **kw)
    return args.create_engine_config()


def _refused(excinfo: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg


@pytest.fixture
def as_gpu(monkeypatch):
    """The front end as on a GPU build: vLLM's platform says "not CPU" to Clover's checks."""
    import vllm_clover.engine.options as options

    monkeypatch.setattr(options, "_on_cpu", lambda: False)


def _tree(ckpt: Path) -> dict:
    return {"method": "clover", "model": str(ckpt), "tree": "small_3"}


def test_v2_model_runner_is_refused(default_model_dir, clover_ckpt_dir, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir)})
    _refused(excinfo, "VLLM_USE_V2_MODEL_RUNNER=1", "V1")
    # "0" is the V1 runner: accepted.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config = _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir)})
    assert config.speculative_config.method == "medusa" and not config.use_v2_model_runner


def test_pipeline_parallel_is_refused_before_loading(default_model_dir, clover_ckpt_dir) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir)},
                       pipeline_parallel_size=2)
    _refused(excinfo, "pipeline_parallel_size=2", "tensor parallelism")


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_quantised_kv_cache_with_a_tree_is_refused(default_model_dir, clover_ckpt_dir, cache_dtype) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, _tree(clover_ckpt_dir), kv_cache_dtype=cache_dtype)
    _refused(excinfo, f"kv_cache_dtype={cache_dtype!r}", "tree")


def test_quantised_kv_cache_with_a_chain_is_left_to_vllm(default_model_dir, clover_ckpt_dir) -> None:
    # Chain verification is vLLM's own: nothing of the plugin reads the KV cache.
    config = _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir)},
                            kv_cache_dtype="fp8")
    assert config.cache_config.cache_dtype == "fp8"


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASHINFER"])
def test_tree_on_a_gpu_backend_without_tree_rows_is_refused(default_model_dir, clover_ckpt_dir, as_gpu,
                                                            backend) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, _tree(clover_ckpt_dir), dtype="bfloat16", attention_backend=backend)
    _refused(excinfo, f"attention backend {backend}", "FLASH_ATTN")


def test_tree_in_float32_on_a_gpu_is_refused(default_model_dir, clover_ckpt_dir, as_gpu) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, _tree(clover_ckpt_dir), dtype="float32")
    _refused(excinfo, "dtype float32", "FlashAttention")


def test_supported_gpu_tree_settings_pass_the_refusals(clover_ckpt_dir, as_gpu) -> None:
    """bfloat16 with FLASH_ATTN or the backend left to vLLM, and float32 chains (vLLM verifies
    chains itself, on any backend), pass; checked on the refusal itself, since the CPU build's
    create_engine_config would reject a GPU backend further on."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from vllm_clover.engine.frontend import refuse_unsupported
    from vllm_clover.engine.options import CloverOptions

    tree = CloverOptions.from_spec({"model": str(clover_ckpt_dir), "tree": "small_3"})
    chain = CloverOptions.from_spec({"model": str(clover_ckpt_dir)})
    for backend in (None, "FLASH_ATTN", "CUSTOM"):
        refuse_unsupported(EngineArgs(model="m", attention_backend=backend), tree, torch.bfloat16)
    refuse_unsupported(EngineArgs(model="m", attention_backend="TRITON_ATTN"), chain, torch.float32)


def test_tree_on_a_gpu_selects_the_tree_backend(default_model_dir, clover_ckpt_dir, as_gpu) -> None:
    """No backend chosen: the plugin's CUSTOM tree backend; an explicit FLASH_ATTN stays; on the
    CPU build (and for chains) nothing is chosen."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_clover.engine.frontend import select_tree_backend
    from vllm_clover.engine.options import CloverOptions

    tree = CloverOptions.from_spec({"model": str(clover_ckpt_dir), "tree": "small_3"})
    chain = CloverOptions.from_spec({"model": str(clover_ckpt_dir)})
    args = EngineArgs(model="m")
    select_tree_backend(args, tree)
    assert args.attention_backend == "CUSTOM"
    explicit = EngineArgs(model="m", attention_backend="FLASH_ATTN")
    select_tree_backend(explicit, tree)
    assert explicit.attention_backend == "FLASH_ATTN"
    for options, on_cpu in ((chain, False), (tree, True)):
        untouched = EngineArgs(model="m")
        select_tree_backend(untouched, options, on_cpu=on_cpu)
        assert untouched.attention_backend is None
    # Through vLLM's own config: the CUSTOM member, resolved to the plugin's class.
    config = _engine_config(default_model_dir, _tree(clover_ckpt_dir), dtype="bfloat16")
    assert config.attention_config.backend.name == "CUSTOM"
    backend = config.attention_config.backend.get_class()
    assert backend.get_name() == "CUSTOM" and backend.__name__ == "CloverTreeAttentionBackend"
