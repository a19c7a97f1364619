"""The Clover drafter as a vLLM model: ``CloverForSpeculativeDecoding``.

Registered (lazily, by name) from ``vllm_clover.plugin.register`` and reached through
vLLM's medusa slot: ``MedusaProposer.load_model`` calls ``get_model`` on the draft
``ModelConfig`` whose config.json names this architecture.

It is :class:`vllm_clover.model.drafter.CloverDrafter` (same parameter names, same maths) with
the Augmenting-Block layers replaced by vLLM ``LlamaDecoderLayer``s. Their ``Attention``
modules register in vLLM's static forward context under unique names
(``clover.layers.<num_target_layers + i>``), so vLLM's KV-cache manager gives them paged
KV cache in the target's KV-cache group, with the target's block tables and slots.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaDecoderLayer

from vllm_clover.model.checkpoint import CloverCheckpointError
from vllm_clover.model.config import CloverConfig, CloverConfigError
from vllm_clover.engine.options import CloverOptions
from vllm_clover.model.drafter import CloverDrafter

# HF checkpoint names -> vLLM's fused parameters (param suffix, checkpoint suffix, shard).
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)
_PER_HEAD = re.compile(r"^head_(?:decoders|resblocks)\.(\d+)\.")


class _AugLayer(LlamaDecoderLayer):
    """A target-shaped Llama layer that is never quantised with the target's scheme:
    Clover checkpoints hold plain weights whatever the target's quantisation."""

    def get_quant_config(self, vllm_config: VllmConfig) -> None:
        return None


def clover_config_from_hf(hf_config: Any) -> CloverConfig:
    """The draft ``MedusaConfig`` (config.json + vLLM's edits) -> CloverConfig.

    vLLM sets ``num_heads`` to num_speculative_tokens (K) and ``vocab_size`` to the
    target's; the front end has already checked both against the checkpoint.
    """
    try:
        return CloverConfig.from_dict(hf_config.to_dict(), source="draft config")
    except CloverConfigError as exc:
        raise CloverCheckpointError(str(exc)) from None


def aug_layer_config(cfg: CloverConfig, max_positions: int) -> LlamaConfig:
    """HF LlamaConfig for the Augmenting-Block layers (RoPE base from the checkpoint, 10000
    for official ones; rope table long enough for every target position)."""
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=max(cfg.max_position_embeddings, max_positions),
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False,
        mlp_bias=False,
    )


def run_custom_ops_natively(module: nn.Module) -> int:
    """Point every vLLM ``CustomOp`` under ``module`` (the Augmenting-Block layers' RMSNorms,
    rotary embedding, SiluAndMul) at its platform kernel, as vLLM dispatches an enabled op
    (``CustomOp.dispatch_forward``: ``forward_cpu`` on CPU, ``forward_cuda`` on CUDA, ...);
    on CPU, RMSNorm calls vLLM's C kernels (:func:`_cpu_rms_norm_forward`). Returns how many
    ops were set.

    Why: when the target is compiled (``vllm serve``'s default), vLLM disables custom ops
    and wraps each one's ``forward_native`` in ``torch.compile``. The drafter runs eagerly,
    so every call of such an op pays a compiled region's guards and wrappers: the trunk is
    17% faster with this (docs/tree-verification.md). Eager engines dispatch the same kernels
    already (custom ops enabled).
    Catalogue entry ``drafter-custom-ops-eager``."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.platforms import current_platform

    count = 0
    for m in module.modules():
        if isinstance(m, CustomOp):
            m._forward_method = _platform_forward(m, current_platform)
            if current_platform.is_cpu() and type(m) is RMSNorm:
                m._forward_method = _cpu_rms_norm_forward(m) or m._forward_method
            count += 1
    return count


def _cpu_rms_norm_forward(norm: Any) -> Any:
    """RMSNorm.forward through vLLM's CPU C kernels (``torch.ops._C.rms_norm`` /
    ``fused_add_rms_norm``, what its CUDA forward calls), or None where they do not apply.

    Why: RMSNorm has no ``forward_cpu``; its ``forward_native`` goes through vLLM's IR op
    dispatch, whose C implementation is registered for GPUs only, to 7 PyTorch ops, about 5x
    the C kernel's time for a few rows (docs/tree-verification.md). Same math (float
    accumulation; in bf16 the weight multiply rounds once instead of twice)."""
    if (not norm.has_weight or norm.variance_size_override is not None
            or not hasattr(torch.ops._C, "rms_norm") or not hasattr(torch.ops._C, "fused_add_rms_norm")):
        return None

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        weight = norm.weight.data
        if x.dtype != weight.dtype or not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            return norm.forward_native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, norm.variance_epsilon)
            return out
        # The kernel works in place; on copies, callers' tensors stay as forward_native leaves them.
        x, residual = x.clone(), residual.clone()
        torch.ops._C.fused_add_rms_norm(x, residual, weight, norm.variance_epsilon)
        return x, residual

    return forward


def _platform_forward(op: Any, platform: Any) -> Any:
    """The forward ``CustomOp.dispatch_forward`` returns for an enabled op (same order)."""
    for test, name in (("is_rocm", "forward_hip"), ("is_cpu", "forward_cpu"), ("is_tpu", "forward_tpu"),
                       ("is_xpu", "forward_xpu"), ("is_out_of_tree", "forward_oot")):
        if getattr(platform, test)():
            return getattr(op, name)
    return op.forward_cuda


class CloverForSpeculativeDecoding(nn.Module):
    """Clover drafter inside vLLM. Parameters live under ``drafter.`` (a CloverDrafter)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        draft_hf = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = clover_config_from_hf(draft_hf)
        options = CloverOptions.from_vllm_config(vllm_config)
        if options.tree:
            # vLLM set num_heads to num_speculative_tokens, which is the tree's node count in
            # tree mode; the drafter keeps every head of the checkpoint (one per depth).
            self.config = dataclasses.replace(self.config, num_heads=options.checkpoint_num_heads)
        target = vllm_config.model_config
        first = target.hf_text_config.num_hidden_layers
        layer_cfg = aug_layer_config(self.config, target.max_model_len)
        # One integer per name (extract_layer_index), after the target's layer indices.
        self.layer_prefixes = [f"{prefix + '.' if prefix else ''}clover.layers.{first + i}"
                               for i in range(self.config.num_layers)]
        self.drafter = CloverDrafter(
            self.config,
            make_layer=lambda i: _AugLayer(vllm_config, prefix=self.layer_prefixes[i], config=layer_cfg))
        self.attn_layer_names = [p + ".self_attn.attn" for p in self.layer_prefixes]
        self._aug_linear_weights: list[tuple[nn.Module, torch.Tensor]] = []
        run_custom_ops_natively(self.drafter)

    def bind_target(self, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor | None = None) -> None:
        """Share the target's lm_head weight [V, H] (and E, default = that weight)."""
        self.drafter.bind_target(lm_head_weight, embed_weight)

    def trunk(self, x: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """z = RMSNorm_c(Aug(AttnDec_1(x, E[y]))) over flattened scheduled rows.

        x [N, H] target pre-final-norm hidden states; next_tokens [N] (y_{t+1});
        positions [N]. Must run inside ``set_forward_context`` with paged-attention
        metadata for ``attn_layer_names``. Returns z [N, H].
        """
        h = self.drafter.fuse(x, next_tokens)
        residual = None
        for layer in self.drafter.layers:
            h, residual = layer(positions, h, residual)
        return self.drafter.trunk_norm(h + residual)

    forward = trunk

    def head_step(self, state: torch.Tensor, prev_token: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Head i on a flat batch: state [B, H], prev_token [B] -> (state', o_i [B, H])."""
        return self.drafter.head_step(state, prev_token, i)

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """Target LMHead(o): [B, H] -> float32 [B, V]."""
        return self.drafter.logits(o).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load our checkpoint names (HF names in the Aug layers) into vLLM parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            head = _PER_HEAD.match(name)
            if head and int(head.group(1)) >= self.config.num_heads:
                continue  # Clover-1 head beyond the K heads in use
            full = "drafter." + name
            for param_suffix, ckpt_suffix, shard in STACKED_PARAMS:
                if full.startswith("drafter.layers.") and ckpt_suffix in full:
                    target = full.replace(ckpt_suffix, param_suffix)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    loaded.add(target)
                    break
            else:
                if full not in params:
                    raise CloverCheckpointError(f"unexpected weight {name!r} in the Clover checkpoint")
                param = params[full]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(full)
        # vLLM's CPU dispatch frees each linear's weight once it has packed it (after this
        # method); the proposer may repack them in another dtype (draft_dtype), so keep them
        # until it has (take_aug_linear_weights).
        self._aug_linear_weights = [(m, m.weight.data) for m in self.drafter.layers.modules()
                                    if isinstance(m, LinearBase)]
        return loaded

    def take_aug_linear_weights(self) -> list[tuple[nn.Module, torch.Tensor]]:
        """The Augmenting-Block layers' vLLM linears and their loaded weights, once (then freed)."""
        taken, self._aug_linear_weights = self._aug_linear_weights, []
        return taken
