"""The shape checks of the V1/V2 runner choice and the async-scheduling rule
(patches/runner.py) pass on the installed vLLM and fail when vLLM decides differently."""

from __future__ import annotations

import pytest

from vllm_clover.patches import runner


def test_checks_pass_on_the_installed_vllm() -> None:
    runner.check_runner_choice()
    runner.check_sync_scheduling()


def test_runner_choice_check_fails_when_v2_takes_medusa(monkeypatch) -> None:
    from vllm.config import VllmConfig

    def unsupported(self) -> list[str]:  # a vLLM whose V2 runner runs medusa
        return []

    monkeypatch.setattr(VllmConfig, "_get_v2_model_runner_unsupported_features", unsupported)
    with pytest.raises(AssertionError):
        runner.check_runner_choice()


def test_sync_scheduling_check_fails_when_medusa_gets_async(monkeypatch) -> None:
    from vllm.config import speculative

    monkeypatch.setattr(speculative, "EagleModelTypes", speculative.Literal["eagle", "medusa"])
    with pytest.raises(AssertionError):
        runner.check_sync_scheduling()


def test_clover_engine_config_takes_v1_without_async_scheduling(default_model_dir, clover_ckpt_dir) -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(default_model_dir), dtype="float32", max_model_len=512,
                        speculative_config={"method": "clover", "model": str(clover_ckpt_dir)}
                        ).create_engine_config()
    assert config.speculative_config.method == "medusa"
    assert config.use_v2_model_runner is False
    assert config.scheduler_config.async_scheduling is False
