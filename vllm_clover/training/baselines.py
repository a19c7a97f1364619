"""Medusa-1 and EAGLE-1 baselines in the formats vLLM 0.32 loads (``vllm-clover train --method``).

Both are trained by :func:`vllm_clover.training.train.train` exactly like Clover heads (same data,
feature caches, batches, optimizer, schedule, checkpoints); only the model, its input and the
loss weights differ. Both read the target's POST-final-norm hidden state
h̄_t = RMSNorm(x_t), because that is what vLLM hands them: ``LlamaModel.forward`` returns
``self.norm(hidden_states, residual)`` (vllm/model_executor/models/llama.py:452) and the
runner passes that output on (v1/worker/gpu_model_runner.py:4839 for Medusa, :4958/:4996
for EAGLE). Our feature cache stores the pre-norm x_t; the trainer applies the target's norm.
Notation as in docs/feature-cache.md: y_{t+1} is the token x_t predicts.

Medusa-1 (vllm/model_executor/models/medusa.py, ``Medusa``)::

    head i:  o_i = ResBlock_i^{(n)}(h̄_t),   ResBlock(s) = s + SiLU(W s + b)   blocks.{i}.layers.{j}
             logits_i = LMHead(o_i)   predicts y_{t+2+i}                          lm_head (target's, frozen)

EAGLE-1 (vllm/model_executor/models/llama_eagle.py, ``EagleLlamaForCausalLM``)::

    u_t = fc([E[y_{t+1}] ; h̄_t])          fc.weight [H, 2H], no bias; E = the target's embedding
    f_t = Llama decoder layer(s)(u)_t      causal over positions, RoPE position t; layer 0 has NO
                                           input_layernorm; no final norm after the last layer
    logits_t = LMHead(f_t)                 predicts y_{t+2}; f_t regresses h̄_{t+1}
    drafting (vLLM, eagle.py/llm_base_proposer.py:512): step j >= 1 feeds (f, d_{j-1}) at position t+j

Checkpoints (``config.json`` + ``model.safetensors``):

* medusa: ``{"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size",
  "vocab_size", "num_heads", "num_hidden_layers" (ResBlocks per head), "medusa_fc_bias": true,
  "original_lm_head": true, "truncated_vocab_size": V, "vllm_clover": {...}}``; tensors
  ``blocks.{i}.layers.{j}.{weight,bias}`` (bf16) and ONE ``lm_head.weight`` [V, H], an exact
  copy of the target's LM head: vLLM's Medusa has no target sharing and its loader checks
  that every parameter was loaded (model_loader/default_loader.py:562), so the copy must be
  in the file; with ``original_lm_head`` all heads use that one matrix (medusa.py:75-81).
* eagle: the target's ``config.json`` with ``architectures: ["EagleLlamaForCausalLM"]``,
  ``num_hidden_layers: 1`` and a nested ``vllm_clover`` dict; tensors ``fc.weight`` and
  ``layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}.weight``
  (bf16). No embedding and no LM head: when the file has none, vLLM shares the target's
  (v1/spec_decode/llm_base_proposer.py:1416-1556, ``has_own_embed_tokens`` /
  ``has_own_lm_head`` stay False).

The nested ``vllm_clover`` key holds our metadata; it is a top-level name without "num",
which matters for Medusa (``MedusaConfig.from_pretrained`` renames "num*heads"/"num*layers"
keys, transformers_utils/configs/medusa.py:49-54).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from vllm_clover.model.config import ARCHITECTURE as CLOVER_ARCHITECTURE
from vllm_clover.model.config import CONFIG_NAME, CloverConfig, read_json_dict
from vllm_clover.model.layers import AugmentingLayer, build_attention_mask, rope_cos_sin

Tensor = torch.Tensor
KVCache = list[tuple[Tensor, Tensor]]  # per layer: (k, v), each [B, n_kv, S, head_dim]

METHODS = ("clover", "medusa", "eagle", "eagle3")  # eagle3: trained by vllm_clover.training.eagle3
BASELINES = ("medusa", "eagle")
MEDUSA_ARCHITECTURE = "MedusaModel"
EAGLE_ARCHITECTURE = "EagleLlamaForCausalLM"
EAGLE3_ARCHITECTURE = "Eagle3LlamaForCausalLM"  # vllm_clover.training.eagle3
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
# Loss weights (decay per head, regression weight, soft-label CE weight) of clover_loss_backward:
# Medusa-1 sums lambda_i * CE_i with lambda_i = 0.8^i and has no regression term; EAGLE-1 is
# 1.0 * SmoothL1(f_t, h̄_{t+1}) + 0.1 * CE (a single "head", so the decay is unused).
LOSS_WEIGHTS = {"medusa": (0.8, 0.0, 1.0), "eagle": (1.0, 1.0, 0.1)}
# Top-level keys of a target config.json that do not describe an EAGLE layer (or no longer fit it).
_EAGLE_DROP_KEYS = ("auto_map", "layer_types", "quantization_config", "_name_or_path", "_model_name_or_path")


class BaselineError(ValueError):
    """A baseline cannot be built, saved or loaded; one line naming the file and problem."""


# ============================================================================ Medusa-1
class MedusaBlock(nn.Module):
    """vLLM ``medusa.ResidualBlock``: ``x = x + SiLU(W_j x + b_j)`` for each layer j. [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """Medusa-1 heads on h̄_t; the LM head is the target's (passed to the loss, never a parameter).

    ``config``: a :class:`CloverConfig` used for its shape fields only (hidden_size,
    vocab_size, num_heads, num_layers = ResBlocks per head).
    """

    input_kind = "postnorm"  # the trainer feeds h̄_t = RMSNorm(x_t)

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(MedusaBlock(config.hidden_size, config.num_layers)
                                    for _ in range(config.num_heads))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Medusa-1 init: W = 0 (each head starts as the identity plus SiLU(b)), b default."""
        for block in self.blocks:
            for layer in block.layers:
                nn.init.zeros_(layer.weight)

    def bind_target(self, lm_head_weight: Tensor, embed_weight: Tensor | None = None) -> "MedusaHeads":
        """Nothing to bind: the heads read no embedding and the loss gets the LM head."""
        return self

    def forward(self, hbar: Tensor) -> list[Tensor]:
        """h̄ [..., H] -> [o_0, ..., o_{K-1}], each [..., H] (vLLM ``Medusa.forward``)."""
        return [block(hbar) for block in self.blocks]

    def forward_train(self, hbar: Tensor, input_ids: Tensor | None = None,
                      attention_mask: Tensor | None = None) -> list[Tensor]:
        """Same contract as ``CloverDrafter.forward_train``: o_i [B, T-i, H], o_i[:, t] predicts
        y_{t+2+i}. hbar [B, T, H]; the tokens and mask are unused (heads are per position)."""
        t = hbar.shape[1]
        return [o[:, : max(t - i, 0)] for i, o in enumerate(self(hbar))]


# ============================================================================ EAGLE-1
class EagleDrafter(nn.Module):
    """EAGLE-1 draft model, computing what vLLM's ``EagleLlamaForCausalLM`` computes.

    ``config``: a :class:`CloverConfig` with the target's layer shapes and its rope_theta
    (:func:`eagle_config_for_target`); num_layers decoder layers (EAGLE-1: 1), num_heads = the
    default number of draft tokens. Decoder layers are :class:`AugmentingLayer` (HF Llama
    names, which vLLM's ``LlamaModel`` maps onto qkv_proj / gate_up_proj), with layer 0's
    input_layernorm removed as vLLM does (llama_eagle.py:53-57).
    """

    input_kind = "postnorm"
    _embed_weight: Tensor | None

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(AugmentingLayer(config) for _ in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.register_buffer("_embed_weight", None, persistent=False)

    def bind_target(self, lm_head_weight: Tensor | None, embed_weight: Tensor) -> "EagleDrafter":
        """Attach the target's embedding [V, H] (frozen, not saved); the LM head goes to the loss."""
        self._embed_weight = embed_weight
        return self

    def step(self, hbar: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor,
             past_kv: KVCache | None = None) -> tuple[Tensor, KVCache]:
        """One forward over new positions (vLLM ``LlamaModel.forward`` in llama_eagle.py:123-139).

        hbar [B, T, H] features (h̄ of the target, or the draft's own f); tokens [B, T] the
        token after each feature's position; positions [B, T]; mask [B, 1, T, P+T] bool
        (True = may attend); past_kv per layer [B, n_kv, P, d]. Returns f [B, T, H] (no
        final norm: vLLM applies the LM head to it directly) and the per-layer KV [B, n_kv, P+T, d].
        """
        if self._embed_weight is None:
            raise RuntimeError("EagleDrafter: call bind_target(lm_head, embed) first")
        e = F.embedding(tokens, self._embed_weight).to(hbar.dtype)
        u = self.fc(torch.cat((e, hbar), dim=-1))  # embedding first, as vLLM and EAGLE
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, u.dtype)
        new_kv: KVCache = []
        for i, layer in enumerate(self.layers):
            u, kv = layer(u, cos, sin, mask, past_kv[i] if past_kv else None)
            new_kv.append(kv)
        return u, new_kv

    def teacher_forced(self, hbar: Tensor, input_ids: Tensor,
                       attention_mask: Tensor | None = None) -> tuple[Tensor, KVCache]:
        """vLLM's first pass over a right-padded batch: hbar [B, T, H], input_ids [B, T] = y_{t+1}.

        Returns f [B, T, H] (f_t predicts h̄_{t+1} and y_{t+2}) and the KV cache."""
        b, t, _ = hbar.shape
        positions = torch.arange(t, device=hbar.device).expand(b, t)
        mask = build_attention_mask(attention_mask, t, 0, b, hbar.device)
        return self.step(hbar, input_ids, positions, mask)

    def forward_train(self, hbar: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
                      ) -> list[Tensor]:
        """Same contract as ``CloverDrafter.forward_train`` with one head: ``[f]``, f [B, T, H]."""
        return [self.teacher_forced(hbar, input_ids, attention_mask)[0]]

    forward = forward_train


# ============================================================================ building
def rope_theta_of(target_config: Mapping[str, Any]) -> float:
    """The target's RoPE base; :class:`BaselineError` for scaled RoPE (not modelled here)."""
    params = target_config.get("rope_parameters") or target_config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise BaselineError(f"EAGLE baseline: target RoPE type {kind!r} is not supported (only 'default')")
    return float(target_config.get("rope_theta") or params.get("rope_theta") or 10000.0)


def shape_config(method: str, target_config: Mapping[str, Any], num_heads: int, num_layers: int
                 ) -> CloverConfig:
    """Shape holder of a baseline: the target's layer shapes, ``num_heads``, ``num_layers``.

    For eagle the RoPE base is the target's (vLLM builds the draft layer from this config),
    not Clover's fixed 10000."""
    if method not in BASELINES:
        raise BaselineError(f"unknown baseline method {method!r} (expected one of {', '.join(BASELINES)})")
    extra = {"rope_theta": rope_theta_of(target_config)} if method == "eagle" else {}
    return CloverConfig.from_target_config(dict(target_config), num_heads=num_heads, num_layers=num_layers,
                                           **extra)


def build_baseline(method: str, config: CloverConfig) -> nn.Module:
    """A freshly initialised Medusa or EAGLE model (float32; EAGLE: PyTorch default init as EAGLE-1)."""
    return MedusaHeads(config) if method == "medusa" else EagleDrafter(config)


def loss_weights(method: str) -> tuple[float, float, float]:
    """(decay, v_w, p_w) of clover_loss_backward for a baseline (see LOSS_WEIGHTS)."""
    return LOSS_WEIGHTS[method]


# ============================================================================ checkpoints
def _target_info(target_config: Mapping[str, Any], name: str | None) -> dict[str, Any]:
    archs = target_config.get("architectures") or [None]
    return {"architecture": archs[0], "num_hidden_layers": target_config.get("num_hidden_layers"),
            "hidden_size": target_config.get("hidden_size"), "vocab_size": target_config.get("vocab_size"),
            "name": name}


def medusa_config_dict(config: CloverConfig, target_config: Mapping[str, Any],
                       target_name: str | None = None) -> dict[str, Any]:
    """``config.json`` of a Medusa checkpoint (module docstring)."""
    return {
        "architectures": [MEDUSA_ARCHITECTURE],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": True,  # Medusa-1's ResBlock Linear has a bias; vLLM's default is none
        "original_lm_head": True,
        "truncated_vocab_size": config.vocab_size,
        "vllm_clover": {"method": "medusa", "format_version": FORMAT_VERSION,
                        "target": _target_info(target_config, target_name)},
    }


def eagle_config_dict(config: CloverConfig, target_config: Mapping[str, Any],
                      target_name: str | None = None) -> dict[str, Any]:
    """``config.json`` of an EAGLE checkpoint: the target's, one layer, EagleLlamaForCausalLM."""
    out = {k: v for k, v in target_config.items() if k not in _EAGLE_DROP_KEYS}
    out.update(architectures=[EAGLE_ARCHITECTURE], num_hidden_layers=config.num_layers,
               vllm_clover={"method": "eagle", "format_version": FORMAT_VERSION,
                            "num_speculative_tokens": config.num_heads,
                            "target": _target_info(target_config, target_name)})
    return out


def _write_atomic(directory: Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "vllm-clover"})
    os.replace(tmp, directory / WEIGHTS_NAME)
    tmp = directory / f".{CONFIG_NAME}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, directory / CONFIG_NAME)


def checkpoint_tensors(model: nn.Module, lm_head_weight: Tensor | None,
                       dtype: torch.dtype | None = torch.bfloat16) -> dict[str, Tensor]:
    """Tensors to save: the trainable weights (cast to ``dtype``) + for Medusa the target's
    LM head [V, H], uncast (an exact copy, so vLLM's Medusa uses the target's own head)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.to("cpu").contiguous().clone()  # safetensors refuses shared storage
    if isinstance(model, MedusaHeads):
        if lm_head_weight is None:
            raise BaselineError("a Medusa checkpoint needs the target's lm_head weight")
        tensors["lm_head.weight"] = lm_head_weight.detach().to("cpu").contiguous().clone()
    return tensors


def save_baseline(directory: str | os.PathLike, model: nn.Module, target_config: Mapping[str, Any],
                  lm_head_weight: Tensor | None = None, target_name: str | None = None,
                  dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (module docstring); returns the directory."""
    directory = Path(directory)
    make = medusa_config_dict if isinstance(model, MedusaHeads) else eagle_config_dict
    _write_atomic(directory, make(model.config, target_config, target_name),
                  checkpoint_tensors(model, lm_head_weight, dtype))
    return directory


def medusa_head_subset(src: str | os.PathLike, dst: str | os.PathLike, num_heads: int) -> Path:
    """Write the first ``num_heads`` heads of the Medusa checkpoint ``src`` as a checkpoint
    of their own in ``dst``; returns ``dst``.

    Why: vLLM's Medusa runs every head of its checkpoint on every step
    (``v1/spec_decode/medusa.py`` ``propose``: one LM-head product per head) whatever
    ``num_speculative_tokens`` is, so drafting K tokens with a K-head file is the cheapest.
    Medusa heads share nothing in training (own parameters, own loss term, per-parameter
    AdamW and clipping, same batches, head i initialised before head i + 1), so these heads
    are what a ``num_heads`` run on the same data would have trained."""
    from safetensors.torch import load_file

    src, dst = Path(src), Path(dst)
    config = _read_config(src)
    if MEDUSA_ARCHITECTURE not in (config.get("architectures") or []):
        raise BaselineError(f"{src}: not a Medusa checkpoint (architectures {config.get('architectures')!r})")
    if not 1 <= num_heads <= int(config["num_heads"]):
        raise BaselineError(f"{src} has {config['num_heads']} heads; cannot keep {num_heads}")
    tensors = {name: t for name, t in load_file(str(src / WEIGHTS_NAME)).items()
               if not name.startswith("blocks.") or int(name.split(".")[1]) < num_heads}
    _write_atomic(dst, {**config, "num_heads": num_heads}, tensors)
    return dst


def _read_config(directory: Path) -> dict[str, Any]:
    from vllm_clover.model.checkpoint import CloverCheckpointError

    return read_json_dict(directory, CloverCheckpointError, "drafter checkpoint")


def checkpoint_method(directory: str | os.PathLike) -> str:
    """"clover", "medusa", "eagle" or "eagle3", from ``<directory>/config.json``'s architectures."""
    from vllm_clover.model.checkpoint import CloverCheckpointError

    directory = Path(directory)
    archs = _read_config(directory).get("architectures") or []
    for arch, method in ((CLOVER_ARCHITECTURE, "clover"), (MEDUSA_ARCHITECTURE, "medusa"),
                         (EAGLE_ARCHITECTURE, "eagle"), (EAGLE3_ARCHITECTURE, "eagle3")):
        if arch in archs:
            return method
    raise CloverCheckpointError(
        f"{directory / CONFIG_NAME}: architectures {archs!r} is none of {CLOVER_ARCHITECTURE}, "
        f"{MEDUSA_ARCHITECTURE}, {EAGLE_ARCHITECTURE}, {EAGLE3_ARCHITECTURE}")


def load_baseline(directory: str | os.PathLike, target_config: Mapping[str, Any] | None = None,
                  dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a Medusa or EAGLE checkpoint written by :func:`save_baseline` (eval mode, ``dtype``).

    Refuses a hidden_size / vocab_size mismatch with ``target_config`` and any missing,
    unexpected or mis-shaped tensor. Medusa's stored ``lm_head.weight`` is not part of the
    module (the evaluator uses the target's); EAGLE still needs ``bind_target``.
    """
    from vllm_clover.model.checkpoint import CloverCheckpointError, _read_safetensors, _short

    directory = Path(directory)
    method = checkpoint_method(directory)
    if method not in BASELINES:
        raise CloverCheckpointError(f"{directory}: a {method} checkpoint, not a Medusa/EAGLE baseline")
    data = _read_config(directory)
    source = str(directory / CONFIG_NAME)
    info = data.get("vllm_clover") or {}
    if method == "medusa":
        shape_src = {k: data.get(k) for k in ("hidden_size", "vocab_size")}
        shape_src.update(num_attention_heads=1, intermediate_size=1)  # unused by Medusa
        heads, layers = data.get("num_heads"), data.get("num_hidden_layers")
    else:
        shape_src, heads, layers = data, info.get("num_speculative_tokens", 5), data.get("num_hidden_layers")
    try:
        config = shape_config(method, shape_src, heads, layers)
    except (ValueError, TypeError) as exc:
        raise CloverCheckpointError(f"{source}: {' '.join(str(exc).split())}") from None
    if target_config is not None:
        problem = config.target_mismatch(target_config)
        if problem:
            raise CloverCheckpointError(f"checkpoint {directory} {problem}")
    state = _read_safetensors(directory / WEIGHTS_NAME)
    with torch.device("meta"):
        model = build_baseline(method, config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if method == "medusa":  # vLLM's Medusa loads its (shared) LM head from the file
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    weights = str(directory / WEIGHTS_NAME)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing:
        raise CloverCheckpointError(f"{weights}: missing key(s) {_short(missing)}")
    if unexpected:
        raise CloverCheckpointError(f"{weights}: unexpected key(s) {_short(unexpected)}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CloverCheckpointError(f"{weights}: tensor {name} has shape {tuple(state[name].shape)}, "
                                        f"config.json implies {shape}")
    state.pop("lm_head.weight", None)  # the evaluator uses the target's own head
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.eval()


# ============================================================================ evaluation
@torch.no_grad()
def medusa_predictions(model: MedusaHeads, hbar: Tensor, shifted: Tensor, starts: Tensor, k: int,
                       lm_head: Tensor) -> tuple[list[Tensor], Tensor]:
    """Evaluator contract (evaluate.evaluate_sequence) for Medusa on one sequence.

    hbar [L, H] float32; starts [n]. Returns head outputs o_i [L-i, H] (head i at t predicts
    y_{t+2+i}; independent of tokens, so teacher-forced = free-running) and the greedy
    drafts [n, k]: d_j = argmax LMHead(o_j) at each start, as vLLM's MedusaProposer.
    """
    length = hbar.shape[0]
    outs = model(hbar)
    drafts = [F.linear(o[starts].to(lm_head.dtype), lm_head).argmax(-1) for o in outs[:k]]
    return [o[: max(length - i, 0)] for i, o in enumerate(outs)], torch.stack(drafts, dim=1)


@torch.no_grad()
def eagle_chain(model: EagleDrafter, f: Tensor, kv: KVCache, starts: Tensor, k: int, lm_head: Tensor,
                forced: Tensor | None = None, chunk: int = 64) -> tuple[list[Tensor], Tensor]:
    """Draft ``k`` steps from every start t, as vLLM's EAGLE proposer does.

    f [L, H] and kv (per layer [1, n_kv, L, d]): the teacher-forced pass over the sequence
    (vLLM's first pass: the draft KV of positions <= t always comes from true features).
    Step 0's feature is f_t; step j >= 1 feeds (its own previous feature, token) at
    position t+j, attending to positions <= t and to the chain's own earlier steps. The
    token is the previous draft, or with ``forced`` [L] (the true y_{t+1+j} = forced[t+j])
    the ground truth. Returns the features of each step, [n, H] per step, and drafts [n, k].
    """
    length = f.shape[0]
    feats: list[list[Tensor]] = [[f[:0]] for _ in range(k)]  # [0, H] each: no start is fine
    drafts: list[Tensor] = [torch.zeros(0, k, dtype=torch.long)]
    for c0 in range(0, len(starts), chunk):
        st = starts[c0:c0 + chunk]
        n = len(st)
        past = [(kk.expand(n, -1, -1, -1), vv.expand(n, -1, -1, -1)) for kk, vv in kv]
        prefix_ok = torch.arange(length)[None, :] <= st[:, None]  # [n, L]
        feat = f[st]
        token = F.linear(feat.to(lm_head.dtype), lm_head).argmax(-1)
        feats[0].append(feat)
        row = [token]
        for j in range(1, k):
            if forced is not None:
                token = forced[(st + j).clamp(max=length - 1)]
            mask = torch.cat((prefix_ok, torch.ones(n, j, dtype=torch.bool)), dim=1)[:, None, None, :]
            out, past = model.step(feat[:, None], token[:, None], (st + j)[:, None], mask, past)
            feat = out[:, 0]
            token = F.linear(feat.to(lm_head.dtype), lm_head).argmax(-1)
            feats[j].append(feat)
            row.append(token)
        drafts.append(torch.stack(row, dim=1))
    return [torch.cat(fs) for fs in feats], torch.cat(drafts)


@torch.no_grad()
def eagle_predictions(model: EagleDrafter, hbar: Tensor, shifted: Tensor, starts: Tensor, k: int,
                      lm_head: Tensor) -> tuple[list[Tensor], Tensor]:
    """Evaluator contract for EAGLE on one sequence (hbar [L, H], shifted [L] = y_{t+1}).

    "Head" j = draft step j. Its teacher-forced output at t is fed the TRUE tokens
    y_{t+1} .. y_{t+1+j} but its own features (as Clover head j is fed true tokens and its
    own states): [L-j, H]. The drafts [n, k] run fully on their own features and tokens.
    """
    length = hbar.shape[0]
    f, kv = model.teacher_forced(hbar[None], shifted[None])
    f = f[0]
    states, _ = eagle_chain(model, f, kv, torch.arange(length), k, lm_head, forced=shifted)
    _, drafts = eagle_chain(model, f, kv, starts, k, lm_head)
    return [s[: max(length - j, 0)] for j, s in enumerate(states)], drafts
