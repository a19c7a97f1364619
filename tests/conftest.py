"""Shared test fixtures. Slow end-to-end tests are marked ``slow`` and still run in CI.

vLLM on CPU is started with float32 (bit-exact greedy, no bf16 kernel hazards, see
docs/cpu-defaults.md), eager mode (23 s start instead of 90 s) and an explicit KV-cache
size (vLLM's default reserves 92% of RAM).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Tests spawn vLLM processes; keep them on the CPU defaults the product uses.
os.environ.setdefault("VLLM_CLOVER_TEST", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: end-to-end test that starts vLLM (runs in CI)")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from vllm_clover.default_model import ensure_default_model

    return ensure_default_model(verbose=False)


def venv_bin(name: str) -> str:
    """Path of a console script installed next to the running interpreter."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.fail(f"console script {name!r} not installed next to {sys.executable}; run `make test`")
    return str(path)


E2E_LLM_KWARGS = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                      max_model_len=2048)


def shutdown_llm(llm) -> None:
    """Stop an ``LLM``'s EngineCore/worker processes now, not at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()
