"""Target-feature cache for training Clover heads: computed once, reused afterwards.

What is stored
--------------
For every token of every tokenised training conversation: its id, its loss-mask bit (1 on
assistant-response tokens, see :func:`vllm_clover.training.data.tokenize_conversation`) and ``x_t``,
the target's last decoder-layer output BEFORE the final RMSNorm (the residual stream; Clover's
``hidden_states_onnorm``). In transformers 5.x, ``output_hidden_states=True`` does NOT give
this: ``capture_outputs`` (``utils/output_capturing.py``) overwrites ``hidden_states[-1]`` with
``last_hidden_state``, which is after ``model.norm``. We therefore read the input of
``model.model.norm`` with a forward pre-hook, and run only the decoder (no LM head).

On-disk format (version 1; also in ``docs/feature-cache.md``)
-------------------------------------------------------------
A directory holding

* ``manifest.json``: ``format_version``; ``complete`` (false until every shard exists);
  ``target`` (absolute model dir, sha256 of ``config.json``, name/size/mtime of each
  ``*.safetensors``, hidden size, layer count, vocab size); ``tokenizer`` (sha256 of the
  tokenizer and chat-template files, eos id); ``feature`` (``"pre_final_norm_last_layer"``);
  ``hidden_dtype`` (storage, always ``bfloat16``) and ``compute_dtype``; ``max_len``;
  ``data`` (free-form ``source`` label, sha256 ``fingerprint`` of the conversations' ids and
  messages, input/kept/dropped conversation counts, ``num_sequences``, ``num_tokens``,
  ``num_loss_tokens``); ``shards`` (file, first sequence, sequence and token counts);
  ``args`` (``shard_tokens``, ``batch_tokens``); ``created``, library versions.
* ``shard_00000.safetensors``, ``shard_00001.safetensors``, ...: whole sequences concatenated
  along the token axis (N tokens, S sequences in the shard):

  ============  ========  =======  ==============================================
  tensor        dtype     shape    meaning
  ============  ========  =======  ==============================================
  input_ids     int32     [N]      token ids y_0 .. y_{L-1} of each sequence
  loss_mask     uint8     [N]      1 = assistant-response token
  hidden        bfloat16  [N, H]   x_t, last-layer pre-final-norm hidden state
  seq_offsets   int64     [S+1]    sequence s is rows seq_offsets[s]:seq_offsets[s+1]
  conv_index    int64     [S]      index of the sequence's conversation in the input list
  ============  ========  =======  ==============================================

Sequences keep the order of the input conversations; conversations whose (truncated) sequence
has no assistant token after position 0 are skipped (nothing to train on).

Every file is written to a temp name and renamed, so a file that exists is complete. A run
whose manifest matches (same key: format, target fingerprint, tokenizer, dtypes, max_len,
data fingerprint, shard size) skips existing shards (resume) or returns at once when
complete; a mismatching manifest raises :class:`FeatureCacheMismatch` unless
``overwrite=True``, which clears the directory and recomputes.

Training batches (padding, the shift by one, the masks) are built from this cache by
:mod:`vllm_clover.training.batches`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from vllm_clover.training.data import Conversation, tokenize_conversation

FORMAT_VERSION = 1
FEATURE_KIND = "pre_final_norm_last_layer"
MANIFEST = "manifest.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "tokenizer.model")
# Manifest entries that must agree for an existing cache to be reused or resumed.
_KEY_FIELDS = ("format_version", "feature", "target", "tokenizer", "hidden_dtype",
               "compute_dtype", "max_len", "data_fingerprint", "shard_tokens")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32}


class FeatureCacheError(RuntimeError):
    """A feature cache is missing, incomplete or unreadable."""


class FeatureCacheMismatch(FeatureCacheError):
    """An existing feature cache was built from different inputs."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


# --------------------------------------------------------------------------- fingerprints


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def target_fingerprint(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Identify a target model: config hash, weight files' size and mtime, key dimensions."""
    model_dir = Path(model_dir).resolve()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FeatureCacheError(f"target model config not found: {config_path}")
    config = json.loads(config_path.read_text())
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise FeatureCacheError(f"no *.safetensors weights in target model dir {model_dir}")
    # size + mtime instead of a content hash: hashing 0.5 GB on every reuse check is slow,
    # and a rewrite of the weights changes the mtime.
    return {
        "model_dir": str(model_dir),
        "config_sha256": _sha256_file(config_path),
        "weights": [{"file": p.name, "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                    for p in weights],
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "vocab_size": config.get("vocab_size"),
    }


def tokenizer_fingerprint(model_dir: str | os.PathLike, tokenizer) -> dict[str, Any]:
    """Hashes of the tokenizer / chat-template files in ``model_dir``, plus the eos id."""
    model_dir = Path(model_dir)
    files = {name: _sha256_file(model_dir / name)
             for name in _TOKENIZER_FILES if (model_dir / name).is_file()}
    return {"files_sha256": files, "eos_token_id": tokenizer.eos_token_id}


def data_fingerprint(convs: Sequence[Conversation]) -> str:
    """sha256 over the conversations' ids and messages, in order."""
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.id, c.messages], sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


# --------------------------------------------------------------------------- planning


@dataclass
class _Seq:
    conv_index: int
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]


def _tokenize_all(tokenizer, convs: Sequence[Conversation], max_len: int) -> list[_Seq]:
    seqs = []
    for i, conv in enumerate(convs):
        ids, mask = tokenize_conversation(tokenizer, conv.messages, max_len)
        # Position t trains on mask[t+1]; a sequence with no such bit set teaches nothing.
        if sum(mask[1:]) == 0:
            continue
        seqs.append(_Seq(i, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    return seqs


def _plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[dict[str, int]]:
    """Cut the sequence list into consecutive shards of at most ``shard_tokens`` tokens
    (a longer single sequence gets a shard of its own)."""
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append({"first_sequence": start, "num_sequences": i - start, "num_tokens": tokens})
            start, tokens = i, 0
        tokens += n
    if len(lengths) > start:
        shards.append({"first_sequence": start, "num_sequences": len(lengths) - start,
                       "num_tokens": tokens})
    for k, s in enumerate(shards):
        s["file"] = shard_name(k)
    return shards


def _length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sequence indices by length (longest first) so that B * max_len <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        # Sorted descending, so the first member of the batch sets its padded length.
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


# --------------------------------------------------------------------------- target forward


def load_target_for_features(model_dir: str | os.PathLike, dtype: str = "bfloat16"):
    """Load the target with transformers, eval mode; returns (causal_lm, decoder, final_norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_DTYPES[dtype])
    model.eval()
    decoder = getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if decoder is None or not isinstance(norm, torch.nn.Module):
        raise FeatureCacheError(f"{model_dir}: expected a Llama-style model with model.model.norm "
                                f"(got {type(model).__name__})")
    return model, decoder, norm


@torch.inference_mode()
def prenorm_hidden(decoder, norm: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor) -> torch.Tensor:
    """x_t for a right-padded batch: ids [B,T], mask [B,T] -> [B,T,H] (input of the final norm).

    Runs the decoder only (the LM head is the costliest matmul and is not needed) and reads
    the final norm's input through a forward pre-hook.
    """
    captured: list[torch.Tensor] = []
    handle = norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        # All-ones masks are dropped so attention can take the plain causal path.
        mask = None if bool(attention_mask.all()) else attention_mask
        decoder(input_ids=input_ids, attention_mask=mask, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise FeatureCacheError(f"final norm ran {len(captured)} times in one forward; expected 1")
    return captured[0]


def _compute_shard(decoder, norm, seqs: Sequence[_Seq], batch_tokens: int,
                   device: str = "cpu") -> dict[str, torch.Tensor]:
    lengths = [len(s.input_ids) for s in seqs]
    hidden: list[torch.Tensor | None] = [None] * len(seqs)
    for batch in _length_batches(lengths, batch_tokens):
        t = lengths[batch[0]]
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        att = torch.zeros(len(batch), t, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.from_numpy(seqs[i].input_ids.astype(np.int64))
            att[row, : lengths[i]] = 1
        out = prenorm_hidden(decoder, norm, ids.to(device), att.to(device)).to(torch.bfloat16).cpu()
        for row, i in enumerate(batch):
            # Right padding + causal attention: real positions never see the padding.
            hidden[i] = out[row, : lengths[i]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in seqs])),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in seqs])),
        "hidden": torch.cat(hidden, dim=0).contiguous(),
        "seq_offsets": torch.from_numpy(offsets),
        "conv_index": torch.tensor([s.conv_index for s in seqs], dtype=torch.int64),
    }


# --------------------------------------------------------------------------- cache files


def _atomic_write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _atomic_save_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION)})
    os.replace(tmp, path)


def read_manifest(cache: str | os.PathLike) -> dict[str, Any]:
    path = Path(cache) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FeatureCacheError(f"no feature cache manifest at {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise FeatureCacheError(f"unreadable feature cache manifest {path}: {exc}") from None


def _shard_ok(path: Path, expected_sequences: int) -> bool:
    """A shard file counts as done if it opens and holds the planned number of sequences."""
    from safetensors import safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return f.get_slice("seq_offsets").get_shape()[0] == expected_sequences + 1
    except Exception:  # noqa: BLE001 - any unreadable shard is simply recomputed
        return False


def _key(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: manifest.get(k) for k in _KEY_FIELDS}


def extract_features(
    model_dir: str | os.PathLike,
    convs: Sequence[Conversation],
    out_dir: str | os.PathLike,
    *,
    max_len: int = 1024,
    dtype: str = "bfloat16",
    data_source: str = "unspecified",
    shard_tokens: int = 1 << 17,
    batch_tokens: int = 8192,
    overwrite: bool = False,
    num_threads: int | None = None,
    verbose: bool = True,
    device: str = "cpu",
) -> Path:
    """Compute (or reuse) the feature cache for ``convs`` in ``out_dir``; returns ``out_dir``.

    ``dtype`` is the compute dtype of the target forward (``bfloat16`` or ``float32``); storage
    is always bf16. ``shard_tokens`` bounds tokens per shard (~1.1 KB per token at H=576),
    ``batch_tokens`` bounds padded tokens per forward. ``data_source`` is a label recorded in
    the manifest (e.g. ``"sharegpt_v3:train[:2000]"``). ``num_threads`` sets torch's thread
    count for the forward (on a CPU shared with other jobs, 1 thread can beat 2: idle OpenMP
    threads spin). ``device`` runs the target forward there (``"cuda"``: the same features up
    to float rounding; not part of the cache key). See the module docstring for reuse, resume
    and mismatch rules.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    dtype = "bfloat16" if _DTYPES[dtype] == torch.bfloat16 else "float32"
    from transformers import AutoTokenizer

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    key = _cache_key(model_dir, tokenizer, convs, dtype, max_len, shard_tokens)
    old = _reusable_manifest(out, key, overwrite)
    if old is not None and old.get("complete"):
        if verbose:
            print(f"[vllm-clover] reusing feature cache {out}", file=sys.stderr)
        return out

    seqs = _tokenize_all(tokenizer, convs, max_len)
    if not seqs:
        raise FeatureCacheError("no conversation has an assistant token to train on")
    shards = _plan_shards([len(s.input_ids) for s in seqs], shard_tokens)
    if old is not None and old.get("shards") != shards:
        raise FeatureCacheError(f"feature cache {out}: shard plan changed for identical inputs; "
                                "delete the directory")
    manifest = _new_manifest(key, old, convs, seqs, shards, data_source, batch_tokens)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write_json(out / MANIFEST, manifest)
    todo = [s for s in shards if not _shard_ok(out / s["file"], s["num_sequences"])]
    if todo:
        _compute_shards(model_dir, out, todo, seqs, dtype, batch_tokens, num_threads, verbose, device)
    manifest["complete"] = True
    _atomic_write_json(out / MANIFEST, manifest)
    return out


def _cache_key(model_dir: str | os.PathLike, tokenizer, convs: Sequence[Conversation], dtype: str,
               max_len: int, shard_tokens: int) -> dict[str, Any]:
    """The manifest entries (``_KEY_FIELDS``) that decide whether a cache can be reused."""
    return {
        "format_version": FORMAT_VERSION,
        "feature": FEATURE_KIND,
        "target": target_fingerprint(model_dir),
        "tokenizer": tokenizer_fingerprint(model_dir, tokenizer),
        "hidden_dtype": "bfloat16",
        "compute_dtype": dtype,
        "max_len": max_len,
        "data_fingerprint": data_fingerprint(convs),
        "shard_tokens": shard_tokens,
    }


def _reusable_manifest(out: Path, key: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The manifest already in ``out`` when it was built from the same inputs (``key``), else
    None; a mismatch raises :class:`FeatureCacheMismatch`, or with ``overwrite`` clears ``out``."""
    old = read_manifest(out) if (out / MANIFEST).is_file() else None
    if old is not None and _key(old) != key:
        if not overwrite:
            diff = sorted(k for k in _KEY_FIELDS if old.get(k) != key[k])
            raise FeatureCacheMismatch(
                f"feature cache {out} was built from different inputs (differs in: "
                f"{', '.join(diff)}); pass overwrite=True or use another directory")
        shutil.rmtree(out)
        old = None
    return old


def _new_manifest(key: dict[str, Any], old: dict[str, Any] | None, convs: Sequence[Conversation],
                  seqs: Sequence[_Seq], shards: list[dict[str, int]], data_source: str,
                  batch_tokens: int) -> dict[str, Any]:
    """The manifest of a cache being written (``complete`` False); keeps ``old``'s ``created``."""
    import transformers

    return {
        **key,
        "complete": False,
        "data": {
            "source": data_source,
            "fingerprint": key["data_fingerprint"],
            "num_conversations_in": len(convs),
            "num_conversations_kept": len(seqs),
            "num_conversations_dropped_no_loss": len(convs) - len(seqs),
            "num_sequences": len(seqs),
            "num_tokens": int(sum(len(s.input_ids) for s in seqs)),
            "num_loss_tokens": int(sum(int(s.loss_mask[1:].sum()) for s in seqs)),
        },
        "shards": shards,
        "args": {"shard_tokens": key["shard_tokens"], "batch_tokens": batch_tokens, "max_len": key["max_len"],
                 "dtype": key["compute_dtype"]},
        "created": (old or {}).get("created") or datetime.now(timezone.utc).isoformat(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _compute_shards(model_dir: str | os.PathLike, out: Path, todo: Sequence[dict[str, int]], seqs: Sequence[_Seq],
                    dtype: str, batch_tokens: int, num_threads: int | None, verbose: bool, device: str) -> None:
    """Load the target once and write the shards of ``todo`` (torch's thread count restored after)."""
    threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        model, decoder, norm = load_target_for_features(model_dir, dtype)
        model.to(device)
        for s in todo:
            start = time.perf_counter()
            part = seqs[s["first_sequence"]: s["first_sequence"] + s["num_sequences"]]
            _atomic_save_shard(out / s["file"], _compute_shard(decoder, norm, part, batch_tokens, device))
            if verbose:
                secs = time.perf_counter() - start
                print(f"[vllm-clover] {out / s['file']}: {s['num_tokens']} tokens in {secs:.1f} s "
                      f"({s['num_tokens'] / secs:.0f} tok/s)", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- reading


class FeatureDataset(Dataset):
    """Per-sequence view of a complete feature cache (shards read lazily via ``safe_open``).

    ``ds[i]`` is ``{"input_ids": int64 [L], "loss_mask": uint8 [L], "hidden": bf16 [L,H]}``;
    only the requested rows of ``hidden`` are read. ``ds.lengths`` (int64 [S]) allows
    length-grouped sampling. Safe with DataLoader workers (handles are opened per process).
    """

    def __init__(self, cache: str | os.PathLike):
        from safetensors import safe_open

        self.root = Path(cache)
        self.manifest = read_manifest(self.root)
        if not self.manifest.get("complete"):
            raise FeatureCacheError(f"feature cache {self.root} is incomplete; rerun extraction")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise FeatureCacheError(f"feature cache {self.root} has format "
                                    f"{self.manifest.get('format_version')}, expected {FORMAT_VERSION}")
        self.files = [self.root / s["file"] for s in self.manifest["shards"]]
        offsets, starts, total = [], [], 0
        for path in self.files:
            try:
                with safe_open(str(path), "pt") as f:
                    offsets.append(f.get_tensor("seq_offsets").numpy())
            except Exception as exc:  # noqa: BLE001
                raise FeatureCacheError(f"unreadable feature shard {path}: {exc}") from None
            starts.append(total)
            total += len(offsets[-1]) - 1
        self._offsets, self._starts, self._len = offsets, starts, total
        self.lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self.hidden_size = int(self.manifest["target"]["hidden_size"])
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._len

    def _handle(self, shard: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # forked DataLoader worker: do not share handles
            self._handles, self._pid = {}, os.getpid()
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.files[shard]), "pt")
        return self._handles[shard]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._len <= index < self._len:
            raise IndexError(index)
        index %= self._len
        shard = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        a, b = (int(v) for v in self._offsets[shard][local: local + 2])
        f = self._handle(shard)
        return {
            "input_ids": f.get_slice("input_ids")[a:b].to(torch.int64),
            "loss_mask": f.get_slice("loss_mask")[a:b],
            "hidden": f.get_slice("hidden")[a:b],
        }


# --------------------------------------------------------------------------- target head


def load_target_head(
    model_dir: str | os.PathLike, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, float, torch.Tensor, torch.Tensor]:
    """The target's frozen output side for the trainer, read from its safetensors.

    Returns ``(final_norm_weight [H], rms_eps, lm_head_weight [V,H], embed_weight [V,H])``,
    cast to ``dtype`` if given. With tied embeddings (no ``lm_head.weight`` stored) the LM head
    is the embedding matrix (same tensor object).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FeatureCacheError(f"cannot read target config {config_path}: {exc}") from None
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        single = model_dir / "model.safetensors"
        if not single.is_file():
            raise FeatureCacheError(f"no model.safetensors(.index.json) in {model_dir}")
        with safe_open(str(single), "pt") as f:
            weight_map = {k: single.name for k in f.keys()}

    def get(name: str) -> torch.Tensor | None:
        if name not in weight_map:
            return None
        with safe_open(str(model_dir / weight_map[name]), "pt") as f:
            t = f.get_tensor(name)
        return t.to(dtype) if dtype is not None else t

    norm_w, embed = get("model.norm.weight"), get("model.embed_tokens.weight")
    if norm_w is None or embed is None:
        raise FeatureCacheError(f"{model_dir}: missing model.norm.weight or model.embed_tokens.weight")
    lm_head = get("lm_head.weight")
    if lm_head is None:
        if not config.get("tie_word_embeddings", True):
            raise FeatureCacheError(f"{model_dir}: no lm_head.weight and embeddings are not tied")
        lm_head = embed
    return norm_w, float(config.get("rms_norm_eps", 1e-6)), lm_head, embed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm in float32: [..., H] -> [..., H] float32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def shifted_postnorm_targets(x: torch.Tensor, lengths: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor:
    """h̄_{t+1} = RMSNorm(x_{t+1}) at position t: x [B,T,H] -> [B,T,H] float32, zero at each
    sequence's last position and on padding (matches ``input_ids_shifted``/``loss_mask``)."""
    target = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    target[:, :-1] = rms_norm(x[:, 1:], weight, eps)
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < (lengths[:, None] - 1)
    return target * valid[..., None]
