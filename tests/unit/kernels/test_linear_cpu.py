"""The float32 CPU linear kernel (vllm_clover/kernels/linear_cpu.py) and the dispatch patch that gives it
to vLLM's float32 linear layers (patches.cpu.install_fp32_linear_kernel)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_clover.kernels import linear_cpu

pytestmark = pytest.mark.skipif(not linear_cpu.supported(), reason="the float32 linear kernel needs AVX-512 or AVX2")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


# (1001, 300): a partial last column vector, and k in 3 chunks where row tiles share them (AVX2).
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (33, 17), (1, 5), (16, 1), (200, 64), (24, 40), (8, 9),
                                 (1001, 300)])
def test_matches_float64_reference(n: int, k: int) -> None:
    torch.manual_seed(n * 1000 + k)
    w = torch.randn(n, k)
    packed = linear_cpu.pack_weight(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 25, 29, 241, 300):  # tile edges of both ISAs
        x = torch.randn(m, k)
        y = linear_cpu.linear(x, packed, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), _reference(x, w), atol=1e-4 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(3072, 576), (1001, 300)])
def test_row_result_does_not_depend_on_the_row_count(n: int, k: int) -> None:
    """Each output is one in-order FMA chain: a row gives the same bits alone, in a tree-sized
    call and in a prefill-sized one (what keeps greedy speculative decoding token-identical),
    also where row tiles take turns on chunks of k (AVX2, more than 8 rows) and resume their
    sums from the output, a partial last vector included."""
    torch.manual_seed(0)
    w = torch.randn(n, k)
    packed = linear_cpu.pack_weight(w)
    x = torch.randn(300, k)
    full = linear_cpu.linear(x, packed, n)
    for m in (1, 2, 3, 4, 6, 7, 8, 10, 12, 13, 14, 36, 250):
        part = linear_cpu.linear(x[:m], packed, n)
        assert torch.equal(part, full[:m]), m
    for i in (0, 5, 6, 11, 13, 14, 239, 240, 299):  # tile and panel edges
        assert torch.equal(linear_cpu.linear(x[i:i + 1], packed, n)[0], full[i]), i


@pytest.mark.parametrize("n,k", [(960, 576), (4096, 576), (33, 17), (1, 5), (200, 64)])
def test_bfloat16_weights_match_the_rounded_weights_product(n: int, k: int) -> None:
    """pack_weight(W, bfloat16): W rounded to nearest-even bfloat16, then float32 products
    and sums, so the reference is the float64 product over W.bfloat16()."""
    torch.manual_seed(n * 7 + k)
    w = torch.randn(n, k)
    packed = linear_cpu.pack_weight(w, torch.bfloat16)
    assert packed.shape == ((n + 15) // 16, k, 16) and packed.dtype == torch.bfloat16
    for m in (1, 2, 3, 6, 7, 14, 15, 29, 241):
        x = torch.randn(m, k)
        y = linear_cpu.linear(x, packed, n)
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), _reference(x, w.bfloat16().float()), atol=1e-4 * k ** 0.5, rtol=1e-5)
    # and not the float32 weights' product: the bfloat16 path really ran
    x = torch.randn(4, k)
    assert not torch.equal(linear_cpu.linear(x, packed, n), linear_cpu.linear(x, linear_cpu.pack_weight(w), n))


def test_bfloat16_weights_row_result_does_not_depend_on_the_row_count() -> None:
    torch.manual_seed(4)
    packed = linear_cpu.pack_weight(torch.randn(1000, 576), torch.bfloat16)
    x = torch.randn(30, 576)
    full = linear_cpu.linear(x, packed, 1000)
    for m in (1, 3, 7, 14, 15):
        assert torch.equal(linear_cpu.linear(x[:m], packed, 1000), full[:m]), m


def test_bias_leading_dims_and_strided_input() -> None:
    torch.manual_seed(1)
    w, bias = torch.randn(40, 24), torch.randn(40)
    packed = linear_cpu.pack_weight(w)
    x = torch.randn(2, 3, 48)[..., ::2]  # [2, 3, 24], not contiguous
    y = linear_cpu.linear(x, packed, 40, bias)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.double(), _reference(x.reshape(6, 24), w, bias).reshape(2, 3, 40),
                               atol=1e-4, rtol=1e-5)
    assert linear_cpu.linear(torch.randn(0, 24), packed, 40).shape == (0, 40)


def test_refuses_wrong_inputs() -> None:
    w = torch.randn(32, 16)
    packed = linear_cpu.pack_weight(w)
    with pytest.raises(ValueError, match="float32"):
        linear_cpu.pack_weight(w.bfloat16())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        linear_cpu.pack_weight(w, torch.float16)
    with pytest.raises(RuntimeError, match="linear_bf16w: packed weight must be a contiguous BFloat16"):
        torch.ops.vllm_clover_cpu.linear_bf16w(torch.randn(2, 16), packed, 32, None)
    with pytest.raises(RuntimeError, match="float32"):
        linear_cpu.linear(torch.randn(2, 16).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        linear_cpu.linear(torch.randn(2, 15), packed, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        linear_cpu.linear(torch.randn(2, 16), packed, 48)


def test_compiles_with_dynamic_row_counts() -> None:
    """vLLM compiles the model (fullgraph, dynamic token count): the op needs its fake."""
    torch.manual_seed(2)
    w = torch.randn(64, 32)
    packed = linear_cpu.pack_weight(w)
    fn = torch.compile(lambda x: linear_cpu.linear(x, packed, 64).relu(), dynamic=True, fullgraph=True)
    for m in (1, 3, 17):
        x = torch.randn(m, 32)
        assert torch.equal(fn(x), linear_cpu.linear(x, packed, 64).relu())


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True), ("", True)])
def test_enabled_switch(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv(linear_cpu.ENV_VAR, value)
    assert linear_cpu.enabled() is expected


def test_enabled_switch_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(linear_cpu.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=linear_cpu.ENV_VAR):
        linear_cpu.enabled()


# ------------------------------------------------------------------ the dispatch patch
def _layer(dtype: torch.dtype, n: int = 48, k: int = 32) -> nn.Module:
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(n, k).to(dtype), requires_grad=False)
    return layer


def test_patched_dispatch_gives_float32_layers_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers import utils

    from vllm_clover.cpu import linear as cpu_linear
    from vllm_clover.patches import cpu as cpu_patches
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)
    cpu_patches.install_fp32_linear_kernel()
    cpu_patches.install_fp32_linear_kernel()  # idempotent: one wrapper
    dispatch = utils.dispatch_cpu_unquantized_gemm
    assert getattr(dispatch, "__vllm_clover_wrapped__") and not getattr(
        dispatch.__wrapped__, "__vllm_clover_wrapped__", False)

    torch.manual_seed(3)
    layer = _layer(torch.float32)
    w = layer.weight.detach().clone()
    dispatch(layer, remove_weight=True)
    assert layer.weight.numel() == 0  # freed, as vLLM's own dispatch does
    x = torch.randn(5, 32)
    y = utils.cpu_unquantized_gemm(layer, x, layer.weight)
    torch.testing.assert_close(y.double(), _reference(x, w), atol=1e-4, rtol=1e-5)

    kept = _layer(torch.float32)
    dispatch(kept, remove_weight=False)  # the LM head: the embedding still needs the weight
    assert kept.weight.shape == (48, 32)

    # Other dtypes, and float32 with the switch off, go to vLLM's dispatch.
    bf16 = _layer(torch.bfloat16)
    assert not cpu_linear.uses_fp32_kernel(bf16)
    monkeypatch.setenv(linear_cpu.ENV_VAR, "0")
    assert not cpu_linear.uses_fp32_kernel(_layer(torch.float32))
    off = _layer(torch.float32)
    w_off = off.weight.detach().clone()
    dispatch(off, remove_weight=False)
    torch.testing.assert_close(utils.cpu_unquantized_gemm(off, x, off.weight), x @ w_off.t())
