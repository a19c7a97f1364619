"""A training run's resumable state as safetensors plus JSON: nothing is unpickled.

``save_state(dir, state)`` writes a nested structure of dicts, lists, tuples, scalars,
strings, torch tensors and numpy arrays (model and optimizer state dicts, the scheduler's,
RNG states, history) as::

    dir/state.json                     the structure, with each tensor replaced by its key,
                                       and the tensor file's name and sha256
    dir/state-<step>.safetensors       the tensors, bit-exact

The tensor file is written first under a new name, then ``state.json`` atomically, then
older tensor files are removed, so a crash at any point leaves a ``state.json`` that names a
complete tensor file. :func:`load_state` checks the hash and rebuilds the structure; a
tampered or truncated file fails with one line (:class:`StateError`). Loading reads JSON
and safetensors only, so a state file cannot run code (``torch.load`` of a pickle can).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_JSON = "state.json"
FORMAT = "vllm-clover-training-state/1"
# The pickle file earlier versions wrote; refused, never loaded.
LEGACY_PICKLE = "state.pt"


class StateError(RuntimeError):
    """A training state that is missing, tampered with or unreadable (one line)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of ``obj``; tensors go to ``tensors`` under fresh keys."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).astype(np.int64 if obj.dtype.kind in "iu" else obj.dtype))
        return {"__ndarray__": key, "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a training state")


def _decode(obj: Any, tensors: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors.get_tensor(obj["__tensor__"])
    if "__ndarray__" in obj:
        return tensors.get_tensor(obj["__ndarray__"]).numpy().astype(np.dtype(obj["dtype"]))
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(directory: str | os.PathLike, state: dict[str, Any], step: int) -> Path:
    """Write ``state`` into ``directory`` (layout: module docstring); returns state.json."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, tensors)
    name = f"state-{step:08d}.safetensors"
    tmp = d / f".{name}.tmp{os.getpid()}"
    save_file(tensors, str(tmp))
    os.replace(tmp, d / name)
    doc = {"format": FORMAT, "tensors": name, "sha256": _sha256(d / name), "state": structure}
    tmp_json = d / f".{STATE_JSON}.tmp{os.getpid()}"
    tmp_json.write_text(json.dumps(doc))
    os.replace(tmp_json, d / STATE_JSON)
    for old in d.glob("state-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return d / STATE_JSON


def has_state(directory: str | os.PathLike) -> bool:
    return (Path(directory) / STATE_JSON).is_file()


def load_state(directory: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The state :func:`save_state` wrote in ``directory``; :class:`StateError` if it is
    missing, in the old pickle format, tampered with or truncated."""
    from safetensors import safe_open

    d = Path(directory)
    path = d / STATE_JSON
    if not path.is_file():
        if (d / LEGACY_PICKLE).is_file():
            raise StateError(f"{d / LEGACY_PICKLE} is a pickle from an older vllm-clover and is not loaded "
                             "(unpickling can run code): start the run again without --resume")
        raise StateError(f"no training state in {d} ({STATE_JSON} missing)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateError(f"training state {path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError(f"training state {path} is not a {FORMAT} file")
    tensor_path = d / str(doc.get("tensors", ""))
    if tensor_path.parent != d or not tensor_path.is_file():
        raise StateError(f"training state {path} names a tensor file that is not in {d}: {doc.get('tensors')!r}")
    if _sha256(tensor_path) != doc.get("sha256"):
        raise StateError(f"training state tensors {tensor_path} do not match the sha256 in {path} "
                         "(modified or truncated)")
    try:
        with safe_open(str(tensor_path), "pt", device=str(device)) as tensors:
            return _decode(doc["state"], tensors)
    except StateError:
        raise
    except Exception as exc:  # noqa: BLE001  (safetensors raises several types for a bad file)
        raise StateError(f"training state {path} is inconsistent with its tensors: {exc}") from None
