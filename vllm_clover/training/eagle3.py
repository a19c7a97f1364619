"""EAGLE-3 baseline in the format vLLM 0.32 loads (``vllm-clover train --method eagle3``).

What vLLM computes (vllm/model_executor/models/llama_eagle3.py, ``Eagle3LlamaForCausalLM``)
------------------------------------------------------------------------------------------
The target hands over its residual stream a^{(i)}_t at three layers i (``aux`` ids; value
``hidden_states + residual`` before layer i, index L = the pre-final-norm stream, models/
interfaces.py ``_maybe_add_hidden_state``). Without ``eagle_aux_hidden_state_layer_ids`` in the
draft config vLLM picks (2, L // 2, L - 3) (interfaces.py ``get_eagle3_default_aux_hidden_state_layers``;
SmolLM2-135M, L = 30: 2, 15, 27); we always write the ids into the config, so vLLM uses exactly
the layers we trained on (v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``)::

    g_t   = fc([a^{(i1)}_t ; a^{(i2)}_t ; a^{(i3)}_t])        fc.weight [H, 3H], ascending layer ids
    one decoder layer on (h, token):
      x   = [input_layernorm(E[token]) ; hidden_norm(h)]     [2H]: q/k/v_proj take 2H inputs
      r   = h + o_proj(attn(x))                               residual = h BEFORE hidden_norm
      pre = r + mlp(post_attention_layernorm(r))              the step's output, fed back as h
    logits = lm_head(norm(pre))                               [V_d]: the draft vocabulary only
    draft  = argmax + d2t[argmax]                             d2t[i] = target id of draft id i, minus i

Step 0 at position t reads h = g_t and token y_{t+1} and predicts y_{t+2}; draft step j >= 1
reads (its own pre of step j-1, its draft d_j) at position t+j, attending to the first pass's
KV at positions <= t and to the chain's own steps (v1/spec_decode/llm_base_proposer.py
``propose``: ``combine_hidden_states`` on the target's states, then the model's second output
fed back). No embedding in the file: vLLM shares the target's (``has_own_embed_tokens`` False);
the LM head is the draft's own [V_d, H] (``has_own_lm_head`` True).

Training (EAGLE-3's training-time test, SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``)
-------------------------------------------------------------------------------------
The drafter is unrolled for ``num_heads`` steps over every position at once: step k at t reads
its own step-(k-1) output at t and the TRUE token y_{t+1+k}, at RoPE position t+k; its query
attends to step 0's keys at positions <= t and to the keys of steps 1..k at t (a diagonal per
step), which is exactly what the KV-cached chain above sees when the drafts are right
(``test_ttt_equals_the_kv_cached_chain``). Loss of step k: soft-label cross-entropy against the
target's distribution over the draft vocabulary, softmax(z_{t+1+k}[vocab]), on positions whose
input token y_{t+1+k} is an assistant token and whose target argmax lies in the draft
vocabulary; steps weighted 0.8^k. Features (a^{(i)}, the target's logits) are computed on the
fly for every batch from token ids, with forward hooks on the target's decoder layers.

Draft vocabulary: the 4,096 tokens the shipped Clover heads serve (``draft_vocab.json``, most
frequent response tokens) when the target is theirs, else the ranking of the training data.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_clover.model.config import CONFIG_NAME, CloverConfig
from vllm_clover.model.layers import AugMLP, RMSNorm, _rotate, build_attention_mask, rope_cos_sin
from vllm_clover.training.args import TrainArgs, TrainingError, device_name, log, resolve_device
from vllm_clover.training.baselines import EAGLE3_ARCHITECTURE, FORMAT_VERSION, WEIGHTS_NAME, _EAGLE_DROP_KEYS, \
    _target_info, _write_atomic, shape_config

Tensor = torch.Tensor
KV = tuple[Tensor, Tensor]  # (k, v), each [B, n_kv, S, head_dim]

DRAFT_VOCAB_SIZE = 4096  # what the shipped Clover heads serve (serve default draft_vocab_size)
STEP_DECAY = 0.8  # EAGLE-3's weight of training-time-test step k: 0.8^k


# ============================================================================ layers and vocabulary
def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default aux layers (2, L // 2, L - 3); for targets too shallow for three
    distinct ones (L < 7: tests' tiny targets), (0, L // 2, L). Ascending."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and ids[0] < ids[1] < ids[2] <= num_layers:
        return ids
    if num_layers < 2:
        raise TrainingError(f"EAGLE-3 needs a target with at least 2 layers (has {num_layers})")
    return (0, num_layers // 2, num_layers)


def data_vocab_ranking(ds, vocab_size: int) -> Tensor:
    """All ids ranked like ``draft_vocab.token_ranking``: count as an assistant token, then
    anywhere, then low id first (:func:`draft_vocab.rank_tokens`). ``ds[i]``: {"input_ids",
    "loss_mask"}. long [V]."""
    from vllm_clover.model.draft_vocab import rank_tokens

    items = [ds[i] for i in range(len(ds))]
    ids = np.concatenate([item["input_ids"].numpy() for item in items])
    mask = np.concatenate([item["loss_mask"].numpy() for item in items])
    return torch.from_numpy(rank_tokens(ids, mask, vocab_size).astype(np.int64))


def draft_vocabulary(target: Path, target_config: Mapping[str, Any], ds, size: int
                     ) -> tuple[Tensor, str]:
    """(sorted long [size] draft vocabulary, where it came from): the shipped Clover heads'
    ``draft_vocab.json`` when they were trained for this target (name, hidden and vocab
    size), else the training data's ranking (``ds.token_ranking``: a corpus's own, or
    :func:`data_vocab_ranking`)."""
    from vllm_clover.model.draft_vocab import load_draft_vocab
    from vllm_clover.training.train import shipped_heads_dir

    vocab_size = int(target_config["vocab_size"])
    if not 1 <= size <= vocab_size:
        raise TrainingError(f"EAGLE-3 draft vocabulary size must be in 1..{vocab_size}, got {size}")
    heads = shipped_heads_dir()
    try:
        shipped = json.loads((heads / CONFIG_NAME).read_text())
        fits = (shipped["clover"]["target"]["name"] == target.name
                and shipped["hidden_size"] == target_config["hidden_size"] and shipped["vocab_size"] == vocab_size)
    except (OSError, ValueError, KeyError, TypeError):
        fits = False
    if fits:
        ids, source = load_draft_vocab(heads, size, vocab_size), f"shipped Clover heads {heads.name}"
    else:
        ids, source = ds.token_ranking(vocab_size)[:size], "training data ranking"
    return torch.sort(ids).values, source


# ============================================================================ the target's features
class AuxFeatures:
    """The target's aux-layer residual streams and its logits over the draft vocabulary.

    Loads the target with transformers in ``dtype``; forward pre-hooks on the decoder layers
    ``layer_ids`` (and on the final norm for id L) read their input, the residual stream vLLM
    hands the drafter. ``vocab`` long [V_d]: the draft vocabulary (target ids).
    """

    def __init__(self, target: Path, layer_ids: Sequence[int], vocab: Tensor, dtype: str,
                 device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype)).eval()
        self.decoder = model.model
        self.lm_head = model.lm_head.weight.detach().to(device)  # [V, H]
        self.decoder.to(device)
        self.layer_ids = tuple(layer_ids)
        self.vocab = vocab.to(device)
        self.device = device
        n = len(self.decoder.layers)
        hooked = [self.decoder.layers[i] if i < n else self.decoder.norm for i in self.layer_ids]
        self._captured: dict[int, Tensor] = {}
        for i, module in zip(self.layer_ids, hooked):
            module.register_forward_pre_hook(self._catcher(i), with_kwargs=True)

    @property
    def embed_weight(self) -> Tensor:
        return self.decoder.embed_tokens.weight.detach()

    def _catcher(self, i: int):
        def hook(_module, args, kwargs):
            self._captured[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor, chunk_rows: int = 2048
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """ids, mask [B, T] (right padding) -> (aux [B, T, 3H] float32, the target's logits
        z_t over the draft vocabulary [B, T, V_d] float32, in_vocab [B, T] bool: argmax z_t
        over the FULL vocabulary is a draft-vocabulary token)."""
        self._captured.clear()
        mask = None if bool(attention_mask.all()) else attention_mask
        out = self.decoder(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        aux = torch.cat([self._captured[i].float() for i in self.layer_ids], dim=-1)
        b, t, h = out.shape
        rows = out.reshape(b * t, h)
        draft_logits, in_vocab = [], []
        member = torch.zeros(self.lm_head.shape[0], dtype=torch.bool, device=self.device)
        member[self.vocab] = True
        for r0 in range(0, rows.shape[0], chunk_rows):
            z = F.linear(rows[r0:r0 + chunk_rows], self.lm_head).float()  # [n, V]
            draft_logits.append(z[:, self.vocab])
            in_vocab.append(member[z.argmax(-1)])
        return aux, torch.cat(draft_logits).view(b, t, -1), torch.cat(in_vocab).view(b, t)


# ============================================================================ the drafter
class Eagle3Attention(nn.Module):
    """Llama GQA attention whose q/k/v read the 2H-wide [embedding ; hidden] input."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] -> q [B, n_q, T, d], k, v [B, n_kv, T, d] (RoPE on q and k)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v


class Eagle3Layer(nn.Module):
    """vLLM's EAGLE-3 decoder layer 0 (llama_eagle3.py ``LlamaDecoderLayer``, norm after residual)."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config)
        self.mlp = AugMLP(config)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def qkv(self, hidden: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden, embeds [B, T, H] -> q, k, v of x = [input_layernorm(e) ; hidden_norm(h)]."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        return self.self_attn.project(x, cos, sin)

    def finish(self, hidden: Tensor, attn: Tensor) -> Tensor:
        """hidden [B, T, H], attn [B, T, n_q*d] -> pre [B, T, H] (residual stream after the MLP)."""
        r = hidden + self.self_attn.o_proj(attn)
        return r + self.mlp(self.post_attention_layernorm(r))


def ttt_attention(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], mask0: Tensor) -> Tensor:
    """Attention of training-time-test step k = len(keys) - 1 (module docstring).

    q [B, n_q, T, d]; keys / values: per step 0..k [B, n_kv, T, d]; mask0 [B, 1, T, T] bool
    (causal + padding, True = may attend). The query at t sees step 0's keys at s <= t and
    step i's key at t (i = 1..k). Returns [B, T, n_q*d].
    """
    b, nq, t, d = q.shape
    rep = nq // keys[0].shape[1]
    k0, v0 = (x.repeat_interleave(rep, dim=1) for x in (keys[0], values[0]))
    scale = 1.0 / math.sqrt(d)
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~mask0, float("-inf"))]  # [B, n_q, T, T]
    scores += [(q * ki.repeat_interleave(rep, dim=1)).sum(-1, keepdim=True) * scale for ki in keys[1:]]
    w = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = w[..., :t] @ v0
    for i, vi in enumerate(values[1:]):
        out = out + w[..., t + i:t + i + 1] * vi.repeat_interleave(rep, dim=1)
    return out.transpose(1, 2).reshape(b, t, nq * d)


def shift_left(x: Tensor, n: int) -> Tensor:
    """x [B, T, ...] -> x[:, t + n] at t, zero past the end."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


class Eagle3Drafter(nn.Module):
    """EAGLE-3 draft model computing what vLLM's ``Eagle3LlamaForCausalLM`` computes.

    ``config``: the target's layer shapes and RoPE base (``baselines.shape_config("eagle", ...)``),
    num_heads = training-time-test steps and default draft length. ``layer_ids``: the three
    aux layers; ``vocab`` sorted long [V_d]: the draft vocabulary. Buffers ``d2t`` [V_d]
    (target id - draft id, what vLLM loads) and ``t2d`` [V] bool are saved with the weights.
    """

    def __init__(self, config: CloverConfig, layer_ids: Sequence[int], vocab: Tensor) -> None:
        super().__init__()
        self.config, self.layer_ids = config, tuple(layer_ids)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, len(vocab), bias=False)
        vocab = vocab.to(torch.long)
        self.register_buffer("d2t", vocab - torch.arange(len(vocab)))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[vocab] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("_embed_weight", None, persistent=False)

    @property
    def vocab(self) -> Tensor:
        """long [V_d]: target id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    @torch.no_grad()
    def init_from_target(self, norm_weight: Tensor, lm_head_weight: Tensor) -> "Eagle3Drafter":
        """Start the output side from the target's: norm = its final norm [H], lm_head = its LM
        head's draft-vocabulary rows [V_d, H] (the rest keeps PyTorch's default init)."""
        self.norm.weight.copy_(norm_weight)
        self.lm_head.weight.copy_(lm_head_weight[self.vocab.to(lm_head_weight.device)])
        return self

    def bind_target(self, embed_weight: Tensor) -> "Eagle3Drafter":
        """Attach the target's embedding [V, H] (frozen, not saved: vLLM shares the target's)."""
        self._embed_weight = embed_weight
        return self

    def embed(self, tokens: Tensor, dtype: torch.dtype) -> Tensor:
        if self._embed_weight is None:
            raise RuntimeError("Eagle3Drafter: call bind_target(embed) first")
        return F.embedding(tokens, self._embed_weight).to(dtype)

    def logits(self, pre: Tensor) -> Tensor:
        """pre [..., H] -> draft-vocabulary logits [..., V_d]."""
        return self.lm_head(self.norm(pre))

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step(self, hidden: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor,
             past_kv: KV | None = None) -> tuple[Tensor, KV]:
        """One KV-cached forward as vLLM's drafting runs it. hidden [B, T, H] (g of the target
        or the draft's own pre); tokens [B, T]; positions [B, T]; mask [B, 1, T, P+T] bool;
        past_kv [B, n_kv, P, d]. Returns pre [B, T, H] and the KV [B, n_kv, P+T, d]."""
        layer = self.layers[0]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        q, k, v = layer.qkv(hidden, self.embed(tokens, hidden.dtype), cos, sin)
        if past_kv is not None:
            k, v = torch.cat((past_kv[0], k), dim=2), torch.cat((past_kv[1], v), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        b, _, t, _ = q.shape
        return layer.finish(hidden, out.transpose(1, 2).reshape(b, t, -1)), (k, v)

    def teacher_forced(self, aux: Tensor, shifted_ids: Tensor, attention_mask: Tensor | None = None
                       ) -> tuple[Tensor, KV]:
        """vLLM's first pass: aux [B, T, 3H], shifted_ids [B, T] = y_{t+1} -> (pre, KV)."""
        b, t, _ = aux.shape
        positions = torch.arange(t, device=aux.device).expand(b, t)
        return self.step(self.fc(aux), shifted_ids, positions,
                         build_attention_mask(attention_mask, t, 0, b, aux.device))

    def forward_ttt(self, aux: Tensor, input_ids: Tensor, attention_mask: Tensor, steps: int) -> list[Tensor]:
        """Training-time test: aux [B, T, 3H], input_ids [B, T] = y_t (unshifted), attention_mask
        [B, T] -> [pre_0, ..., pre_{steps-1}], each [B, T, H]; step k at t read y_{t+1+k} at
        position t+k and predicts y_{t+2+k} (module docstring)."""
        b, t, _ = aux.shape
        layer = self.layers[0]
        hidden = self.fc(aux)
        mask0 = build_attention_mask(attention_mask, t, 0, b, aux.device)
        positions = torch.arange(t, device=aux.device).expand(b, t)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        outs: list[Tensor] = []
        for k in range(steps):
            cos, sin = rope_cos_sin(positions + k, self.config.head_dim, self.config.rope_theta, hidden.dtype)
            q, kk, vv = layer.qkv(hidden, self.embed(shift_left(input_ids, 1 + k), hidden.dtype), cos, sin)
            keys.append(kk)
            values.append(vv)
            hidden = layer.finish(hidden, ttt_attention(q, keys, values, mask0))
            outs.append(hidden)
        return outs


@torch.no_grad()
def eagle3_chain(model: Eagle3Drafter, pre: Tensor, kv: KV, starts: Tensor, k: int,
                 forced: Tensor | None = None) -> tuple[list[Tensor], Tensor]:
    """Draft ``k`` steps from every start t as vLLM's proposer does (one sequence).

    pre [L, H] and kv ([1, n_kv, L, d] each): the teacher-forced first pass. Step 0's output is
    pre_t; step j >= 1 feeds (previous pre, token) at position t+j, attending to positions <= t
    and the chain. The token is the previous draft or, with ``forced`` [L] (y_{t+1}), the true
    y_{t+1+j}. Returns each step's pre, [n, H] per step, and the drafts (target ids) [n, k].
    """
    length, n = pre.shape[0], len(starts)
    past = (kv[0].expand(n, -1, -1, -1), kv[1].expand(n, -1, -1, -1))
    prefix_ok = torch.arange(length)[None, :] <= starts[:, None]  # [n, L]
    feat = pre[starts]
    token = model.to_target_ids(model.logits(feat).argmax(-1))
    feats, drafts = [feat], [token]
    for j in range(1, k):
        if forced is not None:
            token = forced[(starts + j).clamp(max=length - 1)]
        mask = torch.cat((prefix_ok, torch.ones(n, j, dtype=torch.bool)), dim=1)[:, None, None, :]
        out, past = model.step(feat[:, None], token[:, None], (starts + j)[:, None], mask, past)
        feat = out[:, 0]
        token = model.to_target_ids(model.logits(feat).argmax(-1))
        feats.append(feat)
        drafts.append(token)
    return feats, torch.stack(drafts, dim=1)


# ============================================================================ loss
def eagle3_loss(model: Eagle3Drafter, outs: Sequence[Tensor], target_logits: Tensor, in_vocab: Tensor,
                loss_mask: Tensor) -> tuple[Tensor, dict[str, list]]:
    """Sum over steps k of 0.8^k x soft-label CE of step k (module docstring).

    outs: pre_k [B, T, H]; target_logits [B, T, V_d] (z_t over the draft vocabulary), in_vocab
    [B, T] bool; loss_mask [B, T] (``collate_sequences``: y_{t+1} is an assistant token, 0 at
    the last position). Step k at t is trained iff y_{t+1+k} is an assistant token and argmax
    z_{t+1+k} is in the vocabulary; its loss is normalised by its assistant positions. Returns
    the loss and per step: ploss, correct (draft = the target's argmax) and total (assistant
    positions, so a target argmax outside the vocabulary counts as a miss).
    """
    total_loss = outs[0].new_zeros((), dtype=torch.float32)
    stats: dict[str, list] = {"ploss": [], "correct": [], "total": []}
    for k, pre in enumerate(outs):
        seen = shift_left(loss_mask, k).bool()
        trained = seen & shift_left(in_vocab, 1 + k)
        label = torch.softmax(shift_left(target_logits, 1 + k), dim=-1)  # [B, T, V_d]
        logp = torch.log_softmax(model.logits(pre).float(), dim=-1)
        denom = max(int(seen.sum()), 1)
        loss_k = -(label * logp).sum(-1).masked_select(trained).sum() / denom
        total_loss = total_loss + STEP_DECAY ** k * loss_k
        with torch.no_grad():
            right = (logp.argmax(-1) == label.argmax(-1)) & trained  # in-vocab argmax: same token
        stats["ploss"].append(round(float(loss_k.detach()), 5))
        stats["correct"].append(int(right.sum()))
        stats["total"].append(int(seen.sum()))
    return total_loss, stats


# ============================================================================ checkpoint format
def eagle3_config_dict(model: Eagle3Drafter, target_config: Mapping[str, Any], target_name: str | None,
                       vocab_source: str) -> dict[str, Any]:
    """``config.json``: the target's, one layer, Eagle3LlamaForCausalLM, the EAGLE-3 fields vLLM reads."""
    out = {k: v for k, v in target_config.items() if k not in _EAGLE_DROP_KEYS}
    out.update(architectures=[EAGLE3_ARCHITECTURE], num_hidden_layers=1,
               draft_vocab_size=len(model.d2t), target_hidden_size=model.config.hidden_size,
               eagle_aux_hidden_state_layer_ids=list(model.layer_ids), norm_before_residual=False,
               # vLLM must not tie the draft's own LM head [V_d, H] to an embedding
               tie_word_embeddings=False,
               vllm_clover={"method": "eagle3", "format_version": FORMAT_VERSION,
                            "num_speculative_tokens": model.config.num_heads,
                            "draft_vocab_source": vocab_source,
                            "target": _target_info(target_config, target_name)})
    return out


def save_eagle3(directory: str | os.PathLike, model: Eagle3Drafter, target_config: Mapping[str, Any],
                target_name: str | None, vocab_source: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``config.json`` + ``model.safetensors``: weights in ``dtype``, ``d2t`` int64 and
    ``t2d`` bool (vLLM skips t2d; both as in EAGLE-3 and speculators checkpoints), neither
    when the draft vocabulary is the whole vocabulary."""
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous().clone()
               for name, t in model.state_dict().items()}
    if len(model.d2t) == model.config.vocab_size:  # full vocabulary: vLLM has no d2t parameter then
        del tensors["d2t"], tensors["t2d"]
    directory = Path(directory)
    _write_atomic(directory, eagle3_config_dict(model, target_config, target_name, vocab_source), tensors)
    return directory


def load_eagle3(directory: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """An EAGLE-3 checkpoint written by :func:`save_eagle3` (eval mode; needs ``bind_target``)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_dict = json.loads((directory / CONFIG_NAME).read_text())
    if EAGLE3_ARCHITECTURE not in (config_dict.get("architectures") or []):
        raise TrainingError(f"{directory}: not an EAGLE-3 checkpoint ({config_dict.get('architectures')!r})")
    state = load_file(str(directory / WEIGHTS_NAME))
    config = shape_config("eagle", config_dict, config_dict["vllm_clover"]["num_speculative_tokens"], 1)
    d2t = state.pop("d2t", torch.zeros(config.vocab_size, dtype=torch.long))
    vocab = d2t + torch.arange(len(d2t))
    state.update(d2t=d2t, t2d=torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, vocab, True))
    model = Eagle3Drafter(config, config_dict["eagle_aux_hidden_state_layer_ids"], vocab)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})
    return model.eval()


# ============================================================================ training
class TokenSequences:
    """Tokenised conversations as a training dataset: ``ds[i]`` = ``{"input_ids": int64 [L],
    "loss_mask": uint8 [L]}`` (assistant bits), ``ds.lengths`` int64 [S]; the interface of
    ``stream.CorpusSlice`` without features. Sequences without an assistant token after
    position 0 are dropped (nothing to train on)."""

    def __init__(self, tokenizer, convs, max_len: int) -> None:
        from vllm_clover.training.data import tokenize_conversation

        self.items = []
        for conv in convs:
            ids, mask = tokenize_conversation(tokenizer, conv.messages, max_len)
            if sum(mask[1:]):
                self.items.append({"input_ids": torch.tensor(ids, dtype=torch.int64),
                                   "loss_mask": torch.tensor(mask, dtype=torch.uint8)})
        self.lengths = np.array([len(i["input_ids"]) for i in self.items], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.items[index]

    def token_ranking(self, vocab_size: int) -> Tensor:
        return data_vocab_ranking(self, vocab_size)


def _dataset(args: TrainArgs, target: Path):
    """(dataset, its description for training.json): a corpus slice (``--data DIR``,
    ``--token-range``) or the conversations of ``inputs.select_conversations``, tokenised."""
    from transformers import AutoTokenizer

    from vllm_clover.training.corpus import Corpus, is_corpus
    from vllm_clover.training.inputs import select_conversations
    from vllm_clover.training.stream import CorpusSlice
    from vllm_clover.training.train import _check_corpus_target

    if is_corpus(args.data):
        corpus = Corpus(args.data)
        _check_corpus_target(corpus, target)
        ds = CorpusSlice(corpus, *(args.token_range or (None, None)))
        return ds, {"source": corpus.info["source"], **ds.data_info()}
    chunks, label = select_conversations(args.data, args.num_conversations, target,
                                         args.distill_max_new_tokens, args.distill_dtype)
    ds = TokenSequences(AutoTokenizer.from_pretrained(str(target)), [c for ch in chunks for c in ch], args.max_len)
    if not len(ds):
        raise TrainingError(f"no training conversation with an assistant token from --data {args.data}")
    return ds, {"source": label, "num_sequences": len(ds), "num_tokens": int(ds.lengths.sum()),
                "num_loss_tokens": int(sum(int(i["loss_mask"].sum()) for i in ds.items))}


def _check_args(args: TrainArgs) -> None:
    args.validate()
    if args.method != "eagle3":
        raise TrainingError(f"train_eagle3 trains --method eagle3, not {args.method!r}")
    if args.num_layers != 1:
        raise TrainingError(f"--method eagle3 trains one decoder layer (vLLM's EAGLE-3), got --num-layers {args.num_layers}")
    if not 1 <= args.num_heads <= 16:
        raise TrainingError(f"--num-heads (EAGLE-3 training-time-test steps) must be in 1..16, got {args.num_heads}")
    if args.train_vocab:
        raise TrainingError("--method eagle3 always trains over its draft vocabulary: size it with --draft-vocab")


def train_eagle3(args: TrainArgs, resume: bool = False, stop_after: int | None = None,
                 progress: bool = True, deadline: float | None = None) -> dict[str, Any]:
    """Train (or resume) an EAGLE-3 drafter; returns the ``training.json`` content.

    ``--num-heads`` = training-time-test steps (and the default draft length), ``--draft-vocab``
    = draft vocabulary size (0: 4,096). Optimizer, schedule, clipping, the seeded batch plan,
    checkpoints, exact resume, ``deadline`` and the pause file are those of ``vllm-clover
    train``; the target's features are computed per batch (no feature cache).
    """
    from vllm_clover.training.batches import BatchPlan, collate_sequences
    from vllm_clover.training.features import load_target_head
    from vllm_clover.training.inputs import check_target, resolve_target
    from vllm_clover.training.train import CHECKPOINT_DIR, _linear_warmup_decay, _output_dir, \
        _restore_training_state, _wait_while_paused, _window_metrics, save_training_state, seed_all

    t_start = time.perf_counter()
    _check_args(args)
    device = resolve_device(args.device)
    out, state_path = _output_dir(args, resume)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_target(args.target)
    target_config = check_target(target)
    ds, data_info = _dataset(args, target)
    vocab, vocab_source = draft_vocabulary(target, target_config, ds, args.draft_vocab or DRAFT_VOCAB_SIZE)
    t_data = time.perf_counter() - t_start

    seed_all(args.seed)
    try:
        config = shape_config("eagle", target_config, args.num_heads, 1)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    config.target_name = config.target_name or target.name
    layer_ids = aux_layer_ids(int(target_config["num_hidden_layers"]))
    model = Eagle3Drafter(config, layer_ids, vocab)
    norm_w, _eps, lm_head, _embed = load_target_head(target, dtype=torch.float32)
    model.init_from_target(norm_w, lm_head).to(device)
    features = AuxFeatures(target, layer_ids, vocab, args.compute_dtype, device)
    model.bind_target(features.embed_weight)
    plan = BatchPlan(ds.lengths, args.batch_tokens, args.seed)
    total_steps = args.steps if args.steps is not None else plan.steps_for_epochs(args.epochs)
    if total_steps < 1:
        raise TrainingError("the run has 0 steps (too few conversations or epochs)")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _linear_warmup_decay(warmup, total_steps))
    step, history, elapsed_before = 0, [], 0.0
    if resume:  # train's restore reads and sets only these fields of its run
        run = SimpleNamespace(args=args, device=device, out=out, total_steps=total_steps, drafter=model,
                              optimizer=optimizer, scheduler=scheduler)
        _restore_training_state(run, state_path)
        step, history, elapsed_before = run.step, run.history, run.elapsed_before
    out.mkdir(parents=True, exist_ok=True)

    def checkpoint() -> None:
        save_training_state(out, model, optimizer, scheduler, step, args, history,
                            elapsed_before + time.perf_counter() - t_loop)

    model.train()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc="train eagle3", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
    t_loop, done_here = time.perf_counter(), 0
    try:
        while step < total_steps:
            _wait_while_paused()
            if deadline is not None and time.time() >= deadline:
                checkpoint()
                log(f"deadline reached at step {step}/{total_steps}; continue with --resume")
                return {"interrupted_at_step": step}
            epoch, j = plan.locate(step)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            batch = {k: v.to(device) for k, v in collate_sequences([ds[i] for i in plan.epoch(epoch)[j]]).items()}
            aux, target_logits, in_vocab = features(batch["input_ids"], batch["attention_mask"])
            feature_s = time.perf_counter() - wall0
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.compute_dtype == "bfloat16"):
                outs = model.forward_ttt(aux, batch["input_ids"], batch["attention_mask"], args.num_heads)
            loss, stats = eagle3_loss(model, outs, target_logits, in_vocab, batch["loss_mask"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(params, args.grad_clip_value)
            optimizer.step()
            scheduler.step()
            step += 1
            done_here += 1
            # CPU time next to wall time: on a shared machine the two differ a lot.
            history.append({"step": step, "epoch": epoch, "loss": round(float(loss.detach()), 5), **stats,
                            "tokens": int(batch["attention_mask"].sum()), "lr": scheduler.get_last_lr()[0],
                            "feature_s": round(feature_s, 3), "wall_s": round(time.perf_counter() - wall0, 3),
                            "cpu_s": round(time.process_time() - cpu0, 3)})
            if bar is not None:
                recent = _window_metrics(history, 20)
                bar.set_postfix_str(f"loss={recent['loss']:.3f} acc=" + "/".join(f"{a:.2f}" for a in recent["acc"]),
                                    refresh=False)
                bar.update(1)
            if step % args.save_every == 0 or step == total_steps or done_here == stop_after:
                checkpoint()
            if stop_after is not None and done_here >= stop_after and step < total_steps:
                return {"interrupted_at_step": step}
    except KeyboardInterrupt:
        checkpoint()
        raise TrainingError(f"interrupted at step {step}; continue with --resume") from None
    finally:
        if bar is not None:
            bar.close()
    train_seconds = elapsed_before + time.perf_counter() - t_loop

    model.cpu()
    save_eagle3(out, model, target_config, config.target_name, vocab_source)
    final = _window_metrics(history, max(1, min(50, len(history) // 10 or 1)))
    report = {
        "command": args.command, "args": asdict(args),
        "target": {"dir": str(target), "architecture": (target_config.get("architectures") or [None])[0],
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size},
        "device": device_name(device),
        "data": data_info,
        "eagle3": {"aux_layer_ids": list(layer_ids), "draft_vocab_size": len(vocab),
                   "draft_vocab_source": vocab_source, "ttt_steps": args.num_heads, "step_decay": STEP_DECAY},
        "steps": total_steps, "warmup_steps": warmup,
        "epochs_covered": round(plan.epochs_covered(total_steps), 3),
        "tokens_trained": int(sum(h["tokens"] for h in history)),
        "wall_time_s": {"data": round(t_data, 1), "features": round(sum(h["feature_s"] for h in history), 1),
                        "training": round(train_seconds, 1),
                        "training_cpu": round(sum(h["cpu_s"] for h in history), 1),
                        "total_this_call": round(time.perf_counter() - t_start, 1)},
        "final_train_metrics": {"window_steps": final["steps"], "loss": round(final["loss"], 4),
                                "acc_per_head": [round(a, 4) for a in final["acc"]]},
        "num_trainable_params": sum(p.numel() for p in params),
        "threads": args.threads, "versions": {"torch": torch.__version__},
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    if not args.keep_checkpoint:
        shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    return report
