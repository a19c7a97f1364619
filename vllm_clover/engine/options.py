"""``CloverOptions``: Clover's options, typed, documented and validated once.

Where they come from and go:

* front end (``frontend.translate_engine_args``): :meth:`CloverOptions.from_spec` pops the
  Clover keys of the request's ``speculative_config`` and checks each against the checkpoint
  and the target, before any engine process is spawned (one :class:`CloverSpecError` line
  per problem). Derived fields (the resolved tree, the checkpoint's heads ...) are filled in
  there too.
* process boundary: the options travel as :meth:`CloverOptions.to_dict` in
  ``VllmConfig.additional_config["clover"]``. vLLM hashes a dict ``additional_config`` with
  ``json.dumps`` (``VllmConfig.compute_hash``) and pickles the ``VllmConfig`` into every
  worker, so the crossing form is plain JSON data; ``to_dict`` / ``from_dict`` round-trip it
  losslessly (tests/unit/engine/test_options.py).
* worker: :meth:`CloverOptions.from_vllm_config` gives the typed object back (proposer,
  vLLM-side model); readers use attributes.

:func:`options_markdown` renders the README's options table from the fields
(``python -m vllm_clover.engine.options`` prints it; a test keeps the README in step).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "clover:"
DYNAMIC = "dynamic"
# The tree chosen per step from measured costs and observed acceptance (engine/adaptive.py).
ADAPTIVE = "adaptive"
# Default tree_token_budget (verify tokens per step a tree may take, B * (N + 1)) by device.
# CPU: at batch 1 up to ~7 verify tokens cost what 3 cost (the step streams the weights), and
# from batch 4 even a chain of 2 runs below vanilla (docs/tree-verification.md): 8 keeps
# trees to batch 1 and gives larger batches short chains (batch 2: chain3, from batch 3:
# chain1). GPU: memory-bound up to about a hundred tokens per step; 96 is a starting point to
# tune per GPU and model.
TREE_TOKEN_BUDGET = {"cpu": 8, "gpu": 96}
# Clover options whose value is one of a fixed set (the first is the default).
CHOICES: dict[str, tuple[str, ...]] = {"draft_sampling": ("sample", "greedy"),
                                       "draft_dtype": ("auto", "float32", "bfloat16")}


class CloverSpecError(ValueError):
    """The Clover speculative-decoding request is malformed; one line saying why."""


def _on_cpu() -> bool:
    """Is this vLLM's CPU build?"""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def default_tree_token_budget() -> int:
    """``TREE_TOKEN_BUDGET`` for the platform vLLM runs on (CPU build or not)."""
    return TREE_TOKEN_BUDGET["cpu" if _on_cpu() else "gpu"]


def _option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
            shown: str = "", type_shown: str = "", derived: bool = False) -> Any:
    """A documented field. ``shown``: the default as the options table writes it (else the
    JSON of ``default``); ``type_shown``: the JSON type a user writes, where the field holds
    a resolved form; ``derived``: set by :meth:`CloverOptions.from_spec`, not by the user
    (left out of the table)."""
    meta = {"help": help, "shown": shown, "type": type_shown, "derived": derived}
    return field(default=default, default_factory=factory, metadata=meta)


# A static tree's top-k paths in BFS order (tree.StaticTree.paths), "dynamic", "adaptive", or None (chain).
TreePaths = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class CloverOptions:
    """Every Clover option of ``speculative_config`` (the keys next to ``method`` and
    ``model``), and what the front end derives from them for the worker."""

    draft_sampling: str = _option(
        "sample", '`"sample"`: for requests with temperature > 0, drafts are drawn from the heads\' '
        'temperature-scaled distributions and handed to vLLM\'s rejection sampler; `"greedy"`: always '
        "the heads' argmax. Both are lossless")
    draft_vocab_size: int = _option(
        0, "the heads score only the checkpoint's N most frequent response tokens "
        "(draft_vocab.json); the lever that makes drafting cheap (docs/design-proposer.md)",
        shown="`0` (full vocabulary)")
    draft_dtype: str = _option(
        "auto", "dtype of the drafter's matmuls on vLLM's CPU build; `\"auto\"` is bfloat16 for a float32 "
        "model on a CPU with native bfloat16 matmuls or the float32 linear kernel (bfloat16 weights), "
        "else the model's (docs/cpu-linear.md). On a GPU only `\"auto\"`")
    disable_by_batch_size: int | None = _option(
        None, "no drafts once this many requests run; becomes vLLM's dynamic speculative-decoding "
        "schedule (num_speculative_tokens_per_batch_size)", shown="unset (always draft)", type_shown="int")
    # Held resolved: a static tree's paths (a preset or "chain<K>" expanded), "dynamic",
    # "adaptive" or None.
    tree: str | TreePaths | None = _option(
        None, 'batched tree verification in one target pass: a preset (`"small_3"`, `"small_4"`, '
        '`"small_5"`, `"wide_9"`, `"small_10"`, `"mc_sim_7b_63"`), `"chain<K>"`, a list of top-k paths '
        'such as `[[0], [1], [0, 0]]`, `"dynamic"` (Clover-1\'s per-request tree), or `"adaptive"`: each '
        "step's tree, lookup tokens and rows per request, or no speculation, chosen from the costs measured "
        "at start-up and the acceptance observed (docs/adaptive.md; the `vllm-clover serve` default) "
        "(docs/tree-verification.md)", shown="unset (chain)", type_shown="str | list[list[int]]")
    adaptive_chain: bool = _option(
        False, "chain drafting whose length per step, from 0 (no drafts) up to `num_speculative_tokens`, is "
        'chosen like the `"adaptive"` tree\'s shape, from the costs measured at start-up and the acceptance '
        "observed; vLLM verifies each chain itself, so it runs where tree verification does not (CUDA graphs, "
        "any dtype); the GPU serve default (docs/adaptive.md). Not with `tree`")
    tree_token_budget: int = _option(
        help="verify tokens a step may spend on trees, B * (N + 1); trees shrink to chains as the "
        "batch grows", factory=default_tree_token_budget,
        shown=f"{TREE_TOKEN_BUDGET['cpu']} on CPU, {TREE_TOKEN_BUDGET['gpu']} on GPU")
    dynamic_tree_nodes: int = _option(25, 'node count of the `"dynamic"` tree (Clover-1\'s per-request tree)')
    adaptive_max_nodes: int = _option(
        16, 'heads\' nodes the `"adaptive"` tree may take per request (among the heads\' top-4/3/2 '
        "candidates per depth); its lookup tokens are at most `prompt_lookup_tokens`, and `tree_token_budget` "
        "does not apply to it")
    prompt_lookup_tokens: int = _option(
        0, "with a tree: up to this many tokens of vLLM's n-gram continuation of the request, "
        "grafted into the tree and verified in the same pass", shown="`0` (off)")
    prompt_lookup_min: int = _option(2, "smallest n-gram the prompt lookup matches")
    prompt_lookup_max: int = _option(4, "largest n-gram the prompt lookup matches")
    leaf_lookup_tokens: int = _option(
        0, "with a static tree and prompt lookup: up to this many retrieval tokens grafted under "
        "each leaf, looked up after the leaf's path", shown="`0` (off)")
    # Held as an absolute path ("" = off).
    datastore: str = _option(
        "", "with prompt lookup: an n-gram table (path relative to the heads directory) that drafts "
        "the lookup's tokens where the request repeats nothing; `\"datastore.npz\"` ships with the default "
        "heads, `vllm-clover build-datastore` makes one for any tokenizer (docs/datastore.md)", shown='`""` (off)')
    datastore_min_confidence: float = _option(
        0.2, "the datastore drafts token by token while the table's confidence in the next one is "
        "at least this (0..1)")
    # Derived by from_spec.
    checkpoint: str = _option("", "absolute path of the Clover checkpoint directory", derived=True)
    checkpoint_num_heads: int = _option(0, "heads of the checkpoint (one per tree depth)", derived=True)
    variant: str = _option("", "the checkpoint's Clover variant (config.json)", derived=True)
    tree_name: str = _option("", 'the tree\'s name ("custom" for a list of paths; "" without a tree)',
                             derived=True)
    tree_depth: int = _option(0, "the tree's depth (the checkpoint's heads for \"dynamic\")", derived=True)

    # ------------------------------------------------------------------ validation
    @classmethod
    def from_spec(cls, spec: dict[str, Any], target_hf_config: Any = None) -> CloverOptions:
        """Validate the Clover keys of a merged ``speculative_config`` dict and pop them (and
        ``model``, the checkpoint directory) from ``spec``; what is left is vLLM's. The
        checkpoint is validated against ``target_hf_config`` (the target's HF text config).

        Raises CloverSpecError / CloverCheckpointError, one line each."""
        from vllm_clover.model.checkpoint import validate_checkpoint

        path = checkpoint_path(spec.pop("model", None))
        values: dict[str, Any] = {"checkpoint": str(path)}
        for key in [k for k in spec if k in CHOICES]:
            values[key] = _choice(key, spec.pop(key))
        if values.get("draft_dtype", "auto") != "auto" and not _on_cpu():
            raise CloverSpecError(f"clover option draft_dtype={values['draft_dtype']!r} applies to vLLM's CPU "
                                  "build (oneDNN matmuls); on a GPU the drafter runs in the model's dtype: "
                                  "leave it out or use 'auto'")
        config = validate_checkpoint(path, target_hf_config)
        values.update(checkpoint_num_heads=config.num_heads, variant=config.variant)
        if "draft_vocab_size" in spec:
            values["draft_vocab_size"] = draft_vocab_size(spec.pop("draft_vocab_size"), path, config.vocab_size)
        disable_at = spec.pop("disable_by_batch_size", None)
        if disable_at is not None:
            values["disable_by_batch_size"] = positive_int(disable_at, "disable_by_batch_size")
        values.update(_tree_fields(tree_option(spec.pop("tree", None), config.num_heads), config.num_heads))
        values["adaptive_chain"] = adaptive_chain_option(spec.pop("adaptive_chain", False), values["tree"])
        values["tree_token_budget"] = positive_int(
            spec.pop("tree_token_budget", default_tree_token_budget()), "tree_token_budget")
        values["dynamic_tree_nodes"] = positive_int(
            spec.pop("dynamic_tree_nodes", cls.dynamic_tree_nodes), "dynamic_tree_nodes")
        values["adaptive_max_nodes"] = positive_int(
            spec.pop("adaptive_max_nodes", cls.adaptive_max_nodes), "adaptive_max_nodes")
        values.update(prompt_lookup_options(spec, values["tree"]))
        values["datastore"] = datastore_option(spec.pop("datastore", ""), path, config.vocab_size,
                                               values["prompt_lookup_tokens"])
        values["datastore_min_confidence"] = fraction(
            spec.pop("datastore_min_confidence", cls.datastore_min_confidence), "datastore_min_confidence")
        return cls(**values)

    # ------------------------------------------------------------------ the crossing form
    def to_dict(self) -> dict[str, Any]:
        """JSON data for ``additional_config["clover"]`` (tree paths as lists of lists)."""
        out = dataclasses.asdict(self)
        if isinstance(self.tree, tuple):
            out["tree"] = [list(p) for p in self.tree]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CloverOptions:
        """Inverse of :meth:`to_dict` (missing keys take their defaults)."""
        data = dict(data)
        if isinstance(data.get("tree"), (list, tuple)):
            data["tree"] = tuple(tuple(p) for p in data["tree"])
        return cls(**data)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> CloverOptions:
        """The options the front end stored in a VllmConfig (defaults if it stored none)."""
        stored = (getattr(vllm_config, "additional_config", None) or {}).get("clover") or {}
        return cls.from_dict(stored)

    # ------------------------------------------------------------------ readers
    @property
    def adaptive(self) -> bool:
        """Whether each step's drafts are chosen from measured costs (the adaptive tree or chain)."""
        return self.tree == ADAPTIVE or self.adaptive_chain

    def drafting_tree(self) -> Any:
        """The configured tree: a ``tree.StaticTree``, ``DYNAMIC``, ``ADAPTIVE``, or None (chain drafting)."""
        if self.tree is None:
            return None
        if self.tree in (DYNAMIC, ADAPTIVE):
            return self.tree
        from vllm_clover.drafting.tree import StaticTree

        return StaticTree(self.tree, self.tree_name or "custom")


# ============================================================================ field checks
def checkpoint_path(model: Any) -> Path:
    """``clover:<dir>`` or ``<dir>`` -> absolute directory path (not yet checked)."""
    if not isinstance(model, str) or not model.strip():
        raise CloverSpecError(
            "Clover speculative decoding needs a checkpoint directory: "
            "--speculative-model clover:<dir> or speculative_config={'method': 'clover', 'model': '<dir>'}")
    path = model[len(PREFIX):] if model.startswith(PREFIX) else model
    if not path.strip():
        raise CloverSpecError(
            f"{model!r} has no checkpoint directory; expected clover:<path-to-clover-checkpoint>")
    return Path(path).expanduser().resolve()


def _choice(key: str, value: Any) -> str:
    if value not in CHOICES[key]:
        raise CloverSpecError(f"clover option {key}={value!r} is invalid; expected one of {CHOICES[key]}")
    return value


def positive_int(value: Any, name: str) -> int:
    """A positive integer option (``tree_token_budget``: verify tokens per step a tree may
    take, B * (N + 1); ``dynamic_tree_nodes``: nodes per dynamic tree; ``disable_by_batch_size``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CloverSpecError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def adaptive_chain_option(value: Any, tree: Any) -> bool:
    """The ``adaptive_chain`` option; ``tree``: the tree field (it drafts chains, so no tree)."""
    if not isinstance(value, bool):
        raise CloverSpecError(f"adaptive_chain must be true or false, got {value!r}")
    if value and tree is not None:
        raise CloverSpecError("adaptive_chain drafts chains and cannot take a tree: leave out tree, or use "
                              "tree \"adaptive\" for trees chosen per step")
    return value


def fraction(value: Any, name: str) -> float:
    """A number in [0, 1] (ints allowed), else a one-line CloverSpecError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CloverSpecError(f"{name} must be a number between 0 and 1, got {value!r}")
    return float(value)


def tree_option(value: Any, num_heads: int) -> Any:
    """The ``tree`` option -> a ``tree.StaticTree``, or None for chain drafting.

    Accepted: None / "chain" (off), a preset name (``tree.PRESETS``), "chain<K>", a list of
    top-k paths (Medusa / EAGLE style, e.g. ``[[0], [1], [0, 0]]``), "dynamic" (returned
    as is: Clover-1's per-request tree, ``tree.build_dynamic_tree``) or "adaptive" (returned as
    is: chosen per step, engine/adaptive.py). A static tree's depth
    must not exceed the checkpoint's heads (head d drafts depth d+1)."""
    from vllm_clover.drafting.tree import PRESETS, StaticTree, get_tree

    if value is None or value == "chain":
        return None
    if value in (DYNAMIC, ADAPTIVE):
        return value
    try:
        if isinstance(value, str):
            tree = get_tree(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in value):
            tree = StaticTree([tuple(p) for p in value], name="custom")
        else:
            raise ValueError(f"expected a preset name, 'chain<K>' or a list of paths, got {value!r}")
    except (KeyError, ValueError, TypeError) as exc:
        raise CloverSpecError(f"clover option tree: {str(exc).strip(chr(39))} "
                              f"(presets: {sorted(PRESETS)}, 'chain<K>', 'dynamic', 'adaptive', or a list of "
                              "top-k paths)") from None
    if tree.max_depth > num_heads:
        raise CloverSpecError(f"clover option tree {tree.name!r} is {tree.max_depth} deep but the "
                              f"checkpoint has {num_heads} heads (one per depth)")
    return tree


def _tree_fields(tree: Any, num_heads: int) -> dict[str, Any]:
    """The tree fields of :class:`CloverOptions` for a :func:`tree_option` result."""
    if tree is None:
        return {"tree": None}
    if tree in (DYNAMIC, ADAPTIVE):
        return {"tree": tree, "tree_name": tree, "tree_depth": num_heads}
    return {"tree": tree.paths, "tree_name": tree.name, "tree_depth": tree.max_depth}


def prompt_lookup_options(spec: dict[str, Any], tree: Any) -> dict[str, int]:
    """Pop and check ``prompt_lookup_tokens`` / ``_min`` / ``_max`` and ``leaf_lookup_tokens``
    from ``spec``; ``tree``: the tree field (None: chain drafting).

    Lookup candidates are grafted into the tree (drafting/lookup.py), so they need tree
    verification: without a tree the option is an error naming the fix."""
    defaults = CloverOptions
    tokens = spec.pop("prompt_lookup_tokens", defaults.prompt_lookup_tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise CloverSpecError(f"prompt_lookup_tokens must be an integer >= 0, got {tokens!r}")
    out = {"prompt_lookup_tokens": tokens}
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        out[key] = positive_int(spec.pop(key, getattr(defaults, key)), key)
    if out["prompt_lookup_min"] > out["prompt_lookup_max"]:
        raise CloverSpecError(f"prompt_lookup_min ({out['prompt_lookup_min']}) is larger than "
                              f"prompt_lookup_max ({out['prompt_lookup_max']})")
    if out["prompt_lookup_tokens"] and tree is None:
        raise CloverSpecError("prompt_lookup_tokens grafts lookup candidates into a token tree and needs "
                              "the tree option (e.g. \"tree\": \"small_4\", or \"chain2\" for Clover's chain)")
    leaf = spec.pop("leaf_lookup_tokens", defaults.leaf_lookup_tokens)
    if isinstance(leaf, bool) or not isinstance(leaf, int) or leaf < 0:
        raise CloverSpecError(f"leaf_lookup_tokens must be an integer >= 0, got {leaf!r}")
    if leaf and not out["prompt_lookup_tokens"]:
        raise CloverSpecError("leaf_lookup_tokens extends the prompt lookup under the tree's leaves: "
                              "set prompt_lookup_tokens too (e.g. 16)")
    if leaf and tree in (DYNAMIC, ADAPTIVE):
        raise CloverSpecError("leaf_lookup_tokens needs a static tree (a preset or a list of paths), "
                              f"not {tree!r}")
    out["leaf_lookup_tokens"] = leaf
    return out


def datastore_option(value: Any, checkpoint: Path, vocab_size: int, lookup_tokens: int) -> str:
    """The ``datastore`` option -> the absolute path of a readable datastore for this
    vocabulary, or "" (off). A relative path is taken inside the checkpoint directory. Its
    chain fills the prompt lookup's slots, so it needs ``prompt_lookup_tokens``."""
    from vllm_clover.drafting.datastore import DatastoreError, load_datastore

    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise CloverSpecError(f"datastore must be a path to a datastore .npz, got {value!r}")
    if not lookup_tokens:
        raise CloverSpecError("datastore drafts fill the prompt-lookup slots of the tree: set "
                              "prompt_lookup_tokens too (e.g. 5)")
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else checkpoint / path).resolve()
    try:
        load_datastore(path, vocab_size)
    except DatastoreError as exc:
        raise CloverSpecError(f"clover option datastore: {exc}") from None
    return str(path)


def draft_vocab_size(value: Any, path: Path, vocab_size: int) -> int:
    """Validate the ``draft_vocab_size`` option (0 = full vocabulary) against the checkpoint's
    draft_vocab.json (vllm_clover/model/draft_vocab.py); one-line CloverSpecError otherwise."""
    from vllm_clover.model.draft_vocab import DraftVocabError, load_draft_vocab

    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CloverSpecError(f"draft_vocab_size must be an integer >= 0 (0 = full vocabulary), got {value!r}")
    if value >= vocab_size:
        return 0
    if value:
        try:
            load_draft_vocab(path, value, vocab_size)
        except DraftVocabError as exc:
            raise CloverSpecError(str(exc)) from None
    return value


# ============================================================================ options table
def user_fields() -> list[dataclasses.Field]:
    """The fields a user sets, in table order."""
    return [f for f in dataclasses.fields(CloverOptions) if not f.metadata["derived"]]


def options_markdown() -> str:
    """The README's options table: one row per user-set field (name, JSON type, default,
    help), docs/ paths as links."""
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for f in user_fields():
        kind = f.metadata["type"] or " | ".join(map(json.dumps, CHOICES.get(f.name, ()))) or str(f.type)
        default = f.metadata["shown"] or f"`{json.dumps(f.default)}`"
        help_text = re.sub(r"(?<![\w/\[])(docs/[\w./-]+\.md)", r"[\1](\1)", f.metadata["help"])
        cells = [f"`{f.name}`", f"`{kind}`", default, help_text]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_markdown(), end="")
