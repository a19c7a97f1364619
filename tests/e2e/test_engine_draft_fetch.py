"""Patch ``engine-no-draft-fetch-when-drafting-off`` in a real engine: after steps scheduled
with no drafts (``disable_by_batch_size`` reached), and after steps whose adaptive choice drafted
nothing, the EngineCore of a Clover engine makes no ``take_draft_token_ids`` RPC; while drafting
it still fetches the drafts (and uses them).

The engine runs in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the test can count the
EngineCore's calls on its real executor. Outputs stay plain vLLM's: the lossless suite runs
the serve defaults (``disable_by_batch_size`` 3) with 37 prompts at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import shutdown_llm

pytestmark = pytest.mark.slow


def test_no_draft_fetch_while_drafting_is_off(monkeypatch: pytest.MonkeyPatch, default_model_dir: Path,
                                               clover_ckpt_dir: Path) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_clover.engine.runner_hooks import _LAST_K

    llm = LLM(model=str(default_model_dir), dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=256 << 20, seed=0, disable_log_stats=False,
              speculative_config={"method": "clover", "model": str(clover_ckpt_dir),
                                  "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    try:
        core, calls = _count_fetches(monkeypatch, llm)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
                   "List three colours:"]
        # Four requests prefilled in one step and finishing together: every step has K = 0.
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
        assert getattr(core.scheduler, _LAST_K) == 0
        assert calls == []
        # One request: drafting is on, so every step fetches drafts, and they are verified.
        before = _accepted_and_drafts(llm)
        out = llm.generate(prompts[:1], params, use_tqdm=False)[0]
        after = _accepted_and_drafts(llm)
        assert len(out.outputs[0].token_ids) == 12
        assert getattr(core.scheduler, _LAST_K) == 2
        assert len(calls) >= 12 // 3  # at most 3 tokens a step
        assert after[1] > before[1]
    finally:
        shutdown_llm(llm)


def test_no_draft_fetch_after_steps_that_drafted_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         default_model_dir: Path, clover_ckpt_dir: Path) -> None:
    """The adaptive chain forced to draft nothing: steps are scheduled with K > 0, the worker marks
    its output, no fetch. Forced to draft 2 tokens: every step fetches, and drafts are verified.
    Across processes the mark travels pickled with the output (tests/unit/engine/test_metrics.py)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))
    from vllm import LLM, SamplingParams

    from vllm_clover.engine.metrics import SCHEDULER_DRAFTED
    from vllm_clover.engine.runner_hooks import _LAST_K

    llm = LLM(model=str(default_model_dir), dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=256 << 20, seed=0, disable_log_stats=False,
              speculative_config={"method": "clover", "model": str(clover_ckpt_dir), "adaptive_chain": True},
              worker_extension_cls="vllm_clover.engine.runner_hooks.CloverWorkerExtension")
    try:
        core, calls = _count_fetches(monkeypatch, llm)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        llm.collective_rpc("clover_adaptive_force", args=([(0, 0)],))
        out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 12
        assert getattr(core.scheduler, _LAST_K) > 0 and getattr(core.scheduler, SCHEDULER_DRAFTED) is False
        assert calls == []
        llm.collective_rpc("clover_adaptive_force", args=([(2, 0)],))
        before = _accepted_and_drafts(llm)
        llm.generate(["def fibonacci(n):"], params, use_tqdm=False)
        after = _accepted_and_drafts(llm)
        assert len(calls) >= 12 // 3 and after[1] > before[1]
    finally:
        shutdown_llm(llm)


def _count_fetches(monkeypatch: pytest.MonkeyPatch, llm) -> tuple[object, list[int]]:
    """The in-process EngineCore of ``llm`` and a list that grows by one per draft fetch it makes."""
    core = llm.llm_engine.engine_core.engine_core
    executor = core.model_executor
    calls: list[int] = []
    fetch = executor.take_draft_token_ids

    def counted_fetch():
        calls.append(1)
        return fetch()

    monkeypatch.setattr(executor, "take_draft_token_ids", counted_fetch)
    return core, calls


def _accepted_and_drafts(llm) -> tuple[int, int]:
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (int(counters.get("vllm:spec_decode_num_accepted_tokens", 0)),
            int(counters.get("vllm:spec_decode_num_draft_tokens", 0)))
