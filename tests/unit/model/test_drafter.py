"""Tests of the pure-PyTorch Clover drafter (vllm_clover.model.drafter, .layers). Tiny shapes, CPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_clover.model.config import CloverConfig
from vllm_clover.model.drafter import (
    CloverDrafter,
    build_drafter,
    clover_loss,
    init_from_target,
    match_token_value_scale,
)
from vllm_clover.model.layers import AttentionDecoder, AugmentingLayer, rope_cos_sin

H, V, B, T = 64, 128, 2, 12
VARIANTS = ("clover2", "clover")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_config(variant: str = "clover2", **kw) -> CloverConfig:
    values = dict(hidden_size=H, vocab_size=V, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, num_heads=4, num_layers=2, variant=variant)
    values.update(kw)
    return CloverConfig(**values)


def make_drafter(variant: str = "clover2", seed: int = 0, perturb: bool = True, **kw) -> CloverDrafter:
    """A drafter with a bound random lm_head; ``perturb`` moves it away from the
    near-identity init so that every weight matters in the comparisons."""
    torch.manual_seed(seed)
    drafter = CloverDrafter(tiny_config(variant, **kw))
    if perturb:
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.2 * torch.randn_like(p))
    drafter.bind_target(torch.randn(V, H))
    return drafter.eval()


def rand_inputs(seed: int = 1, b: int = B, t: int = T):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, H, generator=g), torch.randint(0, V, (b, t), generator=g)


# ---------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes(variant):
    d = make_drafter(variant)
    cfg = d.config
    x, ids = rand_inputs()
    with torch.no_grad():
        z, kv = d.trunk(x, ids)
        assert z.shape == (B, T, H)
        assert len(kv) == cfg.num_layers
        assert kv[0][0].shape == (B, cfg.num_key_value_heads, T, cfg.head_dim)
        state, o = d.head_step(z[:, -1], ids[:, -1], 0)
        assert state.shape == o.shape == (B, H)
        state, o = d.head_step(state, ids[:, -1], 1)
        assert state.shape == o.shape == (B, H)
        outs = d.forward_train(x, ids)
        assert [tuple(o.shape) for o in outs] == [(B, T - i, H) for i in range(cfg.num_heads)]
        tokens, probs = d.draft_chain(z[:, -1], ids[:, -1], k=3, return_probs=True)
        assert tokens.shape == (B, 3) and tokens.dtype == torch.long
        assert probs.shape == (B, 3, V)
        torch.testing.assert_close(probs.sum(-1), torch.ones(B, 3))
        # the returned token is the argmax of the returned distribution
        assert torch.equal(probs.argmax(-1), tokens)
    with pytest.raises(ValueError):
        d.draft_chain(z[:, -1], ids[:, -1], k=cfg.num_heads + 1)
    with pytest.raises(IndexError):
        d.head_step(z[:, -1], ids[:, -1], cfg.num_heads)


def test_target_weights_not_parameters():
    d = make_drafter()
    keys = set(d.state_dict())
    assert not any("lm_head" in k or "embed" in k for k in keys)
    assert all(p is not d.lm_head_weight for p in d.parameters())
    x, ids = rand_inputs()
    d.train()
    lm = d.lm_head_weight
    loss, _ = clover_loss(d.forward_train(x, ids), torch.randn(B, T, H), lm, torch.ones(B, T))
    loss.backward()
    assert lm.grad is None and not lm.requires_grad
    assert all(p.grad is not None for p in d.parameters())  # every trainable weight is used
    with pytest.raises(RuntimeError, match="bind_target"):
        CloverDrafter(tiny_config()).embed_weight


# ---------------------------------------------------------------------------- init
@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_decoder_near_identity_at_init(variant):
    torch.manual_seed(0)
    d = CloverDrafter(tiny_config(variant))
    eye = torch.eye(H)
    for dec in d._attention_decoders():
        for lin in (dec.q, dec.k):
            delta = lin.weight - eye
            assert 0.0 <= delta.min() and delta.max() <= 0.01 and delta.std() > 1e-3
        assert 0.0 <= dec.v.weight.min() and dec.v.weight.max() <= 0.01
        for lin in (dec.q, dec.k, dec.v):
            assert torch.count_nonzero(lin.bias) == 0
        h, e = torch.randn(8, H), torch.randn(8, H)
        out = dec(h, e)
        rel = (out - h).norm() / h.norm()
        assert 0 < rel < 0.1, rel
    if variant == "clover2":
        delta0 = d.head0_proj.weight - eye
        assert 0.0 <= delta0.min() and delta0.max() <= 0.01
        w2 = d.head_proj.weight
        assert w2.shape == (H, 2 * H)
        assert 0.0 <= (w2[:, :H] - eye).min() and (w2[:, :H] - eye).max() <= 0.01
        assert 0.0 <= w2[:, H:].min() and w2[:, H:].max() <= 0.01
        assert torch.count_nonzero(d.head0_proj.bias) == 0 and torch.count_nonzero(d.head_proj.bias) == 0
    else:
        for block in d.head_resblocks:
            assert torch.count_nonzero(block.linear.weight) == 0


def test_matched_token_value_init_makes_the_token_visible():
    """Official init: with a state 250x larger than the embeddings (SmolLM2's x_t vs E) the
    token changes AttnDec's output by ~1e-5 of the state; matched init (v = s*I) by ~0.1."""
    torch.manual_seed(0)
    d = CloverDrafter(tiny_config("clover2"))
    h, e1, e2 = 33.0 * torch.randn(16, H), 0.13 * torch.randn(16, H), 0.13 * torch.randn(16, H)

    @torch.no_grad()
    def token_effect() -> float:
        dec = d.trunk_decoder
        return float((dec(h, e1) - dec(h, e2)).norm() / h.norm())

    assert token_effect() < 1e-3
    scales = match_token_value_scale(d, {"trunk_decoder": 33.0, "head_decoder": 1.0}, 0.13)
    assert scales == pytest.approx({"trunk_decoder": 33.0 / 0.13, "head_decoder": 1.0 / 0.13})
    assert torch.equal(d.trunk_decoder.v.weight, scales["trunk_decoder"] * torch.eye(H))
    assert torch.count_nonzero(d.trunk_decoder.v.bias) == 0
    assert 0.02 < token_effect() < 0.5


def test_attention_decoder_formula():
    """Per-head cosine gate on v, residual on un-normalised h, q from RMSNorm(h) only."""
    torch.manual_seed(3)
    dec = AttentionDecoder(H, 4, 1e-6)
    with torch.no_grad():
        for p in dec.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    h, e = torch.randn(5, H) * 3, torch.randn(5, H)
    hn = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * dec.input_layernorm.weight
    q, k, v = dec.q(hn), dec.k(e), dec.v(e)
    expected = h.clone()
    for j in range(4):
        sl = slice(16 * j, 16 * (j + 1))
        a = (q[:, sl] * k[:, sl]).sum(-1) / (q[:, sl].norm(dim=-1) * k[:, sl].norm(dim=-1))
        expected[:, sl] += a[:, None] * v[:, sl]
    torch.testing.assert_close(dec(h, e), expected, rtol=1e-5, atol=1e-5)


def _hf_llama_config(**kw):
    from transformers import LlamaConfig
    values = dict(hidden_size=H, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=3, vocab_size=V, rms_norm_eps=1e-6, max_position_embeddings=256,
                  rope_theta=10000.0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    values.update(kw)
    cfg = LlamaConfig(**values)
    cfg._attn_implementation = "eager"
    return cfg


def test_init_from_target_copies_last_layer_and_norm():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    hf_cfg = _hf_llama_config(rope_theta=100000.0)
    target = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1 so the copy is visible
    cfg = CloverConfig.from_target_config(hf_cfg, num_heads=3)
    assert cfg.rope_theta == 10000.0  # official code ignores the target's rope_theta
    assert cfg.target_num_hidden_layers == 3 and cfg.target_architecture == "LlamaForCausalLM"
    d = build_drafter(cfg, target)
    last = target.model.layers[2].state_dict()
    for layer in d.layers:
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, last[name]), name
    assert not torch.equal(d.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(d.trunk_norm.weight, target.model.norm.weight)
    assert torch.equal(d.head_norm.weight, target.model.norm.weight)
    assert torch.equal(d.lm_head_weight, target.lm_head.weight)
    assert torch.equal(d.embed_weight, target.lm_head.weight)  # E = lm_head copy by default
    # state dict input and an explicit layer index work too
    d2 = init_from_target(CloverDrafter(cfg), target.state_dict(), layer_index=0)
    assert torch.equal(d2.layers[1].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight)


# ---------------------------------------------------------------------------- Aug block vs HF
def test_augmenting_layer_matches_hf_llama_decoder_layer():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    torch.manual_seed(0)
    hf_cfg = _hf_llama_config()
    hf_layer = LlamaDecoderLayer(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf_layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ours = AugmentingLayer(tiny_config())
    ours.load_state_dict(hf_layer.state_dict(), strict=True)  # identical parameter names
    x = torch.randn(B, T, H)
    pos = torch.arange(5, 5 + T).expand(B, T)  # non-zero start: positions really matter
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
    additive = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        ref = hf_layer(x, attention_mask=additive, position_ids=pos, position_embeddings=(cos, sin))
        ref = ref[0] if isinstance(ref, tuple) else ref
        my_cos, my_sin = rope_cos_sin(pos, 16, 10000.0, x.dtype)
        from vllm_clover.model.layers import build_attention_mask
        out, _ = ours(x, my_cos, my_sin, build_attention_mask(None, T, 0, B, x.device))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_custom_layers_keep_checkpoint_keys():
    """A host framework can plug in its own Llama layers; the keys must not change."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    hf_cfg = _hf_llama_config()
    custom = CloverDrafter(tiny_config(), make_layer=lambda i: LlamaDecoderLayer(hf_cfg, layer_idx=i))
    assert isinstance(custom.layers[1], LlamaDecoderLayer)
    ref = CloverDrafter(tiny_config())
    assert {k: v.shape for k, v in custom.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_trunk_kv_cache_matches_full_sequence(variant):
    d = make_drafter(variant)
    x, ids = rand_inputs()
    with torch.no_grad():
        full, _ = d.trunk(x, ids)
        z1, kv = d.trunk(x[:, :7], ids[:, :7])
        z2, kv2 = d.trunk(x[:, 7:], ids[:, 7:], past_kv=kv)
    torch.testing.assert_close(torch.cat((z1, z2), 1), full, rtol=1e-5, atol=1e-5)
    assert kv2[0][0].shape[2] == T


def test_right_padding_does_not_change_real_positions():
    d = make_drafter()
    x, ids = rand_inputs()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 8:] = 0
    x_pad = x.clone()
    x_pad[1, 8:] = 100.0  # garbage in padding must not leak into real positions
    with torch.no_grad():
        outs = d.forward_train(x_pad, ids, attention_mask=mask)
        alone = d.forward_train(x[1:, :8], ids[1:, :8])
    for i, o in enumerate(alone):
        torch.testing.assert_close(outs[i][1:, : 8 - i], o, rtol=1e-5, atol=1e-5)
    assert all(torch.isfinite(o).all() for o in outs)


def test_left_padding_is_masked_and_positions_follow_the_mask():
    d = make_drafter()
    x, ids = rand_inputs()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :4] = 0
    x_pad = x.clone()
    x_pad[1, :4] = 100.0  # padded keys precede real queries: only the mask hides them
    with torch.no_grad():
        outs = d.forward_train(x_pad, ids, attention_mask=mask)
        alone = d.forward_train(x[1:, 4:], ids[1:, 4:])  # positions 0..7 when run alone
    for i, o in enumerate(alone):
        torch.testing.assert_close(outs[i][1:, 4:], o, rtol=1e-5, atol=1e-5)
    assert all(torch.isfinite(o).all() for o in outs)  # fully padded query rows stay finite


# ---------------------------------------------------------------------------- inference == training
@pytest.mark.parametrize("variant", VARIANTS)
def test_head_step_chain_equals_teacher_forced_forward_train(variant):
    """The drafting path (trunk + K head_step calls on a flat batch) reproduces the
    teacher-forced training outputs when fed the same (ground-truth) tokens."""
    d = make_drafter(variant)
    x, ids = rand_inputs()
    k = d.config.num_heads
    with torch.no_grad():
        outs = d.forward_train(x, ids)
        z, _ = d.trunk(x, ids)
        for t in (0, 3, T - k):
            state, token = z[:, t], ids[:, t]  # token y_{t+1}, the target-sampled token
            for i in range(k):
                state, o = d.head_step(state, token, i)
                torch.testing.assert_close(o, outs[i][:, t], rtol=1e-5, atol=1e-5)
                if i + 1 < k:
                    token = ids[:, t + i + 1]  # ground truth y_{t+2+i}, what head i predicts


@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_chain_agrees_with_forward_train_on_its_own_tokens(variant):
    """Greedy chain tokens, written back into the sequence, are exactly what the
    teacher-forced path predicts at that position (causality keeps z_t unchanged)."""
    d = make_drafter(variant, seed=5)
    x, ids = rand_inputs(seed=7)
    k, t = d.config.num_heads, 4
    with torch.no_grad():
        z, _ = d.trunk(x, ids)
        tokens, probs = d.draft_chain(z[:, t], ids[:, t], return_probs=True)
        ids2 = ids.clone()
        ids2[:, t + 1: t + k] = tokens[:, : k - 1]
        outs = d.forward_train(x, ids2)
    for i in range(k):
        logits = d.logits(outs[i][:, t])
        assert torch.equal(logits.argmax(-1), tokens[:, i])
        torch.testing.assert_close(torch.softmax(logits, -1), probs[:, i], rtol=1e-4, atol=1e-6)
    # tree drafting: repeating a parent state per child gives each child the same result
    state, _ = d.head_step(z[:, t], ids[:, t], 0)
    rep = state.repeat_interleave(3, dim=0)
    children = torch.randint(0, V, (B * 3,))
    s_rep, o_rep = d.head_step(rep, children, 1)
    s_one, o_one = d.head_step(state[1:2], children[3:4], 1)
    torch.testing.assert_close(o_rep[3:4], o_one)


def test_clover2_head0_uses_trunk_token_and_clover1_head0_uses_first_token():
    d2, d1 = make_drafter("clover2"), make_drafter("clover")
    x, ids = rand_inputs()
    other = (ids + 1) % V
    with torch.no_grad():
        # Clover-2 fuses y_{t+1} in the trunk: changing it changes z, and head 0 ignores prev_token
        assert not torch.allclose(d2.trunk(x, ids)[0], d2.trunk(x, other)[0])
        z = d2.trunk(x, ids)[0][:, -1]
        assert torch.equal(d2.head_step(z, ids[:, -1], 0)[1], d2.head_step(z, other[:, -1], 0)[1])
        # Clover-1: trunk ignores the tokens, head 0 consumes y_{t+1}
        assert torch.equal(d1.trunk(x, ids)[0], d1.trunk(x, other)[0])
        z1 = d1.trunk(x, ids)[0][:, -1]
        assert not torch.allclose(d1.head_step(z1, ids[:, -1], 0)[1], d1.head_step(z1, other[:, -1], 0)[1])


# ---------------------------------------------------------------------------- official reference
def _official_forward(sd: dict, cfg: CloverConfig, x, ids, hf_layers):
    """Independent re-statement of the official Clover2Model.forward (clover2.py at 47d24b6),
    reading official key names; Aug layers are HF LlamaDecoderLayers."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    def rms(h, w):
        h32 = h.float()
        return w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(h.dtype)

    def res_attention_block(prefix, xx, y):  # ResAttentionBlock.forward
        d = cfg.hidden_size // cfg.num_attention_heads
        x_q = F.linear(rms(xx, sd[prefix + "input_layernorm.weight"]), sd[prefix + "q.weight"], sd[prefix + "q.bias"])
        y_k = F.linear(y, sd[prefix + "k.weight"], sd[prefix + "k.bias"])
        att = F.cosine_similarity(x_q.reshape(-1, d), y_k.reshape(-1, d), eps=cfg.rms_norm_eps)
        att = att.view(-1, cfg.num_attention_heads, 1)
        v = F.linear(y, sd[prefix + "v.weight"], sd[prefix + "v.bias"]).view(-1, cfg.num_attention_heads, d)
        return xx + (v * att).view(x_q.size())

    emb = F.embedding(ids, sd["clover_embed_tokens.weight"])
    h = res_attention_block("clover_head_mlp_rnn.", x, emb)
    t = x.shape[1]
    pos = torch.arange(t).expand(x.shape[0], t)
    rope = LlamaRotaryEmbedding(hf_layers[0].self_attn.config)(h, pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    for layer in hf_layers:
        h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        h = h[0] if isinstance(h, tuple) else h
    clover_h = rms(h, sd["clover_norm.weight"])
    outs = []
    for i in range(cfg.num_heads):  # get_all_head
        clover_h = clover_h[:, : emb.size(1) - i]
        tok = emb[:, i:]
        if i > 0:
            clover_h = res_attention_block("clover_head_mlp_rnn2.", clover_h, tok)
            o = F.linear(torch.cat([clover_h, tok], -1), sd["clover_head_mlp2.weight"], sd["clover_head_mlp2.bias"])
        else:
            o = F.linear(clover_h, sd["clover_head_mlp.weight"], sd["clover_head_mlp.bias"])
        outs.append(rms(o, sd["clover_head_norm.weight"]))
    return outs


def official_state_dict(d: CloverDrafter) -> dict:
    """Our weights renamed to the official Clover2Model keys (incl. frozen E and lm_head)."""
    rename = {"trunk_decoder.": "clover_head_mlp_rnn.", "head_decoder.": "clover_head_mlp_rnn2.",
              "head0_proj.": "clover_head_mlp.", "head_proj.": "clover_head_mlp2.",
              "trunk_norm.": "clover_norm.", "head_norm.": "clover_head_norm.", "layers.": "layers."}
    sd = {}
    for k, v in d.state_dict().items():
        prefix = next(p for p in rename if k.startswith(p))
        sd[rename[prefix] + k[len(prefix):]] = v.clone()
    sd["clover_embed_tokens.weight"] = d.embed_weight.clone()
    sd["lm_head.weight"] = d.lm_head_weight.clone()
    return sd


def test_forward_train_matches_official_reference():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    d = make_drafter("clover2", seed=11)
    sd = official_state_dict(d)
    hf_cfg = _hf_llama_config()
    hf_layers = []
    for i in range(d.config.num_layers):
        layer = LlamaDecoderLayer(hf_cfg, layer_idx=i).eval()
        layer.load_state_dict({k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")})
        hf_layers.append(layer)
    x, ids = rand_inputs(seed=13)
    with torch.no_grad():
        ref = _official_forward(sd, d.config, x, ids, hf_layers)
        ours = d.forward_train(x, ids)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"head {i}")


# ---------------------------------------------------------------------------- loss
def test_clover_loss_matches_per_position_formula():
    torch.manual_seed(0)
    k = 3
    outs = [torch.randn(B, T - i, H) for i in range(k)]
    target = torch.randn(B, T, H)
    lm = torch.randn(V, H) * 0.2
    mask = (torch.rand(B, T) > 0.3).long()
    mask[:, -1] = 0
    loss, m = clover_loss(outs, target, lm, mask)
    total = 0.0
    for i in range(k):
        n = mask[:, i:].sum().item() + 1
        v = p = 0.0
        correct = 0
        for b in range(B):
            for t in range(T - i):
                if not mask[b, t + i]:
                    continue
                o, tg = outs[i][b, t], target[b, t + i]
                diff = (o - tg).abs()
                v += torch.where(diff < 1, 0.5 * diff ** 2, diff - 0.5).mean().item()
                tp = torch.softmax(lm @ tg, -1)
                p -= (tp * torch.log_softmax(lm @ o, -1)).sum().item()
                correct += int((lm @ o).argmax() == (lm @ tg).argmax())
        assert m["vloss"][i].item() == pytest.approx(v / n, rel=1e-4)
        assert m["ploss"][i].item() == pytest.approx(p / n, rel=1e-4)
        assert m["correct"][i].item() == correct and m["total"][i].item() == n - 1
        total += 0.7 ** i * (10 * v / n + p / n)
    assert loss.item() == pytest.approx(total, rel=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_falls_with_adamw(variant):
    """Official optimiser settings (AdamW 1e-3, betas 0.9/0.95, clip by value 0.5) on a
    fixed small synthetic set: the loss must drop a lot and head-0 accuracy must rise."""
    torch.manual_seed(0)
    cfg = tiny_config(variant, num_heads=3, num_layers=1)
    d = CloverDrafter(cfg)
    lm = torch.randn(V, H) * 0.3
    d.bind_target(lm)
    x = torch.randn(4, 16, H)
    norm_w = 1.0 + 0.1 * torch.randn(H)
    h_bar = norm_w * x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # "target final norm"
    ids = torch.cat(((h_bar @ lm.T).argmax(-1)[:, 1:], torch.zeros(4, 1, dtype=torch.long)), 1)
    target = torch.cat((h_bar[:, 1:], torch.zeros(4, 1, H)), 1)
    mask = torch.ones(4, 16)
    mask[:, -1] = 0
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3, betas=(0.9, 0.95))
    losses, accs = [], []
    d.train()
    for _ in range(100):
        loss, m = clover_loss(d.forward_train(x, ids), target, lm, mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_value_(d.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
        accs.append(m["acc"][0].item())
    print(f"{variant}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, head-0 acc {accs[0]:.2f} -> {accs[-1]:.2f}")
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    assert accs[-1] > accs[0] + 0.2, (accs[0], accs[-1])
