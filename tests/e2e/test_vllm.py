"""The default model runs in vLLM on CPU with the plugin loaded in its worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import E2E_LLM_KWARGS, shutdown_llm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(default_model_dir: Path):
    import os

    from vllm import LLM

    # collective_rpc with a plain function needs pickle; test-only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = LLM(model=str(default_model_dir), **E2E_LLM_KWARGS)
    yield engine
    shutdown_llm(engine)


def _worker_plugin_state(worker) -> tuple[bool, str]:
    import multiprocessing
    import os

    import vllm_clover.plugin

    return vllm_clover.plugin.is_registered(), multiprocessing.current_process().name + \
        f" iomp={'libiomp' in os.environ.get('LD_PRELOAD', '')}"


def test_plugin_registered_in_worker_process(llm) -> None:
    states = llm.collective_rpc(_worker_plugin_state)
    assert states and all(registered for registered, _ in states), states
    assert all("iomp=True" in where for _, where in states), states


def _worker_threads(worker) -> int:
    import torch

    return torch.get_num_threads()


def test_worker_uses_every_core_on_a_small_machine(llm) -> None:
    """vLLM would keep one of 2 cores for the EngineCore; cpu_env gives the worker both."""
    from vllm_clover.cpu import env as cpu_env
    cpus = cpu_env.usable_cpus()
    if cpus > cpu_env.SMALL_MACHINE_CPUS:
        pytest.skip(f"{cpus} CPUs: vLLM's own reservation applies")
    assert llm.collective_rpc(_worker_threads) == [cpus]


def test_chat_answers_capital_of_france(llm) -> None:
    from vllm import SamplingParams

    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))
    text = out[0].outputs[0].text
    assert "Paris" in text, text


def test_greedy_generate_is_deterministic_in_float32(llm) -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]
    assert first == second[::-1]
    assert all(len(t) == 16 for t in first)
