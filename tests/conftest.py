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


@pytest.fixture(scope="session")
def clover_ckpt_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Clover-2 checkpoint for the default target.

    Trained heads shipped under vllm_clover/heads/<name>/ are used when one fits the
    target; otherwise a drafter is initialised from the target (build_drafter: Aug layers
    copied from its last layer, untrained heads) and saved in float32. Acceptance is then
    low, but losslessness must hold whatever the heads are.
    """
    import torch
    import transformers

    import vllm_clover
    from vllm_clover.checkpoint import CloverCheckpointError, save_drafter, validate_checkpoint
    from vllm_clover.config import CloverConfig
    from vllm_clover.model import build_drafter

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    for cfg_file in sorted((Path(vllm_clover.__file__).parent / "heads").glob("*/config.json")):
        try:
            validate_checkpoint(cfg_file.parent, hf.config)
            return cfg_file.parent
        except CloverCheckpointError:
            continue
    out = tmp_path_factory.mktemp("clover-ckpt")
    config = CloverConfig.from_target_config(hf.config, num_heads=4)
    save_drafter(out, build_drafter(config, target=hf), dtype=torch.float32)
    return out


def sensitize_drafter(drafter, trunk_scale: float = 60.0, head_scale: float = 15.0,
                      gate_bias: float = 100.0, attn_gain: float = 10.0):
    """Make an (untrained) Clover-2 drafter's drafts depend strongly on every input.

    Heads initialised from the target barely look at the fused token E[y] (v ~ U(0, 0.01))
    and their Aug-layer attention is a small term next to a residual stream of norm ~600,
    so drafts would hardly change if y were shifted, the trunk KV were lost or RoPE were
    wrong: a wiring test built on them would have no power. Here both attention decoders
    get gates ~1 (equal large q/k biases: cos(q, k) ~ 1) and v = scale * I, so
    u = x + trunk_scale * E[y] and s_i = s_{i-1} + head_scale * E[prev], and the Aug
    layers' attention output is amplified by attn_gain. The drafts are still bad
    predictions, but on a period-1 text ("the the the ...") head 0 drafts the repeated
    token with ~60% overlap with the target at temperature 0.8, so rejection sampling
    both accepts and rejects.
    """
    import torch

    h = drafter.config.hidden_size
    with torch.no_grad():
        for dec, scale in ((drafter.trunk_decoder, trunk_scale), (drafter.head_decoder, head_scale)):
            dec.q.bias.fill_(gate_bias)
            dec.k.bias.fill_(gate_bias)
            dec.v.weight.copy_(torch.eye(h) * scale)
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(attn_gain)
    return drafter


@pytest.fixture(scope="session")
def sensitive_ckpt_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Clover-2 checkpoint (4 heads, float32) built from the target and sensitized
    (see :func:`sensitize_drafter`): for tests that compare drafts or need acceptance."""
    import torch
    import transformers

    from vllm_clover.checkpoint import save_drafter
    from vllm_clover.config import CloverConfig
    from vllm_clover.model import build_drafter

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    drafter = sensitize_drafter(build_drafter(CloverConfig.from_target_config(hf.config, num_heads=4),
                                              target=hf))
    out = tmp_path_factory.mktemp("clover-sensitive-ckpt")
    save_drafter(out, drafter, dtype=torch.float32)
    return out
