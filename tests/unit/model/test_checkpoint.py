"""Tests of the drafter config.json format and checkpoint I/O (no vLLM needed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_clover.model.checkpoint import (
    CloverCheckpointError,
    convert_official,
    load_drafter,
    save_drafter,
)
from vllm_clover.model.config import CloverConfig, CloverConfigError
from tests.unit.model.test_drafter import H, V, make_drafter, official_state_dict, rand_inputs, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOP_LEVEL = {"architectures", "model_type", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers", "clover"}


def outputs(drafter, seed=1):
    x, ids = rand_inputs(seed)
    with torch.no_grad():
        return drafter.forward_train(x, ids)


@pytest.fixture
def saved(tmp_path):
    d = make_drafter("clover2")
    save_drafter(tmp_path / "ckpt", d, dtype=torch.float32)
    return tmp_path / "ckpt", d


# ---------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("variant", ("clover2", "clover"))
def test_round_trip_same_outputs(tmp_path, variant):
    d = make_drafter(variant)
    save_drafter(tmp_path, d, dtype=torch.float32)
    loaded = load_drafter(tmp_path, lm_head_weight=d.lm_head_weight)
    assert loaded.config == d.config
    assert not loaded.training
    for a, b in zip(outputs(d), outputs(loaded)):
        assert torch.equal(a, b)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == set(d.state_dict())
    assert not any("lm_head" in k or "embed" in k for k in tensors)


def test_default_save_is_bfloat16_and_close(tmp_path):
    d = make_drafter("clover2")
    save_drafter(tmp_path, d)
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "model.safetensors")).values())
    loaded = load_drafter(tmp_path, lm_head_weight=d.lm_head_weight, dtype=torch.float32)
    assert next(loaded.parameters()).dtype == torch.float32
    for a, b in zip(outputs(d), outputs(loaded)):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_config_json_is_medusa_shaped(saved):
    ckpt, d = saved
    data = json.loads((ckpt / "config.json").read_text())
    assert set(data) == TOP_LEVEL
    assert data["architectures"] == ["CloverForSpeculativeDecoding"] and data["model_type"] == "medusa"
    assert (data["num_heads"], data["num_hidden_layers"]) == (d.config.num_heads, d.config.num_layers)
    assert data["clover"]["num_attention_heads"] == 4 and data["clover"]["variant"] == "clover2"
    assert data["clover"]["rope_theta"] == 10000.0
    # MedusaConfig renames any top-level key containing num+heads / num+layers: only ours may exist
    for k in data:
        if "num" in k and "heads" in k:
            assert k == "num_heads"
        if "num" in k and "layers" in k:
            assert k == "num_hidden_layers"


def test_config_survives_vllm_medusa_config(saved):
    medusa = pytest.importorskip("vllm.transformers_utils.configs.medusa")
    ckpt, d = saved
    cfg = medusa.MedusaConfig.from_pretrained(str(ckpt))
    assert cfg.num_heads == d.config.num_heads and cfg.num_hidden_layers == d.config.num_layers
    assert cfg.hidden_size == H and cfg.vocab_size == V
    assert cfg.architectures == ["CloverForSpeculativeDecoding"]
    assert CloverConfig.from_dict(cfg.to_dict()) == d.config  # what a vLLM module would do


def test_from_target_config_and_overrides():
    target = {"hidden_size": 576, "vocab_size": 49152, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "intermediate_size": 1536, "num_hidden_layers": 30, "rms_norm_eps": 1e-5,
              "rope_theta": 100000.0, "tie_word_embeddings": True, "architectures": ["LlamaForCausalLM"],
              "max_position_embeddings": 8192}
    cfg = CloverConfig.from_target_config(target, num_heads=4)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.num_heads) == (576, 64, 3, 4)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.target_tie_word_embeddings is True and cfg.target_num_hidden_layers == 30
    assert CloverConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(CloverConfigError, match="unknown override"):
        CloverConfig.from_target_config(target, num_head=4)


# ---------------------------------------------------------------------------- config errors
def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("change, expected", [
    ({"variant": "clover3"}, "unknown variant 'clover3'"),
    ({"num_heads": 0}, "num_heads must be an integer >= 1, got 0"),
    ({"num_layers": 0}, "num_layers must be an integer >= 1"),
    ({"hidden_size": 66}, "hidden_size 66 is not divisible by num_attention_heads 4"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a number > 0"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_config_validation_errors(change, expected):
    with pytest.raises(CloverConfigError, match="^CloverConfig: ") as exc:
        tiny_config(**change)
    assert expected in _one_line(exc)


def _write_config(tmp_path, mutate):
    data = tiny_config().to_dict()
    mutate(data)
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path / "config.json"


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.pop("vocab_size"), "missing key(s) ['vocab_size']"),
    (lambda d: d["clover"].pop("head_dim"), "missing key(s) ['clover.head_dim']"),
    (lambda d: d.update(model_type="llama"), "model_type is 'llama', expected 'medusa'"),
    (lambda d: d.update(architectures=["MedusaModel"]), "architectures is ['MedusaModel']"),
    (lambda d: d["clover"].update(variant="eagle"), "unknown variant 'eagle'"),
    (lambda d: d.update(num_heads=0), "num_heads must be an integer >= 1, got 0"),
    (lambda d: d["clover"].update(num_attention_heads=5), "not divisible by num_attention_heads 5"),
    (lambda d: d["clover"].update(format_version=99), "format_version 99 is not supported"),
])
def test_config_file_errors_name_the_file(tmp_path, mutate, expected):
    path = _write_config(tmp_path, mutate)
    with pytest.raises(CloverConfigError) as exc:
        CloverConfig.load(tmp_path)
    msg = _one_line(exc)
    assert msg.startswith(f"{path}: ") and expected in msg, msg


def test_config_file_not_json_or_official(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CloverConfigError, match="not valid JSON"):
        CloverConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "clover": {"num_heads": 5, "num_layers": 2}}))
    with pytest.raises(CloverConfigError, match="convert_official"):
        CloverConfig.load(tmp_path)


# ---------------------------------------------------------------------------- checkpoint errors
def test_missing_directory_and_files(tmp_path, saved):
    ckpt, _ = saved
    with pytest.raises(CloverCheckpointError, match=r"checkpoint directory .*nope does not exist"):
        load_drafter(tmp_path / "nope")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CloverCheckpointError, match=r"model\.safetensors: missing$"):
        load_drafter(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CloverCheckpointError, match=r"config\.json: missing"):
        load_drafter(ckpt)


def test_bad_config_in_checkpoint_is_a_checkpoint_error(saved):
    ckpt, _ = saved
    data = json.loads((ckpt / "config.json").read_text())
    data["clover"]["variant"] = "nope"
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CloverCheckpointError, match=r"config\.json: unknown variant 'nope'") as exc:
        load_drafter(ckpt)
    _one_line(exc)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors(saved, damage):
    ckpt, _ = saved
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[: len(raw) // 2], "garbage": b"\x00\xff" * 64, "empty": b""}[damage])
    with pytest.raises(CloverCheckpointError, match="truncated or corrupt safetensors") as exc:
        load_drafter(ckpt)
    assert _one_line(exc).startswith(str(path))


def _rewrite_tensors(ckpt, mutate):
    tensors = load_file(str(ckpt / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_unexpected_and_misshapen_keys(saved):
    ckpt, _ = saved
    _rewrite_tensors(ckpt, lambda t: t.pop("head_proj.bias"))
    with pytest.raises(CloverCheckpointError, match=r"missing key\(s\) \['head_proj.bias'\]") as exc:
        load_drafter(ckpt)
    _one_line(exc)
    _rewrite_tensors(ckpt, lambda t: t.update({"head_proj.bias": torch.zeros(H), "lm_head.weight": torch.zeros(V, H)}))
    with pytest.raises(CloverCheckpointError, match=r"unexpected key\(s\) \['lm_head.weight'\]"):
        load_drafter(ckpt)
    _rewrite_tensors(ckpt, lambda t: (t.pop("lm_head.weight"), t.update({"head_proj.bias": torch.zeros(H + 1)})))
    with pytest.raises(CloverCheckpointError,
                       match=r"tensor head_proj.bias has shape \(65,\), config.json implies \(64,\)"):
        load_drafter(ckpt)


def test_target_mismatch(saved):
    ckpt, d = saved
    with pytest.raises(CloverCheckpointError) as exc:
        load_drafter(ckpt, target_config={"hidden_size": 576, "vocab_size": V})
    assert _one_line(exc) == f"checkpoint {ckpt} was trained for hidden_size {H}, target has 576"
    from transformers import LlamaConfig
    with pytest.raises(CloverCheckpointError, match=f"was trained for vocab_size {V}, target has 49152"):
        load_drafter(ckpt, target_config=LlamaConfig(hidden_size=H, vocab_size=49152))
    ok = load_drafter(ckpt, target_config={"hidden_size": H, "vocab_size": V})
    assert ok.config == d.config


# ---------------------------------------------------------------------------- official converter
def _write_official(src, d, fmt):
    src.mkdir()
    sd = official_state_dict(d)
    if fmt == "bin":
        torch.save({"module." + k: v for k, v in sd.items()}, src / "pytorch_model.bin")
    else:
        save_file(sd, str(src / "model.safetensors"))
    # Official draft config: Llama-shaped (num_hidden_layers 1 is only used for init) + "clover".
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "vocab_size": V,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
           "rope_theta": 500000.0, "hidden_act": "silu",
           "clover": {"num_heads": d.config.num_heads, "num_layers": d.config.num_layers,
                      "heads_coefficient": 1.0, "decay_coefficient": 0.7}}
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_convert_official_gives_identical_outputs(tmp_path, fmt):
    d = make_drafter("clover2", seed=21)
    _write_official(tmp_path / "official", d, fmt)
    config = convert_official(tmp_path / "official", tmp_path / "ours", dtype=torch.float32)
    assert config.rope_theta == 10000.0  # not the 500000 of the draft config: official code ignores it
    assert config == d.config.replace(target_architecture="LlamaForCausalLM")
    loaded = load_drafter(tmp_path / "ours", lm_head_weight=d.lm_head_weight)
    for a, b in zip(outputs(d), outputs(loaded)):
        assert torch.equal(a, b)
    tensors = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert "clover_embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    assert set(tensors) == set(d.state_dict())


def test_convert_official_errors(tmp_path):
    d = make_drafter("clover2")
    src = tmp_path / "official"
    _write_official(src, d, "safetensors")
    sd = load_file(str(src / "model.safetensors"))
    sd["clover_head_mlp3.weight"] = torch.zeros(2)
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(CloverCheckpointError, match=r"unknown official key\(s\) \['clover_head_mlp3.weight'\]"):
        convert_official(src, tmp_path / "out")
    sd.pop("clover_head_mlp3.weight")
    sd.pop("clover_norm.weight")
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(CloverCheckpointError, match=r"missing key\(s\) \['trunk_norm.weight'\]"):
        convert_official(src, tmp_path / "out")
    (src / "model.safetensors").unlink()
    with pytest.raises(CloverCheckpointError, match="neither model.safetensors nor pytorch_model.bin"):
        convert_official(src, tmp_path / "out")
    (src / "config.json").write_text(json.dumps({"hidden_size": H}))
    with pytest.raises(CloverCheckpointError, match="no 'clover' dict"):
        convert_official(src, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
