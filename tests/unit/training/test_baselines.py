"""Medusa-1 / EAGLE-1 baselines (vllm_clover.training.baselines): trained by ``train --method``, loaded
by vLLM's own ``Medusa`` / ``EagleLlamaForCausalLM`` modules, evaluated by ``eval``.

Built on the tiny random Llama target of tests/unit/training/test_train.py (conftest.py ``tiny_target``,
sharpened below). tests/e2e/test_baselines_engine.py serves them in vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vllm_clover.training.state import load_state
from vllm_clover.training import baselines as B
from vllm_clover.training import evaluate as E
from vllm_clover.training import train as T
from vllm_clover.training.features import load_target_head, rms_norm

from tests.unit.training.test_train import _args, _cli_error

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

METHODS = ("medusa", "eagle")
STEPS = 30


def sharpen(target: Path, out: Path, scale: float = 30.0) -> Path:
    """A copy of ``target`` in ``out`` with its (tied) embedding / LM head scaled: the random
    target's next-token distributions become peaked instead of near uniform, so a pure
    soft-label cross-entropy (Medusa's loss) has something to learn."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for path in target.iterdir():
        shutil.copy(path, out / path.name)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def sharp_target(tiny_target: Path, tmp_path_factory) -> Path:
    return sharpen(tiny_target, tmp_path_factory.mktemp("sharp") / "sharp_target")


@pytest.fixture(scope="module")
def runs(sharp_target: Path, convs_file: Path, tmp_path_factory) -> dict[str, Path]:
    """One finished 30-step training run per method (3 heads / 3 draft tokens, 1 layer)."""
    root = tmp_path_factory.mktemp("baselines")
    out = {}
    for method in METHODS:
        out[method] = root / method
        T.train(_args(sharp_target, convs_file, out[method], method=method, num_layers=1, steps=STEPS,
                      warmup_steps=1, lr=3e-3), progress=False)
    return out


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("method", METHODS)
def test_loss_falls(runs, method: str) -> None:
    history = _history(runs[method])
    assert len(history) == STEPS
    losses = [h["loss"] for h in history]
    # on the tiny target Medusa's loss (soft-label CE only) falls by about a quarter, EAGLE's far more
    assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:3]), losses
    if method == "eagle":
        vloss = [h["vloss"][0] for h in history]
        assert np.mean(vloss[-5:]) < 0.8 * np.mean(vloss[:3]), vloss
    report = json.loads((runs[method] / "training.json").read_text())
    assert report["args"]["method"] == method
    assert len(report["final_train_metrics"]["acc_per_head"]) == (3 if method == "medusa" else 1)


def test_medusa_checkpoint_format(runs, sharp_target: Path) -> None:
    config = json.loads((runs["medusa"] / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "vllm_clover"} == {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": 32, "vocab_size": 49152,
        "num_heads": 3, "num_hidden_layers": 1, "medusa_fc_bias": True, "original_lm_head": True,
        "truncated_vocab_size": 49152}
    # No other top-level "num..." key: MedusaConfig.from_pretrained would rename it to num_heads.
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    tensors = load_file(str(runs["medusa"] / "model.safetensors"))
    expected = {f"blocks.{i}.layers.0.{p}": (32, 32) if p == "weight" else (32,)
                for i in range(3) for p in ("weight", "bias")}
    expected["lm_head.weight"] = (49152, 32)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(v.dtype == torch.bfloat16 for k, v in tensors.items() if k != "lm_head.weight")
    # the shared LM head is an exact copy of the target's (tied: its embedding)
    assert torch.equal(tensors["lm_head.weight"], load_target_head(sharp_target)[2])


def test_medusa_head_subset_equals_training_fewer_heads(runs, sharp_target, convs_file, tmp_path) -> None:
    """The first heads of a 3-head run are a 1-head run on the same data (heads share nothing)."""
    from vllm_clover.training.baselines import BaselineError, medusa_head_subset

    one = tmp_path / "one"
    T.train(_args(sharp_target, convs_file, one, method="medusa", num_heads=1, num_layers=1, steps=STEPS,
                  warmup_steps=1, lr=3e-3), progress=False)
    sub = medusa_head_subset(runs["medusa"], tmp_path / "sub", 1)
    assert json.loads((sub / "config.json").read_text()) == json.loads((one / "config.json").read_text())
    got, want = load_file(str(sub / "model.safetensors")), load_file(str(one / "model.safetensors"))
    assert set(got) == set(want) == {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "lm_head.weight"}
    for name in want:  # bf16 on disk; summation order may differ in the last bit
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-2, atol=1e-3)
    with pytest.raises(BaselineError, match="cannot keep 4"):
        medusa_head_subset(runs["medusa"], tmp_path / "bad", 4)
    with pytest.raises(BaselineError, match="not a Medusa checkpoint"):
        medusa_head_subset(runs["eagle"], tmp_path / "bad", 1)


def test_eagle_checkpoint_format(runs, sharp_target: Path) -> None:
    config = json.loads((runs["eagle"] / "config.json").read_text())
    target = json.loads((sharp_target / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["num_hidden_layers"] == 1
    for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_parameters", "vocab_size"):
        assert config[key] == target[key], key
    assert config["vllm_clover"]["num_speculative_tokens"] == 3
    tensors = load_file(str(runs["eagle"] / "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    layer = {"self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
             "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
             "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
             "mlp.down_proj.weight": (32, 64), "post_attention_layernorm.weight": (32,)}
    # no layers.0.input_layernorm (vLLM replaces it by Identity), no embedding, no LM head
    assert shapes == {"fc.weight": (32, 64), **{f"layers.0.{k}": v for k, v in layer.items()}}
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())


def test_resume_gives_identical_weights_for_eagle(tiny_target, convs_file, tmp_path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    kw = dict(method="eagle", num_layers=1, keep_checkpoint=True)
    T.train(_args(tiny_target, convs_file, full, **kw), progress=False)
    args = _args(tiny_target, convs_file, part, **kw)
    assert T.train(args, stop_after=3, progress=False) == {"interrupted_at_step": 3}
    T.train(args, resume=True, progress=False)
    a = load_state(full / "checkpoint")
    b = load_state(part / "checkpoint")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


# ----------------------------------------------------------------------------- the models
def test_eagle_chain_equals_recomputing_the_extended_sequence() -> None:
    """A drafted step (own feature + own token at position t+j, attending to the prefix <= t
    and the chain) equals the teacher-forced pass over the sequence extended by the chain:
    what vLLM's KV-cached draft steps compute."""
    tc = dict(architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5,
              rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(0)
    model = B.build_baseline("eagle", B.shape_config("eagle", tc, 3, 1)).eval()
    lm, emb = torch.randn(100, 32), torch.randn(100, 32)
    model.bind_target(lm, emb)
    hbar, ids, starts = torch.randn(9, 32), torch.randint(0, 100, (9,)), torch.tensor([0, 3, 5, 8])
    with torch.no_grad():
        f, kv = model.teacher_forced(hbar[None], ids[None])
        feats, drafts = B.eagle_chain(model, f[0], kv, starts, 3, lm, chunk=3)
        for n, t in enumerate(starts.tolist()):
            h = torch.cat([hbar[: t + 1], feats[0][n:n + 1], feats[1][n:n + 1]])
            again, _ = model.teacher_forced(h[None], torch.cat([ids[: t + 1], drafts[n, :2]])[None])
            torch.testing.assert_close(again[0, t + 1:], torch.stack([feats[1][n], feats[2][n]]))
            assert drafts[n].tolist() == (again[0, t:] @ lm.T).argmax(-1).tolist()


class _CausalSDPA(torch.nn.Module):
    """Stands in for vLLM's paged ``Attention`` (which needs an engine's forward context):
    plain causal attention over one sequence, q/k/v [T, n*d] -> [T, n_q*d]."""

    def __init__(self, n_q: int, n_kv: int, d: int) -> None:
        super().__init__()
        self.n_q, self.n_kv, self.d = n_q, n_kv, d

    def forward(self, q, k, v, *args, **kwargs):
        t = q.shape[0]
        q, k, v = (a.view(t, n, self.d).transpose(0, 1) for a, n in ((q, self.n_q), (k, self.n_kv), (v, self.n_kv)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(0, 1).reshape(t, self.n_q * self.d)


def test_vllm_modules_load_our_checkpoints_and_compute_the_same(runs, sharp_target, monkeypatch) -> None:
    """vLLM's own loader (get_model: config -> registry -> Medusa / EagleLlamaForCausalLM ->
    load_weights, strict for Medusa) reads our checkpoints, and vLLM's modules compute what
    ours compute: Medusa's logits exactly; EAGLE's draft feature f with vLLM's fc, RoPE,
    norms and MLP (only the paged attention kernel replaced by plain causal attention)."""
    import tempfile

    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, \
        set_current_vllm_config
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel, \
        ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model

    # The loader empties the accelerator cache; a CPU-only torch has none (vLLM's CPU runner
    # patches this the same way, v1/worker/cpu_model_runner.py:178).
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda *a, **k: None)
    target_config = json.loads((sharp_target / "config.json").read_text())
    norm_w, eps, lm, emb = load_target_head(sharp_target, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    hbar = rms_norm(torch.randn(12, 32, generator=g) * 5, norm_w, eps)
    ids = torch.randint(0, 49152, (12,), generator=g)
    model_config = ModelConfig(model=str(sharp_target), dtype="float32", enforce_eager=True, max_model_len=256)
    parallel = ParallelConfig()
    initialised = False
    try:
        for method in METHODS:
            spec = SpeculativeConfig(method=method, model=str(runs[method]), num_speculative_tokens=3,
                                     target_model_config=model_config, target_parallel_config=parallel)
            vllm_config = VllmConfig(model_config=model_config, speculative_config=spec, parallel_config=parallel,
                                     cache_config=CacheConfig(block_size=16))
            with set_current_vllm_config(vllm_config):
                if not initialised:
                    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                 distributed_init_method=f"file://{tempfile.mktemp()}")
                    ensure_model_parallel_initialized(1, 1)
                    initialised = True
                vllm_model = get_model(vllm_config=vllm_config, model_config=spec.draft_model_config)
                ours = B.load_baseline(runs[method], target_config).bind_target(lm, emb)
                names = {n for n, _ in vllm_model.named_parameters()}
                with torch.no_grad():
                    if method == "medusa":
                        assert type(vllm_model).__name__ == "Medusa"
                        file_keys = set(load_file(str(runs[method] / "model.safetensors")))
                        assert names == file_keys  # and the loader checked every one was loaded
                        theirs = vllm_model.compute_logits(vllm_model(hbar))
                        mine = [F.linear(o, lm) for o in ours(hbar)]
                        for a, b in zip(theirs, mine, strict=True):
                            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
                            assert torch.equal(a.argmax(-1), b.argmax(-1))
                    else:
                        assert type(vllm_model).__name__ == "EagleLlamaForCausalLM"
                        stacked = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
                                   ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}
                        file_keys = set()
                        for key in load_file(str(runs[method] / "model.safetensors")):
                            for old, new in stacked.items():
                                key = key.replace(old, new)
                            file_keys.add("model." + key)
                        assert names - file_keys == {"model.embed_tokens.weight"} and file_keys <= names
                        # no own embedding / LM head in the file: vLLM shares the target's
                        assert not vllm_model.has_own_embed_tokens and not vllm_model.has_own_lm_head
                        vllm_model.model.embed_tokens.weight.data.copy_(emb)
                        attn = vllm_model.model.layers[0].self_attn
                        attn.attn = _CausalSDPA(attn.num_heads, attn.num_kv_heads, attn.head_dim)
                        theirs, _ = vllm_model(ids.int(), torch.arange(len(ids)), hbar)
                        mine = ours.teacher_forced(hbar[None], ids[None])[0][0]
                        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
                        assert torch.equal(F.linear(theirs, lm).argmax(-1), F.linear(mine, lm).argmax(-1))
    finally:
        if initialised:
            destroy_model_parallel()
            destroy_distributed_environment()


# ----------------------------------------------------------------------------- evaluation
def test_eval_runs_on_both_baselines(runs, sharp_target, convs_file, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path / "cache"))
    for method, k in (("medusa", 3), ("eagle", 4)):  # EAGLE may draft past its default 3
        report = E.evaluate(E.EvalArgs(heads=str(runs[method]), target=str(sharp_target), data=str(convs_file),
                                       max_len=128, k=k, json_path=str(tmp_path / f"{method}.json"),
                                       feature_dtype="float32"), progress=False)
        assert report["method"] == method and report["k_max"] == k
        assert len(report["per_head_accuracy"]) == k and all(0 <= a <= 1 for a in report["per_head_accuracy"])
        lengths = [row["mean_acceptance_length_decode"] for row in report["chain"]]
        assert all(1.0 <= a <= row["k"] + 1 for a, row in zip(lengths, report["chain"]))
        assert lengths == sorted(lengths)
        assert f"({method})" in E.format_report(report)
    assert "must be in 1..3" in _cli_error(["eval", "--heads", str(runs["medusa"]), "--target", str(sharp_target),
                                            "--data", str(convs_file), "-k", "4"])


# ----------------------------------------------------------------------------- bad input
def test_bad_method_and_inputs_give_one_line(tiny_target, convs_file, tmp_path) -> None:
    base = ["train", "--target", str(tiny_target), "--data", str(convs_file)]
    msg = _cli_error([*base, "--method", "hydra", "--out", str(tmp_path / "o1")])
    assert "--method 'hydra' is not supported" in msg and "medusa" in msg and "eagle" in msg
    assert "clover only" in _cli_error([*base, "--method", "medusa", "--token-value-init", "matched",
                                        "--out", str(tmp_path / "o2")])
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert "none of" in _cli_error(["eval", "--heads", str(odd), "--target", str(tiny_target)])
    with pytest.raises(B.BaselineError, match="RoPE type 'llama3'"):
        B.shape_config("eagle", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, 3, 1)
