"""Configuration of a Clover / Clover-2 drafter, and its ``config.json`` format.

The drafter directory is loaded by vLLM through its ``MedusaConfig`` (``model_type:
"medusa"``). ``MedusaConfig.from_pretrained`` renames every *top-level* key whose name
contains "num" and "heads" to ``num_heads`` (and "num" + "layers" to
``num_hidden_layers``), so a top-level ``num_attention_heads`` would silently overwrite
the number of speculative heads. The file therefore keeps only six keys at the top level
and nests everything else under ``"clover"``::

    {
      "architectures": ["CloverForSpeculativeDecoding"],
      "model_type": "medusa",
      "hidden_size": 576, "vocab_size": 49152,
      "num_heads": 5,                  # speculative heads (draft tokens per step)
      "num_hidden_layers": 2,          # Augmenting Block decoder layers
      "clover": {"format_version": 1, "variant": "clover2", "num_attention_heads": 9, ...,
                 "target": {"architecture": "LlamaForCausalLM", "num_hidden_layers": 30, ...}}
    }

Pure Python: importing this module needs neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping

ARCHITECTURE = "CloverForSpeculativeDecoding"
MODEL_TYPE = "medusa"
CONFIG_NAME = "config.json"
FORMAT_VERSION = 1
VARIANTS = ("clover2", "clover")
# RoPE base of the Augmenting Block. The official code builds LlamaRotaryEmbedding with
# its default base and ignores the target's rope_theta, so a
# checkpoint-compatible drafter uses 10000 whatever the target says.
OFFICIAL_ROPE_THETA = 10000.0

# Keys of the nested "clover" dict that must be present when reading a config.json.
_REQUIRED_NESTED = (
    "variant",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)
_REQUIRED_TOP = ("architectures", "model_type", "hidden_size", "vocab_size", "num_heads",
                 "num_hidden_layers", "clover")


class CloverConfigError(ValueError):
    """A Clover config is invalid; the message is one line naming the source and problem."""



def read_json_dict(directory: str | os.PathLike, error: type[Exception], what: str) -> dict[str, Any]:
    """``<directory>/config.json`` as a dict, or ``error`` with one line naming the file:
    the directory is missing, the file is missing (``what`` says what the directory should
    have been), unreadable, not JSON, or not a JSON object."""
    directory = Path(directory)
    if not directory.is_dir():
        raise error(f"{what} directory {directory} does not exist")
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise error(f"{path}: missing (not a {what} directory)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data

@dataclass
class CloverConfig:
    """Everything needed to build a drafter, plus the identity of its target.

    Shape fields (``hidden_size`` .. ``max_position_embeddings``) describe the target's
    decoder layers, which the Augmenting Block copies; ``num_attention_heads`` also sets
    the per-head split of the Attention Decoders (head size ``hidden_size //
    num_attention_heads``, as in the official ``ResAttentionBlock``).
    """

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    variant: str = "clover2"
    num_heads: int = 5
    num_layers: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = OFFICIAL_ROPE_THETA
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    # Target identity: informational, and used to refuse an obviously wrong pairing.
    target_architecture: str | None = None
    target_num_hidden_layers: int | None = None
    target_tie_word_embeddings: bool | None = None
    target_name: str | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None and _is_int(self.hidden_size) and _is_int(self.num_attention_heads) \
                and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.validate("CloverConfig")

    # ------------------------------------------------------------------ validation
    def validate(self, source: str = "CloverConfig") -> None:
        """Raise :class:`CloverConfigError` ("<source>: <problem>") on the first problem."""
        problem = self._first_problem()
        if problem is not None:
            raise CloverConfigError(f"{source}: {problem}")

    def _first_problem(self) -> str | None:
        if self.variant not in VARIANTS:
            return f"unknown variant {self.variant!r} (expected one of {', '.join(VARIANTS)})"
        for name in ("num_heads", "num_layers", "hidden_size", "vocab_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                return f"{name} must be an integer >= 1, got {value!r}"
        if self.hidden_size % self.num_attention_heads:
            return (f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads} (the Attention Decoder splits hidden_size per head)")
        if self.num_attention_heads % self.num_key_value_heads:
            return (f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                    f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            return f"head_dim must be even for rotary embeddings, got {self.head_dim}"
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                return f"{name} must be a number > 0, got {value!r}"
        if self.hidden_act != "silu":
            return f"hidden_act {self.hidden_act!r} is not supported (only 'silu', as in Llama)"
        return None

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_target_config(cls, target: Any, **overrides: Any) -> "CloverConfig":
        """Build a config whose Augmenting Block has the shapes of ``target``'s layers.

        ``target`` is a Hugging Face ``LlamaConfig`` (or any object / mapping with the same
        attribute names). ``rope_theta`` is NOT taken from the target: it stays 10000 as in
        the official code unless passed in ``overrides``.
        """
        def get(name: str, default: Any = None) -> Any:
            if isinstance(target, Mapping):
                return target.get(name, default)
            return getattr(target, name, default)

        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        archs = get("architectures") or []
        values: dict[str, Any] = dict(
            hidden_size=hidden,
            vocab_size=get("vocab_size"),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or (hidden // heads if hidden and heads else None),
            intermediate_size=get("intermediate_size"),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            max_position_embeddings=get("max_position_embeddings", 2048),
            hidden_act=get("hidden_act", "silu"),
            target_architecture=archs[0] if archs else None,
            target_num_hidden_layers=get("num_hidden_layers"),
            target_tie_word_embeddings=get("tie_word_embeddings"),
            target_name=get("name_or_path") or get("_name_or_path") or None,
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise CloverConfigError(f"CloverConfig: unknown override(s) {sorted(unknown)}")
        values.update(overrides)
        return cls(**values)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The Medusa-shaped ``config.json`` content (see module docstring)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "clover": {
                "format_version": FORMAT_VERSION,
                "variant": self.variant,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings,
                "hidden_act": self.hidden_act,
                "target": {
                    "architecture": self.target_architecture,
                    "num_hidden_layers": self.target_num_hidden_layers,
                    "tie_word_embeddings": self.target_tie_word_embeddings,
                    "name": self.target_name,
                },
            },
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = CONFIG_NAME) -> "CloverConfig":
        """Parse :meth:`to_dict` output (also accepts a vLLM ``MedusaConfig.to_dict()``)."""
        if not isinstance(data, Mapping):
            raise CloverConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        nested = data.get("clover")
        if isinstance(nested, Mapping) and "num_layers" in nested and data.get("model_type") != MODEL_TYPE:
            raise CloverConfigError(
                f"{source}: this looks like an official Clover-2 checkpoint; convert it first "
                "with vllm_clover.model.checkpoint.convert_official")
        missing = [k for k in _REQUIRED_TOP if k not in data]
        if missing:
            raise CloverConfigError(f"{source}: missing key(s) {missing}")
        if data["model_type"] != MODEL_TYPE:
            raise CloverConfigError(
                f"{source}: model_type is {data['model_type']!r}, expected {MODEL_TYPE!r}")
        archs = data["architectures"]
        if not isinstance(archs, list) or ARCHITECTURE not in archs:
            raise CloverConfigError(f"{source}: architectures is {archs!r}, expected [{ARCHITECTURE!r}]")
        if not isinstance(nested, Mapping):
            raise CloverConfigError(f"{source}: key 'clover' must be an object, got {nested!r}")
        missing = [f"clover.{k}" for k in _REQUIRED_NESTED if k not in nested]
        if missing:
            raise CloverConfigError(f"{source}: missing key(s) {missing}")
        version = nested.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise CloverConfigError(
                f"{source}: clover.format_version {version!r} is not supported (expected {FORMAT_VERSION})")
        target = nested.get("target") or {}
        if not isinstance(target, Mapping):
            raise CloverConfigError(f"{source}: key 'clover.target' must be an object, got {target!r}")
        values = dict(
            hidden_size=data["hidden_size"],
            vocab_size=data["vocab_size"],
            num_heads=data["num_heads"],
            num_layers=data["num_hidden_layers"],
            hidden_act=nested.get("hidden_act", "silu"),
            target_architecture=target.get("architecture"),
            target_num_hidden_layers=target.get("num_hidden_layers"),
            target_tie_word_embeddings=target.get("tie_word_embeddings"),
            target_name=target.get("name"),
        )
        values.update({k: nested[k] for k in _REQUIRED_NESTED})
        try:
            return cls(**values)
        except CloverConfigError as exc:  # re-label with the file name
            raise CloverConfigError(str(exc).replace("CloverConfig:", f"{source}:", 1)) from None

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/config.json`` atomically; returns its path."""
        path = Path(directory) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CONFIG_NAME}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CloverConfig":
        """Read a ``config.json`` file, or the one inside directory ``path``."""
        path = Path(path)
        directory = path if path.is_dir() else path.parent
        if not path.is_dir() and path.name != CONFIG_NAME:
            raise CloverConfigError(f"{path}: expected a directory or a {CONFIG_NAME} file")
        data = read_json_dict(directory, CloverConfigError, "Clover config")
        return cls.from_dict(data, source=str(directory / CONFIG_NAME))

    # ------------------------------------------------------------------ target checks
    def target_mismatch(self, target: Any) -> str | None:
        """Describe why this drafter cannot serve ``target`` (HF config or mapping), else None."""
        for name in ("hidden_size", "vocab_size"):
            have = target.get(name) if isinstance(target, Mapping) else getattr(target, name, None)
            mine = getattr(self, name)
            if have is not None and have != mine:
                return f"was trained for {name} {mine}, target has {have}"
        return None

    def replace(self, **changes: Any) -> "CloverConfig":
        """A validated copy with some fields changed."""
        values = asdict(self)
        values.update(changes)
        return CloverConfig(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
