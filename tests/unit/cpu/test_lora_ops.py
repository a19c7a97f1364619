"""The CPU LoRA ops with rows without an adapter left alone (vllm_clover/cpu/lora_ops.py, patch
``cpu-lora-no-adapter-rows``), against vLLM's own ops and a per-row reference."""

from __future__ import annotations

import inspect

import pytest
import torch

from vllm_clover.cpu.lora_ops import skip_rows_without_adapter


def _ops():
    from vllm.lora.ops.torch_ops import lora_ops

    return {name: inspect.unwrap(getattr(lora_ops, name)) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, d_in, rank, d_out, slots = 5, 12, 4, 10, 1  # one adapter slot: vLLM's default max_loras
    return dict(x=torch.randn(rows, d_in, generator=gen), h=torch.randn(rows, rank, generator=gen),
                a=torch.randn(slots, 1, rank, d_in, generator=gen), b=torch.randn(slots, 1, d_out, rank, generator=gen),
                y=torch.randn(rows, d_out + 6, generator=gen), idx=torch.tensor([0, -1, 0, -1, -1]))


def _call(op_name, op, c, idx, y):
    if op_name == "bgmv_shrink":
        out = torch.zeros(c["x"].shape[0], c["a"].shape[2])
        op(c["x"], c["a"], out, idx, 0.5)
        return out
    if op_name == "bgmv_expand":
        op(c["h"], c["b"], y, idx, True)
        return y
    op(c["h"], c["b"], y, idx, 3, c["b"].shape[2], True)
    return y


@pytest.mark.parametrize("name", ["bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"])
def test_rows_without_adapter_untouched(name: str) -> None:
    op = _ops()[name]
    fixed = skip_rows_without_adapter(op)
    c = _case()
    before = c["y"].clone()
    got = _call(name, fixed, c, c["idx"], c["y"].clone())
    # Rows with the adapter: vLLM's op on those rows alone; rows without: what was there.
    keep = c["idx"] == 0
    ref = _call(name, op, {**c, "x": c["x"][keep], "h": c["h"][keep]}, c["idx"][keep], before[keep].clone())
    assert torch.equal(got[keep], ref)
    untouched = torch.zeros_like(got[~keep]) if name == "bgmv_shrink" else before[~keep]
    assert torch.equal(got[~keep], untouched)
    # vLLM's own op applies the one adapter slot to the -1 rows (the bug; the test has power).
    assert not torch.equal(_call(name, op, c, c["idx"], c["y"].clone())[~keep], untouched)


@pytest.mark.parametrize("name", ["bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"])
def test_all_rows_with_or_without_adapter(name: str) -> None:
    op = _ops()[name]
    fixed = skip_rows_without_adapter(op)
    c = _case(1)
    every = torch.zeros(5, dtype=torch.long)
    assert torch.equal(_call(name, fixed, c, every, c["y"].clone()), _call(name, op, c, every, c["y"].clone()))
    none = torch.full((5,), -1)
    before = torch.zeros(5, c["a"].shape[2]) if name == "bgmv_shrink" else c["y"]
    assert torch.equal(_call(name, fixed, c, none, c["y"].clone()), before)


def test_patch_installed_on_cpu_lora_ops() -> None:
    """After the plugin loads, vLLM's CPU LoRA ops (module and package names) are the fixed ones."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops

    from vllm_clover.cpu import env as cpu_env
    from vllm_clover.patches import apply_all
    from vllm_clover.patches.patching import patched_by

    if not cpu_env.is_cpu_platform():
        pytest.skip("the patch applies on vLLM's CPU platform only")
    apply_all()
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        assert patched_by(getattr(lora_ops, name)) == "cpu-lora-no-adapter-rows"
        assert getattr(torch_ops, name) is getattr(lora_ops, name)
