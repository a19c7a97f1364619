"""EAGLE-3 baseline (vllm_clover.training.eagle3): trained by ``train --method eagle3`` on the tiny
random Llama of conftest.py (sharpened as in test_baselines.py), loaded and computed by vLLM's own
``Eagle3LlamaForCausalLM``. tests/e2e/test_baselines_engine.py serves it in vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vllm_clover.training import eagle3 as E3
from vllm_clover.training.args import TrainingError
from vllm_clover.training.baselines import checkpoint_method, shape_config

from tests.unit.training.test_baselines import _CausalSDPA, sharpen
from tests.unit.training.test_train import _args, _cli_error

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STEPS = 30
TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5, num_hidden_layers=2,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})


def eagle3_args(target: Path, convs_file: Path, out: Path, **kw):
    values = dict(method="eagle3", num_layers=1, train_vocab=0, draft_vocab=512, steps=STEPS,
                  warmup_steps=1, lr=3e-3)
    values.update(kw)
    return _args(target, convs_file, out, **values)


@pytest.fixture(scope="module")
def sharp_target(tiny_target: Path, tmp_path_factory) -> Path:
    return sharpen(tiny_target, tmp_path_factory.mktemp("sharp3") / "sharp_target")


@pytest.fixture(scope="module")
def run(sharp_target: Path, convs_file: Path, tmp_path_factory) -> Path:
    """One finished 30-step EAGLE-3 run (3 training-time-test steps, 512-token draft vocabulary)."""
    out = tmp_path_factory.mktemp("eagle3") / "run"
    E3.train_eagle3(eagle3_args(sharp_target, convs_file, out), progress=False)
    return out


def _tiny_model(vocab_size: int = 100, draft: int = 40) -> E3.Eagle3Drafter:
    torch.manual_seed(0)
    config = shape_config("eagle", {**TINY, "vocab_size": vocab_size}, 3, 1)
    vocab = torch.sort(torch.randperm(vocab_size)[:draft]).values
    model = E3.Eagle3Drafter(config, (0, 1, 2), vocab).eval()
    return model.bind_target(torch.randn(vocab_size, 32))


# ----------------------------------------------------------------------------- the model
def test_ttt_equals_the_kv_cached_chain() -> None:
    """Training-time-test step k at t (own step-(k-1) output, true token y_{t+1+k}, position
    t+k, diagonal attention to the earlier steps) equals step k of vLLM's KV-cached draft
    chain from t fed the true tokens: what training optimises is what vLLM runs."""
    model = _tiny_model()
    aux, ids = torch.randn(1, 11, 96), torch.randint(0, 100, (1, 11))
    with torch.no_grad():
        outs = model.forward_ttt(aux, ids, torch.ones_like(ids), 3)
        shifted = E3.shift_left(ids, 1)
        pre, kv = model.teacher_forced(aux, shifted)
        starts = torch.arange(0, 8)
        feats, drafts = E3.eagle3_chain(model, pre[0], kv, starts, 3, forced=shifted[0])
    for k in range(3):
        torch.testing.assert_close(outs[k][0, starts], feats[k], rtol=1e-5, atol=1e-5)
    want = model.to_target_ids(model.logits(outs[0][0, starts]).argmax(-1))
    assert drafts[:, 0].tolist() == want.tolist()
    assert bool(model.t2d[drafts].all())  # drafts are target ids inside the draft vocabulary


def test_aux_features_are_the_targets_residual_streams(tiny_target: Path) -> None:
    """The hooks read the residual stream before layers 0 and 1 and before the final norm
    (HF hidden_states[0..2] except the last, which HF gives after the norm); the draft-vocabulary
    logits are the target's own at those ids; in_vocab says whether the full argmax is one."""
    from transformers import AutoModelForCausalLM

    vocab = torch.arange(0, 49152, 7)
    feats = E3.AuxFeatures(tiny_target, (0, 1, 2), vocab, "float32", torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (2, 9))
    att = torch.ones_like(ids)
    att[1, 6:] = 0
    aux, logits, in_vocab = feats(ids, att)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=att, output_hidden_states=True)
        pre_norm = {}
        hook = hf.model.norm.register_forward_pre_hook(lambda _m, a: pre_norm.setdefault("x", a[0]))
        hf.model(input_ids=ids, attention_mask=att)
        hook.remove()
    want = torch.cat([out.hidden_states[0], out.hidden_states[1], pre_norm["x"]], dim=-1)
    real = att.bool()
    torch.testing.assert_close(aux[real], want[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[real], out.logits[..., vocab][real], rtol=1e-4, atol=1e-4)
    assert torch.equal(in_vocab[real], (out.logits.argmax(-1) % 7 == 0)[real])


def test_aux_layer_ids_follow_vllm_default() -> None:
    assert E3.aux_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M: interfaces.py default (2, L//2, L-3)
    assert E3.aux_layer_ids(32) == (2, 16, 29)
    assert E3.aux_layer_ids(2) == (0, 1, 2)  # too shallow for the default: three distinct ids


# ----------------------------------------------------------------------------- training
def test_training_writes_vllms_format_and_learns(run: Path, sharp_target: Path) -> None:
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert len(history) == STEPS
    losses = [h["loss"] for h in history]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses
    acc0 = [h["correct"][0] / max(h["total"][0], 1) for h in history]
    assert np.mean(acc0[-5:]) > np.mean(acc0[:3]) + 0.1, acc0
    config = json.loads((run / "config.json").read_text())
    target = json.loads((sharp_target / "config.json").read_text())
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["draft_vocab_size"] == 512
    assert config["target_hidden_size"] == 32 and config["tie_word_embeddings"] is False
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == target[key], key
    assert checkpoint_method(run) == "eagle3"
    tensors = load_file(str(run / "model.safetensors"))
    layer = {"self_attn.q_proj.weight": (32, 64), "self_attn.k_proj.weight": (16, 64),
             "self_attn.v_proj.weight": (16, 64), "self_attn.o_proj.weight": (32, 32),
             "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32), "mlp.down_proj.weight": (32, 64),
             "input_layernorm.weight": (32,), "hidden_norm.weight": (32,), "post_attention_layernorm.weight": (32,)}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    # no embedding (vLLM shares the target's); the draft's own LM head over 512 tokens
    assert shapes == {"fc.weight": (32, 96), "norm.weight": (32,), "lm_head.weight": (512, 32),
                      "d2t": (512,), "t2d": (49152,), **{f"layers.0.{k}": v for k, v in layer.items()}}
    vocab = tensors["d2t"] + torch.arange(512)
    assert bool((vocab[1:] > vocab[:-1]).all()) and torch.equal(torch.nonzero(tensors["t2d"])[:, 0], vocab)
    model = E3.load_eagle3(run)
    assert torch.equal(model.vocab, vocab) and model.layer_ids == (0, 1, 2)


def test_resume_gives_identical_weights(sharp_target, convs_file, tmp_path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    E3.train_eagle3(eagle3_args(sharp_target, convs_file, full, steps=6), progress=False)
    args = eagle3_args(sharp_target, convs_file, part, steps=6)
    assert E3.train_eagle3(args, stop_after=3, progress=False) == {"interrupted_at_step": 3}
    E3.train_eagle3(args, resume=True, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_vllm_loads_the_checkpoint_and_computes_the_same(run, sharp_target, monkeypatch) -> None:
    """vLLM's loader (get_model: config -> registry -> Eagle3LlamaForCausalLM -> load_weights)
    reads the checkpoint, and its modules compute what ours compute: fc on the aux states,
    the decoder layer (only the paged attention kernel replaced by plain causal attention),
    both outputs, and the draft-vocabulary logits mapped into the target vocabulary by d2t."""
    import tempfile

    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, \
        set_current_vllm_config
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel, \
        ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model

    from vllm_clover.training.features import load_target_head

    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda *a, **k: None)  # as test_baselines
    _n, _e, _lm, emb = load_target_head(sharp_target, dtype=torch.float32)
    ours = E3.load_eagle3(run).bind_target(emb)
    g = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(12, 96, generator=g) * 3, torch.randint(0, 49152, (12,), generator=g)
    model_config = ModelConfig(model=str(sharp_target), dtype="float32", enforce_eager=True, max_model_len=256)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="eagle3", model=str(run), num_speculative_tokens=3,
                             target_model_config=model_config, target_parallel_config=parallel)
    vllm_config = VllmConfig(model_config=model_config, speculative_config=spec, parallel_config=parallel,
                             cache_config=CacheConfig(block_size=16))
    try:
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            ensure_model_parallel_initialized(1, 1)
            theirs = get_model(vllm_config=vllm_config, model_config=spec.draft_model_config)
            assert type(theirs).__name__ == "Eagle3LlamaForCausalLM"
            assert theirs.has_own_lm_head and not theirs.has_own_embed_tokens
            theirs.model.embed_tokens.weight.data.copy_(emb)  # the proposer shares the target's
            attn = theirs.model.layers[0].self_attn
            attn.attn = _CausalSDPA(attn.num_heads, attn.num_kv_heads, attn.head_dim)
            with torch.no_grad():
                combined = theirs.combine_hidden_states(aux)
                torch.testing.assert_close(combined, ours.fc(aux), rtol=1e-5, atol=1e-5)
                normed, pre = theirs(ids.int(), torch.arange(12), combined)
                mine, _ = ours.teacher_forced(aux[None], ids[None])
                torch.testing.assert_close(pre, mine[0], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(normed, ours.norm(mine[0]), rtol=1e-4, atol=1e-4)
                logits = theirs.compute_logits(normed)  # [12, 49152], -inf outside the vocabulary
                draft_logits = ours.logits(mine[0])
                torch.testing.assert_close(logits[:, ours.vocab], draft_logits, rtol=1e-4, atol=1e-4)
                assert bool(torch.isinf(logits[:, ~ours.t2d]).all())
                assert torch.equal(logits.argmax(-1), ours.to_target_ids(draft_logits.argmax(-1)))
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


# ----------------------------------------------------------------------------- bad input
def test_bad_settings_give_one_line(tiny_target, convs_file, tmp_path) -> None:
    with pytest.raises(TrainingError, match="one decoder layer"):
        E3.train_eagle3(eagle3_args(tiny_target, convs_file, tmp_path / "a", num_layers=2), progress=False)
    with pytest.raises(TrainingError, match="--draft-vocab"):
        E3.train_eagle3(eagle3_args(tiny_target, convs_file, tmp_path / "b", draft_vocab=0, train_vocab=64),
                        progress=False)
    base = ["train", "--target", str(tiny_target), "--data", str(convs_file), "--method", "eagle3"]
    assert "1..16" in _cli_error([*base, "--num-heads", "0", "--out", str(tmp_path / "c")])
