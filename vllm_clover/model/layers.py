"""The drafter's building blocks: RMSNorm, the Attention Decoder, the Medusa ResBlock and the
Augmenting Block's Llama decoder layer (with its RoPE tables and attention mask).

Parameter names follow Hugging Face Llama and the official Clover-2 code, so checkpoints and
vLLM's ``LlamaDecoderLayer`` load them unchanged (the name table is in ``drafter.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_clover.model.config import CloverConfig

Tensor = torch.Tensor


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``, statistics in float32. [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight, exactly as HF LlamaRMSNorm / the official code do.
        return self.weight * x32.to(dtype)


class AttentionDecoder(nn.Module):
    """Clover "Attention Decoder" (official ``ResAttentionBlock``).

    A per-position gate between a hidden state ``h`` and ONE token embedding ``e``; it does
    not attend over the sequence, hence no softmax and no mask::

        q = W_q RMSNorm(h) + b_q,  k = W_k e + b_k,  v = W_v e + b_v     (all H -> H)
        a_j = cos(q_j, k_j)                          per head j, head size H / n_h
        out = h + concat_j(a_j v_j)                  residual on un-normalised h, no out-proj

    Shapes: h, e [..., H] -> [..., H].
    """

    def __init__(self, hidden_size: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = hidden_size // num_heads
        self.eps = eps
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.q = nn.Linear(hidden_size, hidden_size)
        self.k = nn.Linear(hidden_size, hidden_size)
        self.v = nn.Linear(hidden_size, hidden_size)

    def forward(self, h: Tensor, e: Tensor) -> Tensor:
        split = h.shape[:-1] + (self.num_heads, self.head_size)
        q = self.q(self.input_layernorm(h)).view(split)
        k = self.k(e).view(split)
        v = self.v(e).view(split)
        # eps = rms_norm_eps, as the official code passes it to F.cosine_similarity.
        gate = F.cosine_similarity(q, k, dim=-1, eps=self.eps)  # [..., n_h]
        return h + (gate.unsqueeze(-1) * v).reshape(h.shape)


class ResBlock(nn.Module):
    """Medusa ResBlock ``x + SiLU(W x + b)`` (Clover-1 per-head projector). [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Neox/HF-style rotary tables. positions [B, T] -> cos, sin [B, T, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to x [B, n, T, d] with cos/sin [B, T, d] (rotate-half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def build_attention_mask(attention_mask: Tensor | None, q_len: int, past_len: int,
                         batch: int, device: torch.device) -> Tensor:
    """Boolean causal + padding mask for SDPA, True = may attend.

    attention_mask: [B, past_len + q_len] with 1 for real tokens (None = all real).
    Returns [B, 1, q_len, past_len + q_len]. Every query may always see itself, so rows of
    padded queries are never fully masked (SDPA would return NaN); their outputs are
    garbage, which is fine because padded positions are masked out of the loss.
    """
    total = past_len + q_len
    q_pos = torch.arange(past_len, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    causal = k_pos <= q_pos  # [T, S]
    mask = causal[None, None].expand(batch, 1, q_len, total)
    if attention_mask is not None:
        valid = attention_mask[:, None, None, :].to(torch.bool)
        mask = (mask & valid) | (k_pos == q_pos)[None, None]
    return mask


class AugAttention(nn.Module):
    """Llama causal GQA self-attention (HF parameter names, no biases). [B, T, H] -> [B, T, H]."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past_kv: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, H]; cos/sin [B, T, d]; mask [B, 1, T, S] bool; past k/v [B, n_kv, P, d]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if past_kv is not None:
            k = torch.cat((past_kv[0], k), dim=2)
            v = torch.cat((past_kv[1], v), dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class AugMLP(nn.Module):
    """Llama SwiGLU MLP: ``down(silu(gate(x)) * up(x))``. [..., H] -> [..., H]."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AugmentingLayer(nn.Module):
    """One Augmenting-Block layer = a pre-norm Llama decoder layer.

    Parameter names match HF ``LlamaDecoderLayer`` so vLLM's LlamaDecoderLayer loads them.
    """

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.self_attn = AugAttention(config)
        self.mlp = AugMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past_kv: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, H] -> ([B, T, H], this layer's full (k, v) cache [B, n_kv, P+T, d])."""
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_kv)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv
