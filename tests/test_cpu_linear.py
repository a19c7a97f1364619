"""oneDNN-packed drafter linears (vllm_clover/cpu_linear.py) give F.linear's results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_clover.config import CloverConfig
from vllm_clover.cpu_linear import PackedLinear, onednn_available, pack_linears
from vllm_clover.model import CloverDrafter

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs vLLM's CPU build with oneDNN")


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


def test_pack_linears_keeps_the_drafter_outputs() -> None:
    """Every plain nn.Linear of a Clover-2 drafter is packed; trunk fusion and both head
    kinds give the same states and outputs as before; parameters stay in state_dict."""
    torch.manual_seed(1)
    cfg = CloverConfig(hidden_size=64, vocab_size=100, num_heads=3, num_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, intermediate_size=128)
    drafter = CloverDrafter(cfg).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.05)
    drafter.bind_target(torch.randn(100, 64) * 0.1)
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
