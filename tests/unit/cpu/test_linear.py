"""The drafter's packed linears (vllm_clover/cpu/linear.py: oneDNN's, or the float32 kernel's
with float32 or bfloat16 weights) give F.linear's results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_clover.model.config import CloverConfig
from vllm_clover.cpu import linear as cpu_linear
from vllm_clover.kernels import linear_cpu
from vllm_clover.cpu.linear import (KernelLinear, PackedLinear, drafter_product, onednn_available, onednn_bf16_matmul,
                                    pack_linears)
from vllm_clover.model.drafter import CloverDrafter

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs vLLM's CPU build with oneDNN")
needs_bf16 = pytest.mark.skipif(not onednn_bf16_matmul(), reason="oneDNN multiplies bfloat16 with AVX-512 or AMX only")
needs_kernel = pytest.mark.skipif(not linear_cpu.supported(), reason="the float32 linear kernel needs AVX-512 or AVX2")


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96) if bias else None
    x = torch.randn(rows, 64)
    torch.testing.assert_close(PackedLinear(w, b)(x), nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # Leading dimensions are kept; a non-contiguous input is fine.
    x3 = torch.randn(64, 2, rows).transpose(0, 2)
    torch.testing.assert_close(PackedLinear(w, b)(x3), nn.functional.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def _small_drafter(seed: int, num_heads: int) -> CloverDrafter:
    """A Clover-2 drafter (hidden 64, vocab 100, one Augmenting layer) with random weights."""
    torch.manual_seed(seed)
    cfg = CloverConfig(hidden_size=64, vocab_size=100, num_heads=num_heads, num_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128)
    drafter = CloverDrafter(cfg).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.05)
    drafter.bind_target(torch.randn(100, 64) * 0.1)
    return drafter


def test_pack_linears_keeps_the_drafter_outputs() -> None:
    """Every plain nn.Linear of a Clover-2 drafter is packed; trunk fusion and both head
    kinds give the same states and outputs as before; parameters stay in state_dict."""
    drafter = _small_drafter(seed=1, num_heads=3)
    x, y, prev = torch.randn(5, 64), torch.randint(0, 100, (5,)), torch.randint(0, 100, (5,))
    with torch.inference_mode():
        ref = [drafter.fuse(x, y), *drafter.head_step(x, prev, 0), *drafter.head_step(x, prev, 1)]
        keys = set(drafter.state_dict())
        n = pack_linears(drafter)
        got = [drafter.fuse(x, y), *drafter.head_step(x, prev, 0), *drafter.head_step(x, prev, 1)]
    # Attention Decoders 2 x (q, k, v), head0_proj, head_proj, and (this pure-PyTorch drafter's
    # own Augmenting layer) q, k, v, o, gate, up, down; in vLLM that layer is vLLM's.
    assert n == sum(type(m) is nn.Linear for m in drafter.modules()) == 15
    assert set(drafter.state_dict()) == keys
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_packed_linear_refuses_a_non_matrix() -> None:
    with pytest.raises(ValueError, match="2-D weight"):
        PackedLinear(torch.randn(3))


@needs_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_in_bfloat16_takes_and_gives_float32(bias: bool) -> None:
    """compute_dtype=bfloat16: float32 in and out, the product over bfloat16 copies (as
    F.linear over bfloat16-rounded operands), the bias added in float32."""
    torch.manual_seed(2)
    w, b = torch.randn(96, 64), torch.randn(96) if bias else None
    x = torch.randn(3, 64)
    got = PackedLinear(w, b, compute_dtype=torch.bfloat16)(x)
    assert got.dtype == torch.float32
    want = nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(), b)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
    # Far from the float32 product's own rounding, so the bfloat16 path really ran.
    assert not torch.equal(got, PackedLinear(w, b)(x))


def test_packed_linear_in_bfloat16_refuses_cpus_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2-only CPUs: a clear error at load naming the option, not oneDNN's primitive error."""
    monkeypatch.setattr(cpu_linear, "onednn_bf16_matmul", lambda: False)
    with pytest.raises(ValueError, match="AVX-512 or AMX.*VLLM_CLOVER_CPU_LINEAR.*draft_dtype 'auto' or 'float32'"):
        PackedLinear(torch.randn(8, 4), compute_dtype=torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_linear_in_both_weight_dtypes(bias: bool) -> None:
    """float32 weights: F.linear's result; bfloat16 weights: F.linear over the rounded weights
    with float32 inputs (only the weights are rounded), bias in float32; any leading shape."""
    torch.manual_seed(4)
    w, b = torch.randn(96, 64), torch.randn(96) if bias else None
    x = torch.randn(64, 2, 3).transpose(0, 2)  # [3, 2, 64], not contiguous
    torch.testing.assert_close(KernelLinear(w, b)(x), nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    got = KernelLinear(w, b, torch.bfloat16)(x)
    assert got.shape == (3, 2, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, nn.functional.linear(x, w.bfloat16().float(), b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2-D weight"):
        KernelLinear(torch.randn(3))


@needs_kernel
def test_drafter_product_picks_the_kernel_where_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 weights where the kernel runs: the kernel, bfloat16 as bfloat16 weights unless the
    CPU multiplies bfloat16 natively (oneDNN's primitive there); kernel off or bfloat16
    weights: oneDNN."""
    w = torch.randn(32, 16)
    monkeypatch.setattr(cpu_linear, "native_bf16_matmul", lambda: False)
    assert isinstance(drafter_product(w), KernelLinear)
    assert drafter_product(w, compute_dtype=torch.bfloat16).packed.dtype == torch.bfloat16
    if onednn_bf16_matmul():
        assert isinstance(drafter_product(w.bfloat16()), PackedLinear)
        monkeypatch.setattr(cpu_linear, "native_bf16_matmul", lambda: True)
        assert isinstance(drafter_product(w, compute_dtype=torch.bfloat16), PackedLinear)
    monkeypatch.setenv(linear_cpu.ENV_VAR, "0")
    assert isinstance(drafter_product(w), PackedLinear)


@pytest.mark.parametrize("path", ["onednn", "kernel"])
def test_pack_linears_in_bfloat16_stays_close(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """draft_dtype bfloat16: oneDNN's bf16 products (AVX-512 or AMX CPUs, kernel off), or
    bf16 weights in the float32 kernel (every CPU it builds for, AVX2 included)."""
    if path == "onednn":
        if not onednn_bf16_matmul():
            pytest.skip("oneDNN multiplies bfloat16 with AVX-512 or AMX only")
        monkeypatch.setenv(linear_cpu.ENV_VAR, "0")
    else:
        if not linear_cpu.supported():
            pytest.skip("the float32 linear kernel needs AVX-512 or AVX2")
        monkeypatch.setattr(cpu_linear, "native_bf16_matmul", lambda: False)
    drafter = _small_drafter(seed=3, num_heads=2)
    x, prev = torch.randn(5, 64), torch.randint(0, 100, (5,))
    with torch.inference_mode():
        ref = drafter.head_step(x, prev, 1)
        pack_linears(drafter, torch.bfloat16)
        got = drafter.head_step(x, prev, 1)
    assert isinstance(drafter.head_proj.forward, PackedLinear if path == "onednn" else KernelLinear)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


def test_draft_matmul_dtype_resolution() -> None:
    from vllm_clover.cpu.linear import draft_matmul_dtype, fp32_kernel_usable, native_bf16_matmul

    auto = torch.bfloat16 if native_bf16_matmul() or fp32_kernel_usable() else torch.float32
    assert draft_matmul_dtype("auto", torch.float32) == auto
    assert draft_matmul_dtype("auto", torch.bfloat16) == torch.bfloat16  # already half the bytes
    assert draft_matmul_dtype("float32", torch.float32) == torch.float32
    assert draft_matmul_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert draft_matmul_dtype("float32", torch.bfloat16) == torch.float32
