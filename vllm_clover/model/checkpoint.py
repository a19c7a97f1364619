"""Drafter checkpoints: ``config.json`` (Medusa-shaped, see config.py) + ``model.safetensors``.

Only the drafter's trainable weights are stored; the embedding table E and the lm_head
belong to the target and are bound at load time. Every failure is a
:class:`CloverCheckpointError` with a one-line message naming the file and the problem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vllm_clover.model.config import CONFIG_NAME, OFFICIAL_ROPE_THETA, CloverConfig, CloverConfigError, read_json_dict
from vllm_clover.model.drafter import CloverDrafter

WEIGHTS_NAME = "model.safetensors"
OFFICIAL_BIN_NAME = "pytorch_model.bin"

# Official Clover-2 (Clover2Model) key prefix -> ours. Longest prefixes first, because
# "clover_head_mlp" is a prefix of "clover_head_mlp_rnn" and "clover_head_mlp2".
OFFICIAL_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("clover_head_mlp_rnn2.", "head_decoder."),
    ("clover_head_mlp_rnn.", "trunk_decoder."),
    ("clover_head_mlp2.", "head_proj."),
    ("clover_head_mlp.", "head0_proj."),
    ("clover_head_norm.", "head_norm."),
    ("clover_norm.", "trunk_norm."),
    ("layers.", "layers."),
)
# Frozen copies of target weights in official checkpoints; we bind them from the target.
OFFICIAL_DROPPED_PREFIXES = ("clover_embed_tokens.", "lm_head.")


class CloverCheckpointError(ValueError):
    """A checkpoint cannot be saved, read or used; one line naming the file and problem."""


# ============================================================================ save
def save_drafter(directory: str | os.PathLike, drafter: CloverDrafter, config: CloverConfig | None = None,
                 dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (trainable weights only) into ``directory``.

    ``dtype`` casts floating tensors (None keeps each tensor's dtype). Files are written to
    temporary names and renamed, so an interrupted save never leaves a half-written file
    under the final name. Returns the directory.
    """
    config = config or drafter.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        # clone(): safetensors refuses views / shared storage.
        tensors[name] = tensor.to("cpu").contiguous().clone()
    tmp = directory / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "vllm-clover"})
    os.replace(tmp, directory / WEIGHTS_NAME)
    config.save(directory)
    return directory


# ============================================================================ load
def load_drafter(directory: str | os.PathLike, target_config: Any = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, lm_head_weight: torch.Tensor | None = None,
                 embed_weight: torch.Tensor | None = None) -> CloverDrafter:
    """Load a drafter saved by :func:`save_drafter`.

    target_config: the target's HF config (or a mapping); if given, a hidden_size or
    vocab_size mismatch is refused. lm_head_weight / embed_weight [V, H]: optionally bound
    right away (see ``CloverDrafter.bind_target``). Returns the drafter in eval mode.
    """
    directory = Path(directory)
    config = _config_for_target(directory, target_config)
    state = _read_safetensors(directory / WEIGHTS_NAME)
    drafter = _drafter_from_state(config, state, str(directory / WEIGHTS_NAME))
    drafter = drafter.to(device=device, dtype=dtype).eval()
    if lm_head_weight is not None:
        drafter.bind_target(lm_head_weight.to(device=device), None if embed_weight is None
                            else embed_weight.to(device=device))
    return drafter


def load_config(directory: str | os.PathLike) -> CloverConfig:
    """Read and validate ``<directory>/config.json`` (errors as CloverCheckpointError)."""
    data = read_json_dict(directory, CloverCheckpointError, "vllm-clover checkpoint")
    try:
        return CloverConfig.from_dict(data, source=str(Path(directory) / CONFIG_NAME))
    except CloverConfigError as exc:
        raise CloverCheckpointError(str(exc)) from None


def validate_checkpoint(directory: str | os.PathLike, target_config: Any = None) -> CloverConfig:
    """Cheap, complete start-up check of a checkpoint without reading its tensors.

    Reads ``config.json`` and only the header of ``model.safetensors``: the file must be
    as long as its header says (catches truncation), and hold exactly the tensor names and
    shapes that ``config.json`` implies. ``target_config`` (HF config or mapping): refuse a
    hidden_size / vocab_size mismatch. Returns the checkpoint's config. Used by the front
    end before vLLM spawns engine processes, so users get one line instead of a worker
    traceback. Raises :class:`CloverCheckpointError`.
    """
    directory = Path(directory)
    config = _config_for_target(directory, target_config)
    path = directory / WEIGHTS_NAME
    shapes = _safetensors_header_shapes(path)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CloverDrafter(config).state_dict().items()}
    _check_tensor_shapes(expected, shapes, str(path))
    return config


def _config_for_target(directory: Path, target_config: Any) -> CloverConfig:
    """``load_config``, refusing a hidden_size / vocab_size mismatch with ``target_config``."""
    config = load_config(directory)
    if target_config is not None:
        problem = config.target_mismatch(target_config)
        if problem:
            raise CloverCheckpointError(f"checkpoint {directory} {problem}")
    return config


def _check_tensor_shapes(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]],
                         source: str) -> None:
    """Refuse missing, unexpected or wrongly shaped tensors: ``found`` must hold exactly the
    names of ``expected`` (what config.json implies), each with its shape."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise CloverCheckpointError(f"{source}: missing key(s) {_short(missing)}")
    if unexpected:
        raise CloverCheckpointError(f"{source}: unexpected key(s) {_short(unexpected)}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise CloverCheckpointError(
                f"{source}: tensor {name} has shape {found[name]}, config.json implies {shape}")


def _safetensors_header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; checks the file is not truncated."""
    if not path.is_file():
        raise CloverCheckpointError(f"{path}: missing")
    size = path.stat().st_size
    corrupt = f"{path}: truncated or corrupt safetensors file"
    try:
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise CloverCheckpointError(f"{corrupt} (only {size} bytes)")
            header_len = int.from_bytes(raw_len, "little")
            if header_len <= 0 or 8 + header_len > size:
                raise CloverCheckpointError(f"{corrupt} (header length {header_len}, file {size} bytes)")
            header = json.loads(fh.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        detail = " ".join(str(exc).split())
        raise CloverCheckpointError(f"{corrupt} ({detail})") from None
    if not isinstance(header, dict):
        raise CloverCheckpointError(f"{corrupt} (header is not an object)")
    shapes: dict[str, tuple[int, ...]] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in info["shape"])
            data_end = max(data_end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise CloverCheckpointError(f"{corrupt} (bad header entry for {name!r})") from None
    if 8 + header_len + data_end > size:
        raise CloverCheckpointError(
            f"{corrupt} (needs {8 + header_len + data_end} bytes, file has {size})")
    return shapes


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CloverCheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        detail = " ".join(str(exc).split())  # keep the message on one line
        raise CloverCheckpointError(f"{path}: truncated or corrupt safetensors file ({detail})") from None


def _drafter_from_state(config: CloverConfig, state: Mapping[str, torch.Tensor], source: str) -> CloverDrafter:
    """Build the drafter without random init (meta device) and assign ``state`` strictly."""
    with torch.device("meta"):
        drafter = CloverDrafter(config)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    _check_tensor_shapes(expected, {k: tuple(v.shape) for k, v in state.items()}, source)
    drafter.load_state_dict(dict(state), strict=True, assign=True)
    return drafter


def _short(keys: list[str], limit: int = 5) -> str:
    more = f" ... ({len(keys)} total)" if len(keys) > limit else ""
    return f"{keys[:limit]}{more}"


# ============================================================================ official -> ours
def convert_official(src_dir: str | os.PathLike, out_dir: str | os.PathLike,
                     dtype: torch.dtype | None = None) -> CloverConfig:
    """Convert an official Clover-2 checkpoint (XiaoBin1992/clover layout) into ours.

    src_dir holds the official ``config.json`` (the Llama-shaped draft config plus a
    ``"clover": {"num_heads", "num_layers", ...}`` dict) and ``model.safetensors`` or
    ``pytorch_model.bin`` with ``Clover2Model`` keys (see the name table in drafter.py).
    ``clover_embed_tokens`` and ``lm_head`` are dropped. The Aug-layer RoPE base is set to
    10000, which is what the official code actually uses. ``dtype`` None keeps the source
    dtype. Returns the written config.
    """
    src = Path(src_dir)
    raw = read_json_dict(src, CloverCheckpointError, "official Clover checkpoint")
    config = _official_config(raw, str(src / CONFIG_NAME))
    state, weights_path = _read_official_weights(src)
    state = _map_official_keys(state, weights_path)
    drafter = _drafter_from_state(config, state, weights_path)
    save_drafter(out_dir, drafter, config, dtype=dtype)
    return config


def _official_config(raw: Any, source: str) -> CloverConfig:
    if not isinstance(raw, Mapping):
        raise CloverCheckpointError(f"{source}: expected a JSON object")
    clover = raw.get("clover")
    if not isinstance(clover, Mapping):
        raise CloverCheckpointError(f"{source}: no 'clover' dict (not an official Clover-2 config)")
    missing = [k for k in ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")
               if k not in raw] + [f"clover.{k}" for k in ("num_heads", "num_layers") if k not in clover]
    if missing:
        raise CloverCheckpointError(f"{source}: missing key(s) {missing}")
    heads = raw["num_attention_heads"]
    try:
        return CloverConfig(
            variant="clover2",
            num_heads=clover["num_heads"],
            num_layers=clover["num_layers"],
            hidden_size=raw["hidden_size"],
            vocab_size=raw["vocab_size"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            # The official LlamaAttention always uses hidden_size // num_heads.
            head_dim=raw["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else None,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=OFFICIAL_ROPE_THETA,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            hidden_act=raw.get("hidden_act", "silu"),
            target_architecture=(raw.get("architectures") or [None])[0],
            target_name=raw.get("_name_or_path") or None,
        )
    except CloverConfigError as exc:
        raise CloverCheckpointError(str(exc).replace("CloverConfig:", f"{source}:", 1)) from None


def _read_official_weights(src: Path) -> tuple[dict[str, torch.Tensor], str]:
    st, bin_ = src / WEIGHTS_NAME, src / OFFICIAL_BIN_NAME
    if st.is_file():
        return _read_safetensors(st), str(st)
    if bin_.is_file():
        try:
            state = torch.load(str(bin_), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many types on bad files
            detail = " ".join(str(exc).split())[:300]
            raise CloverCheckpointError(f"{bin_}: truncated or corrupt ({detail})") from None
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CloverCheckpointError(f"{bin_}: not a state dict of tensors")
        return dict(state), str(bin_)
    raise CloverCheckpointError(f"{src}: neither {WEIGHTS_NAME} nor {OFFICIAL_BIN_NAME} found")


def _map_official_keys(state: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state.items():
        key = key.removeprefix("module.")  # DDP / accelerate wrappers
        if key.startswith(OFFICIAL_DROPPED_PREFIXES) or ".rotary_emb." in key:
            continue
        for old, new in OFFICIAL_KEY_MAP:
            if key.startswith(old):
                out[new + key[len(old):]] = tensor
                break
        else:
            unknown.append(key)
    if unknown:
        raise CloverCheckpointError(f"{source}: unknown official key(s) {_short(sorted(unknown))}")
    return out
