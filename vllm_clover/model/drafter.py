"""The Clover / Clover-2 drafter in plain PyTorch (no vLLM needed).

Notation (that of the Clover-2 paper and its official code): H hidden size, V vocab,
x_t the target's last-layer output *before* its final norm, y_{t+1} the token x_t
predicts, E the frozen embedding table (a copy of the target lm_head weight in the
official code), LMHead the target's frozen lm_head.

Clover-2 (``variant="clover2"``, the official released model)::

    u_t  = AttnDec_1(x_t, E[y_{t+1}])                       trunk_decoder
    z    = RMSNorm_c(Aug(u))        Aug = causal Llama layers   layers.*, trunk_norm
    head 0:  s_0 = z_t,  o_0 = RMSNorm_h(W_0 s_0 + b_0)         head0_proj, head_norm
    head i:  s_i = AttnDec_2(s_{i-1}, E[y^_{t+1+i}])           head_decoder (shared, i >= 1)
             o_i = RMSNorm_h(W_2 [s_i ; E[y^_{t+1+i}]] + b_2)   head_proj (shared), head_norm
    logits_i = LMHead(o_i)   predicts y_{t+2+i}

Clover-1 (``variant="clover"``, paper order, an UNVERIFIED reconstruction)::

    s_{-1} = z = RMSNorm_c(Aug(x))                             layers.*, trunk_norm
    head i:  s_i = AttnDec_i(s_{i-1}, E[y^_{t+1+i}])   y^_{t+1} = target token   head_decoders.{i}
             o_i = RMSNorm_h(ResBlock_i(s_i)),  ResBlock(s) = s + SiLU(W s + b)  head_resblocks.{i}

Checkpoint parameter names (ours -> official Clover-2 ``Clover2Model`` state_dict)::

    trunk_decoder.{input_layernorm,q,k,v}.*      clover_head_mlp_rnn.{input_layernorm,q,k,v}.*
    layers.{i}.self_attn.{q,k,v,o}_proj.weight   (same)
    layers.{i}.mlp.{gate,up,down}_proj.weight    (same)
    layers.{i}.input_layernorm.weight            (same)
    layers.{i}.post_attention_layernorm.weight   (same)
    trunk_norm.weight                            clover_norm.weight
    head0_proj.{weight,bias}                     clover_head_mlp.{weight,bias}
    head_decoder.{input_layernorm,q,k,v}.*       clover_head_mlp_rnn2.{input_layernorm,q,k,v}.*
    head_proj.{weight,bias}                      clover_head_mlp2.{weight,bias}
    head_norm.weight                             clover_head_norm.weight
    (not saved; bound with bind_target)          clover_embed_tokens.weight, lm_head.weight
    Clover-1 only: head_decoders.{i}.*, head_resblocks.{i}.linear.{weight,bias}

The Aug-layer names are the Hugging Face Llama names, so vLLM's ``LlamaDecoderLayer``
(through its stacked-params mapping) loads the same keys.

The two functions shared by training and inference are :meth:`CloverDrafter.trunk`
(or :meth:`CloverDrafter.fuse` + your own layers + ``trunk_norm``) and
:meth:`CloverDrafter.head_step`; ``forward_train`` and ``draft_chain`` are both built on
them, which is what makes the teacher-forced training path and the drafting path agree.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vllm_clover.model.config import CloverConfig
from vllm_clover.model.layers import (AttentionDecoder, AugmentingLayer, ResBlock, RMSNorm, build_attention_mask,
                                      rope_cos_sin)

Tensor = torch.Tensor
KVCache = list[tuple[Tensor, Tensor]]  # per Aug layer: (k, v), each [B, n_kv, S, head_dim]
LMHead = Tensor | Callable[[Tensor], Tensor]  # a [V, H] weight, or a module mapping [.., H] -> [.., V]


# ============================================================================ the drafter
class CloverDrafter(nn.Module):
    """Clover-2 (default) or Clover-1 drafter. See the module docstring for the maths.

    E and the lm_head belong to the target: attach them with :meth:`bind_target`. They are
    stored as non-persistent buffers, so they never appear in ``state_dict()`` and never
    receive gradients.
    """

    lm_head_weight: Tensor | None
    _embed_weight: Tensor | None

    def __init__(self, config: CloverConfig, make_layer: Callable[[int], nn.Module] | None = None) -> None:
        """``make_layer(i)`` optionally builds Aug layer i (default :class:`AugmentingLayer`).

        A vLLM model passes its own ``LlamaDecoderLayer`` here to reuse ``fuse``,
        ``trunk_norm``, ``head_step`` and ``draft_chain`` with identical checkpoint keys;
        :meth:`augment` / :meth:`trunk` / :meth:`forward_train` then do not apply (they
        call the layers with this module's signature), so it runs the layers itself.
        """
        super().__init__()
        config.validate()
        self.config = config
        h, eps, n_h = config.hidden_size, config.rms_norm_eps, config.num_attention_heads
        if config.variant == "clover2":
            self.trunk_decoder = AttentionDecoder(h, n_h, eps)
        build = make_layer or (lambda _i: AugmentingLayer(config))
        self.layers = nn.ModuleList(build(i) for i in range(config.num_layers))
        self.trunk_norm = RMSNorm(h, eps)
        if config.variant == "clover2":
            self.head0_proj = nn.Linear(h, h)
            self.head_decoder = AttentionDecoder(h, n_h, eps)
            self.head_proj = nn.Linear(2 * h, h)
        else:
            self.head_decoders = nn.ModuleList(AttentionDecoder(h, n_h, eps) for _ in range(config.num_heads))
            self.head_resblocks = nn.ModuleList(ResBlock(h) for _ in range(config.num_heads))
        self.head_norm = RMSNorm(h, eps)
        self.register_buffer("lm_head_weight", None, persistent=False)
        self.register_buffer("_embed_weight", None, persistent=False)
        self._vocab: Any = None  # bind_vocab: E and lm_head as a (tensor-parallel) vocabulary
        self.gradient_checkpointing = False  # trainers may switch it on (Aug layers only)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Clover init except the target copies (see :func:`init_from_target` for those).

        AttnDec q, k = I + U(0, 0.01); v = U(0, 0.01); biases 0, so AttnDec(h, e) ~= h.
        head0_proj = I + U, head_proj = [I | 0] + U, biases 0: heads start as identities.
        Clover-1 ResBlocks start at W = 0, b = 0 (identity). Norms start at 1.
        """
        for dec in self._attention_decoders():
            _eye_plus_uniform(dec.q.weight)
            _eye_plus_uniform(dec.k.weight)
            nn.init.uniform_(dec.v.weight, 0.0, 0.01)
            for lin in (dec.q, dec.k, dec.v):
                nn.init.zeros_(lin.bias)
            nn.init.ones_(dec.input_layernorm.weight)
        if self.config.variant == "clover2":
            _eye_plus_uniform(self.head0_proj.weight)
            _eye_plus_uniform(self.head_proj.weight)  # H x 2H: identity on the state half
            nn.init.zeros_(self.head0_proj.bias)
            nn.init.zeros_(self.head_proj.bias)
        else:
            for block in self.head_resblocks:
                nn.init.zeros_(block.linear.weight)
                nn.init.zeros_(block.linear.bias)
        nn.init.ones_(self.trunk_norm.weight)
        nn.init.ones_(self.head_norm.weight)

    def _attention_decoders(self) -> list[AttentionDecoder]:
        if self.config.variant == "clover2":
            return [self.trunk_decoder, self.head_decoder]
        return list(self.head_decoders)

    # ------------------------------------------------------------------ target binding
    def bind_target(self, lm_head_weight: Tensor, embed_weight: Tensor | None = None) -> "CloverDrafter":
        """Attach the target's frozen lm_head weight [V, H] and token table E [V, H].

        E defaults to the lm_head weight, as in the official code (``clover_embed_tokens``
        is a copy of ``lm_head.weight``); for tied-embedding targets both are the same.
        """
        v, h = self.config.vocab_size, self.config.hidden_size
        for name, w in (("lm_head_weight", lm_head_weight), ("embed_weight", embed_weight)):
            if w is not None and tuple(w.shape) != (v, h):
                raise ValueError(f"{name} has shape {tuple(w.shape)}, drafter expects ({v}, {h})")
        self.lm_head_weight = lm_head_weight.detach()
        self._embed_weight = None if embed_weight is None else embed_weight.detach()
        self._vocab = None
        return self

    def bind_vocab(self, vocab: Any) -> "CloverDrafter":
        """Attach E and the lm_head as an object with ``embed(ids) -> [.., H]`` and
        ``logits(o) -> [.., V]`` instead of [V, H] tensors: under tensor parallelism, this
        rank's shard of the target's vocabulary, whose products reduce or gather over the
        ranks (vllm_clover/engine/vocab_parallel.py)."""
        self.lm_head_weight = None
        self._embed_weight = None
        self._vocab = vocab
        return self

    @property
    def bound(self) -> bool:
        """True once the target's E and lm_head are attached."""
        return self.lm_head_weight is not None or self._vocab is not None

    @property
    def embed_weight(self) -> Tensor:
        """E [V, H]: the bound embedding table (the lm_head weight unless given separately)."""
        w = self._embed_weight if self._embed_weight is not None else self.lm_head_weight
        if w is None:
            raise RuntimeError("CloverDrafter has no target weights; call bind_target(lm_head_weight) first")
        return w

    def embed(self, tokens: Tensor, like: Tensor) -> Tensor:
        """E[tokens]: tokens [...] (long) -> [..., H] in ``like``'s dtype."""
        if self._vocab is not None:
            return self._vocab.embed(tokens).to(like.dtype)
        return F.embedding(tokens, self.embed_weight).to(like.dtype)

    def logits(self, o: Tensor, lm_head: LMHead | None = None) -> Tensor:
        """LMHead(o): o [..., H] -> [..., V]; ``lm_head`` is a [V, H] weight or a callable."""
        head = self.lm_head_weight if lm_head is None else lm_head
        if head is None and self._vocab is not None:
            return self._vocab.logits(o)
        if head is None:
            raise RuntimeError("CloverDrafter has no lm_head; call bind_target or pass lm_head")
        return apply_lm_head(head, o)

    # ------------------------------------------------------------------ trunk
    def fuse(self, x: Tensor, next_tokens: Tensor) -> Tensor:
        """Regressive connection of the target-sampled token, before the Augmenting Block.

        x [..., H] (target pre-norm hidden), next_tokens [...] (y_{t+1}) -> u [..., H].
        Clover-2: u = AttnDec_1(x, E[y]). Clover-1 has no trunk fusion: u = x.
        A vLLM module calls this, then its own Llama layers, then ``trunk_norm``.
        """
        if self.config.variant == "clover2":
            return self.trunk_decoder(x, self.embed(next_tokens, x))
        return x

    def augment(self, u: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                past_kv: KVCache | None = None) -> tuple[Tensor, KVCache]:
        """Augmenting Block + trunk norm: z = RMSNorm_c(Aug(u)).

        u [B, T, H]; attention_mask [B, P+T] (1 = real token; None = all real); positions
        [B, T] (default: count of real tokens before each one, so right padding gives
        0..T-1 and a cache continues at P); past_kv: per-layer (k, v) [B, n_kv, P, d].
        Returns z [B, T, H] and the updated per-layer cache [B, n_kv, P+T, d].
        """
        b, t, _ = u.shape
        past_len = 0 if not past_kv else past_kv[0][0].shape[2]
        if positions is None:
            positions = _default_positions(attention_mask, b, t, past_len, u.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, u.dtype)
        mask = build_attention_mask(attention_mask, t, past_len, b, u.device)
        new_kv: KVCache = []
        for i, layer in enumerate(self.layers):
            layer_past = past_kv[i] if past_kv else None
            if self.gradient_checkpointing and self.training:
                u, kv = torch.utils.checkpoint.checkpoint(layer, u, cos, sin, mask, layer_past,
                                                          use_reentrant=False)
            else:
                u, kv = layer(u, cos, sin, mask, layer_past)
            new_kv.append(kv)
        return self.trunk_norm(u), new_kv

    def trunk(self, x: Tensor, next_tokens: Tensor, attention_mask: Tensor | None = None,
              positions: Tensor | None = None, past_kv: KVCache | None = None) -> tuple[Tensor, KVCache]:
        """Run once per target step over the new positions: ``augment(fuse(x, y))``.

        x [B, T, H] target pre-norm hidden states x_t; next_tokens [B, T] = y_{t+1}.
        Returns z [B, T, H] (the head-0 state) and the Aug-layer KV cache.
        """
        return self.augment(self.fuse(x, next_tokens), attention_mask, positions, past_kv)

    # ------------------------------------------------------------------ heads
    def head_step(self, state: Tensor, prev_token: Tensor, i: int) -> tuple[Tensor, Tensor]:
        """Speculative head ``i`` on a flat batch of rows: (state, token) -> (new state, o_i).

        state [N, H] (or [B, T, H]): z for i = 0, else the state returned by step i-1.
        prev_token [N] (long): the token predicted by head i-1; for i = 0 it is the
        target-sampled token y_{t+1} (Clover-2 ignores it at i = 0: the trunk already fused it).
        Returns the recurrent state s_i and the head output o_i (LMHead(o_i) -> y_{t+2+i}).
        Rows are independent, so tree drafting just repeats parent states per child.
        """
        if not 0 <= i < self.config.num_heads:
            raise IndexError(f"head index {i} out of range for {self.config.num_heads} heads")
        if self.config.variant == "clover2":
            if i == 0:
                return state, self.head_norm(self.head0_proj(state))
            e = self.embed(prev_token, state)
            s = self.head_decoder(state, e)
            return s, self.head_norm(self.head_proj(torch.cat((s, e), dim=-1)))
        s = self.head_decoders[i](state, self.embed(prev_token, state))
        return s, self.head_norm(self.head_resblocks[i](s))

    @torch.no_grad()
    def draft_chain(self, z_last: Tensor, first_token: Tensor, k: int | None = None,
                    lm_head: LMHead | None = None, return_probs: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
        """Greedy top-1 chain of ``k`` draft tokens per row.

        z_last [N, H]: trunk output at each request's last position; first_token [N]: the
        target-sampled token y_{t+1} there. Returns tokens [N, k] (long) and, if
        ``return_probs``, the float32 draft distributions [N, k, V] (else None).
        """
        k = self.config.num_heads if k is None else k
        if not 1 <= k <= self.config.num_heads:
            raise ValueError(f"k={k} must be in 1..{self.config.num_heads} (number of heads)")
        state, token = z_last, first_token
        tokens, probs = [], []
        for i in range(k):
            state, o = self.head_step(state, token, i)
            logits = self.logits(o, lm_head)
            token = logits.argmax(dim=-1)
            tokens.append(token)
            if return_probs:
                probs.append(torch.softmax(logits.float(), dim=-1))
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if return_probs else None)

    # ------------------------------------------------------------------ training
    def forward_train(self, x: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None,
                      positions: Tensor | None = None) -> list[Tensor]:
        """Teacher-forced outputs of every head, as the official ``Clover2Model.forward``.

        x [B, T, H]: target pre-norm hidden states; input_ids [B, T]: shifted ids
        (input_ids[:, t] = y_{t+1}); attention_mask [B, T] (1 = real token).
        Returns ``[o_0, ..., o_{K-1}]`` with o_i [B, T-i, H]: o_i[:, t] predicts y_{t+2+i},
        and head i consumed the ground-truth y_{t+1+i} = input_ids[:, t+i] as its previous token.
        """
        z, _ = self.trunk(x, input_ids, attention_mask, positions)
        t = x.shape[1]
        state, outputs = z, []
        for i in range(self.config.num_heads):
            state = state[:, : max(t - i, 0)]
            state, o = self.head_step(state, input_ids[:, i:], i)
            outputs.append(o)
        return outputs

    forward = forward_train


# ============================================================================ initialisation
@torch.no_grad()
def init_from_target(drafter: CloverDrafter, target: nn.Module | Mapping[str, Tensor],
                     layer_index: int = -1) -> CloverDrafter:
    """Copy target weights into the drafter as the official code does, after ``reset_parameters``.

    Every Aug layer <- target layer ``layer_index`` (default: the LAST layer, as in the
    first official commit; HEAD's copy of layer 0 looks like a regression). trunk_norm and
    head_norm <- the target final norm. ``target`` is an HF ``LlamaForCausalLM`` /
    ``LlamaModel`` or its state dict.
    """
    sd = target.state_dict() if isinstance(target, nn.Module) else target
    prefix = "model." if any(k.startswith("model.layers.") for k in sd) else ""
    indices = {int(k[len(prefix) + 7:].split(".", 1)[0]) for k in sd if k.startswith(prefix + "layers.")}
    if not indices:
        raise ValueError("target state dict has no '(model.)layers.N.*' decoder-layer weights")
    n = max(indices) + 1
    src = f"{prefix}layers.{layer_index % n}."
    for layer in drafter.layers:
        for name, param in layer.named_parameters():
            _copy(param, sd, src + name)
    for norm in (drafter.trunk_norm, drafter.head_norm):
        _copy(norm.weight, sd, f"{prefix}norm.weight")
    return drafter


@torch.no_grad()
def match_token_value_scale(drafter: CloverDrafter, state_rms: Mapping[str, float], embed_rms: float) -> dict[str, float]:
    """Re-initialise each Attention Decoder's value projection as ``s * I`` (bias 0), with
    ``s = state_rms[name] / embed_rms``, so that the token term ``a_j v_j`` enters at the
    scale of the state it is added to (times the cosine gate, |a_j| ~ 0.1 at init).

    Why: the official init (``v ~ U(0, 0.01)``) makes the token's contribution vanish when
    the state is much larger than an embedding. On SmolLM2 the trunk's input x_t (the
    target's pre-norm residual stream) has an RMS of ~33 and token embeddings ~0.13, so
    ``AttnDec_1`` starts -- and after hundreds of CPU steps still is -- blind to the token
    the target just sampled (docs/training.md). ``state_rms`` maps decoder attribute names
    (``trunk_decoder``, ``head_decoder``, ``head_decoders.i``) to the RMS of their ``h``
    input. Returns the scales used.
    """
    scales = {}
    for name, module in drafter.named_modules():
        if isinstance(module, AttentionDecoder) and name in state_rms:
            scale = float(state_rms[name]) / float(embed_rms)
            module.v.weight.copy_(scale * torch.eye(module.v.weight.shape[0]))
            nn.init.zeros_(module.v.bias)
            scales[name] = scale
    return scales


def target_head_weights(target: nn.Module | Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(lm_head weight, embed_tokens weight) [V, H] of an HF causal LM or its state dict.

    A tied target without an ``lm_head.weight`` entry uses the embedding matrix for both.
    """
    sd = target.state_dict() if isinstance(target, nn.Module) else target
    embed = sd.get("model.embed_tokens.weight", sd.get("embed_tokens.weight"))
    head = sd.get("lm_head.weight", embed)
    if head is None:
        raise ValueError("target has neither lm_head.weight nor model.embed_tokens.weight")
    return head, (embed if embed is not None else head)


def _copy(param: Tensor, sd: Mapping[str, Tensor], key: str) -> None:
    if key not in sd:
        raise ValueError(f"target weights lack {key!r}")
    if tuple(sd[key].shape) != tuple(param.shape):
        raise ValueError(f"target {key} has shape {tuple(sd[key].shape)}, drafter expects {tuple(param.shape)}")
    param.copy_(sd[key])


def _eye_plus_uniform(weight: Tensor) -> None:
    """U(0, 0.01) plus an identity on the first ``out`` input columns ([I | 0] for H x 2H)."""
    nn.init.uniform_(weight, 0.0, 0.01)
    n = weight.shape[0]
    weight[:, :n] += torch.eye(n, dtype=weight.dtype, device=weight.device)


def _default_positions(attention_mask: Tensor | None, b: int, t: int, past_len: int,
                       device: torch.device) -> Tensor:
    if attention_mask is None:
        return torch.arange(past_len, past_len + t, device=device).expand(b, t)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]


def apply_lm_head(head: LMHead, h: Tensor) -> Tensor:
    """LMHead(h): ``head`` is a [V, H] weight (h cast to its dtype) or a callable."""
    if isinstance(head, Tensor):
        return F.linear(h.to(head.dtype), head)
    return head(h)


# ============================================================================ loss
def clover_loss(outputs: Sequence[Tensor], target_hidden: Tensor, lm_head: LMHead, loss_mask: Tensor,
                decay: float = 0.7, v_w: float = 10.0, p_w: float = 1.0,
                heads_coefficient: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """The official Clover-2 loss (``main_clover2.py``), summed over heads.

    outputs: ``forward_train`` result, o_i [B, T-i, H].
    target_hidden [B, T, H]: the target's POST-norm hidden state left-shifted by one
    (target_hidden[:, t] = h-bar_{t+1}; last position zero), so head i is compared with
    ``target_hidden[:, i:]``. loss_mask [B, T]: 1 on trained positions (assistant tokens,
    last position 0). Per head i, with m = loss_mask[:, i:] and n = sum(m) + 1::

        vloss_i = sum_t m_t mean_H SmoothL1(o_i,t, h-bar_{t+1+i}) / n
        ploss_i = -sum_t m_t sum_v softmax(LMHead(h-bar))_v log_softmax(LMHead(o_i,t))_v / n
        loss    = sum_i decay^i * heads_coefficient * (v_w vloss_i + p_w ploss_i)

    Returns (loss, metrics); metrics holds detached per-head tensors [K]: ``vloss``,
    ``ploss``, ``correct`` and ``total`` (top-1 of the head vs the target's argmax, counted
    on masked positions) and ``acc`` = correct / max(total, 1).
    """
    vlosses, plosses, correct, total = [], [], [], []
    loss = target_hidden.new_zeros((), dtype=torch.float32)
    for i, o in enumerate(outputs):
        tgt = target_hidden[:, i:]
        m = loss_mask[:, i:].to(torch.float32).unsqueeze(-1)  # [B, T-i, 1]
        denom = m.sum() + 1.0
        vloss = (m * F.smooth_l1_loss(o.float(), tgt.float(), reduction="none")).mean(-1).sum() / denom
        with torch.no_grad():
            target_logits = apply_lm_head(lm_head, tgt).float()
            target_p = torch.softmax(target_logits, dim=-1)
        logits = apply_lm_head(lm_head, o).float()
        ploss = -(m * (target_p * torch.log_softmax(logits, dim=-1))).sum() / denom
        loss = loss + (decay ** i) * heads_coefficient * (v_w * vloss + p_w * ploss)
        with torch.no_grad():
            hit = (logits.argmax(-1) == target_logits.argmax(-1)).float() * m.squeeze(-1)
            correct.append(hit.sum())
            total.append(m.sum())
            vlosses.append(vloss.detach())
            plosses.append(ploss.detach())
    correct_t, total_t = torch.stack(correct), torch.stack(total)
    metrics = {
        "vloss": torch.stack(vlosses),
        "ploss": torch.stack(plosses),
        "correct": correct_t,
        "total": total_t,
        "acc": correct_t / total_t.clamp(min=1.0),
    }
    return loss, metrics


def build_drafter(config: CloverConfig, target: nn.Module | Mapping[str, Any] | None = None) -> CloverDrafter:
    """A freshly initialised drafter; with ``target`` (HF causal LM or state dict) also copy
    its last layer / final norm and bind its lm_head (E = lm_head weight)."""
    drafter = CloverDrafter(config)
    if target is not None:
        init_from_target(drafter, target)
        head, _ = target_head_weights(target)
        drafter.bind_target(head)
    return drafter
