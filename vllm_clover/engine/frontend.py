"""Front end: how users ask for Clover, and its translation into a method vLLM knows.

Accepted spellings (all end up in ``EngineArgs.create_speculative_config``)::

    vllm serve M --speculative-model clover:<dir> [--num-speculative-tokens K]
    vllm serve M --speculative-config '{"method": "clover", "model": "<dir>", "num_speculative_tokens": K}'
    vllm serve M --speculative-config '{"model": "clover:<dir>", ...}'
    LLM(M, speculative_config={"method": "clover", "model": "<dir>", ...})

vLLM's ``method`` is a closed pydantic Literal and is dispatched on in many places, so
"clover" never reaches vLLM: the hook rewrites the request to ``method="medusa"`` with the
Clover directory (whose config.json names our registered architecture), moves Clover-only
options into ``additional_config["clover"]`` (``SpeculativeConfig`` forbids extra keys),
and validates the checkpoint against the target *here*, in the front-end process, before
any engine process is spawned: a bad path or checkpoint is one readable line, not a
worker traceback. K defaults to the checkpoint's number of heads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_clover.model.config import ARCHITECTURE

PREFIX = "clover:"
METHOD = "clover"
# Clover-only options of --speculative-config / speculative_config (values: allowed set).
# draft_sampling: "sample" draws drafts of temperature>0 requests from the heads'
# temperature-scaled distributions and hands those to vLLM's rejection sampler;
# "greedy" always drafts the heads' argmax (one-hot drafts). Both are lossless.
# draft_vocab_size (int, 0 = full vocabulary): the heads score only the checkpoint's N most
# frequent response tokens (vllm_clover/model/draft_vocab.py); validated by draft_vocab_size().
# disable_by_batch_size (int): no drafts once this many requests run (batch_size_schedule()).
# tree ("chain" = off, a preset name, "chain<K>", a list of top-k paths, or "dynamic"),
# tree_token_budget (int; default by device, TREE_TOKEN_BUDGET) and dynamic_tree_nodes (int):
# batched tree verification (tree_option(), tree_verify.py).
# prompt_lookup_tokens (int, 0 = off), prompt_lookup_min / prompt_lookup_max (n-gram sizes):
# up to that many tokens of vLLM's ngram continuation grafted into every tree (lookup.py).
# leaf_lookup_tokens (int, 0 = off; static trees, with prompt_lookup_tokens): up to that many
# retrieval tokens grafted under each leaf of the heads' tree, looked up after the leaf's path
# (lookup.graft_retrieval).
# datastore (path, "" = off; relative to the checkpoint directory): where the prompt lookup
# finds nothing, an n-gram datastore's chain fills those slots (datastore.py), token by token
# while the table's confidence in the next one is at least datastore_min_confidence (0..1).
# draft_dtype: dtype of the drafter's matmuls on vLLM's CPU build ("auto": bfloat16 for a
# float32 model on a CPU with native bfloat16 matmuls, else the model's; cpu_linear.py).
OPTIONS: dict[str, tuple[str, ...]] = {"draft_sampling": ("sample", "greedy"),
                                       "draft_dtype": ("auto", "float32", "bfloat16")}
# (tree_token_budget has no entry: its default depends on the device, default_tree_token_budget().)
DEFAULT_OPTIONS: dict[str, Any] = {"draft_sampling": "sample", "draft_dtype": "auto", "draft_vocab_size": 0, "tree": None,
                                   "dynamic_tree_nodes": 25, "prompt_lookup_tokens": 0,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4, "leaf_lookup_tokens": 0, "datastore": "",
                                   "datastore_min_confidence": 0.2}
# Default tree_token_budget (verify tokens per step a tree may take, B * (N + 1)) by device.
# CPU (default model, 2 cores): at batch 1 up to ~7 verify tokens cost what 3 cost (the
# step streams the weights), ~11 cost 10+ ms more, and from batch 4 chain K=2 already runs
# below vanilla; small_4 and dynamic <= 6 nodes paid at batch 1 (docs/tree-verification.md).
# 8 keeps trees to batch 1 and makes larger batches draft short chains (batch 2: chain3,
# from batch 3: chain1). GPU: memory-bound up to about a hundred tokens per step; 96 is a
# starting point to tune per GPU and model.
TREE_TOKEN_BUDGET = {"cpu": 8, "gpu": 96}
DYNAMIC = "dynamic"


class CloverSpecError(ValueError):
    """The Clover speculative-decoding request is malformed; one line saying why."""


# ============================================================================ CLI flags
def speculative_model_arg(value: str) -> str:
    """argparse ``type`` of ``--speculative-model``: refuse ``clover:`` without a path, or
    naming a directory that is not a readable Clover checkpoint (config.json and the
    safetensors header; checks against the target come later). argparse prints such an
    error as one ``vllm serve: error: argument --speculative-model: ...`` line, exit 2,
    before any model is loaded."""
    if not value.startswith(PREFIX):
        return value
    if not value[len(PREFIX):].strip():
        raise argparse.ArgumentTypeError(
            f"{value!r} has no checkpoint directory; expected clover:<path-to-clover-checkpoint>")
    from vllm_clover.model.checkpoint import CloverCheckpointError, validate_checkpoint

    try:
        validate_checkpoint(checkpoint_path(value))
    except CloverCheckpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_clover_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--speculative-model`` / ``--num-speculative-tokens`` to an EngineArgs parser.

    They reuse vLLM's own dests (``spec_model`` / ``spec_tokens``), so
    ``EngineArgs.from_cli_args`` carries them through without a new dataclass field.
    """
    try:
        parser.add_argument(
            "--speculative-model", dest="spec_model", type=speculative_model_arg, default=None,
            help="Draft model; 'clover:<dir>' selects Clover speculative decoding "
                 "(vllm-clover). Same as --spec-model otherwise.")
        parser.add_argument(
            "--num-speculative-tokens", dest="spec_tokens", type=int, default=None,
            help="Draft tokens per step (vllm-clover; same as --spec-tokens). "
                 "Clover default: the checkpoint's number of heads.")
    except argparse.ArgumentError:
        pass  # this parser already has them (add_cli_args called twice on one parser)


# ============================================================================ translation
def is_clover_ref(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def wants_clover(args: Any) -> bool:
    """Does this EngineArgs ask for Clover through any of the accepted spellings?"""
    spec = args.speculative_config if isinstance(args.speculative_config, dict) else {}
    return (spec.get("method") == METHOD or is_clover_ref(spec.get("model"))
            or is_clover_ref(args.spec_model) or args.spec_method == METHOD)


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


def translate_engine_args(args: Any, target_model_config: Any) -> None:
    """Rewrite a Clover request on ``args`` (EngineArgs) in place into vLLM's medusa form.

    Raises CloverSpecError / CloverCheckpointError (both ValueError, one line each).
    """
    from vllm_clover.model.checkpoint import validate_checkpoint

    spec = _merged_spec_dict(args)
    method = spec.pop("method", METHOD)
    if method != METHOD:
        raise CloverSpecError(f"method {method!r} cannot be combined with a clover: model; "
                              f"use method 'clover' or leave it out")
    path = checkpoint_path(spec.pop("model", None))
    options = dict(DEFAULT_OPTIONS)
    for key in [k for k in spec if k in OPTIONS]:
        value = spec.pop(key)
        if value not in OPTIONS[key]:
            raise CloverSpecError(f"clover option {key}={value!r} is invalid; expected one of {OPTIONS[key]}")
        options[key] = value
    if options["draft_dtype"] != "auto" and not _on_cpu():
        raise CloverSpecError(f"clover option draft_dtype={options['draft_dtype']!r} applies to vLLM's CPU "
                              "build (oneDNN matmuls); on a GPU the drafter runs in the model's dtype: "
                              "leave it out or use 'auto'")
    config = validate_checkpoint(path, target_model_config.hf_text_config)
    if "draft_vocab_size" in spec:
        options["draft_vocab_size"] = draft_vocab_size(spec.pop("draft_vocab_size"), path, config.vocab_size)
    disable_at = spec.pop("disable_by_batch_size", None)
    k = spec.pop("num_speculative_tokens", None)
    tree = tree_option(spec.pop("tree", None), config.num_heads)
    options["tree_token_budget"] = positive_int(
        spec.pop("tree_token_budget", default_tree_token_budget()), "tree_token_budget")
    nodes = positive_int(spec.pop("dynamic_tree_nodes", DEFAULT_OPTIONS["dynamic_tree_nodes"]), "dynamic_tree_nodes")
    lookup = prompt_lookup_options(spec, tree)
    options.update(lookup)
    options["datastore"] = datastore_option(spec.pop("datastore", ""), path, config.vocab_size,
                                            lookup["prompt_lookup_tokens"])
    options["datastore_min_confidence"] = fraction(
        spec.pop("datastore_min_confidence", DEFAULT_OPTIONS["datastore_min_confidence"]), "datastore_min_confidence")
    # grafted nodes on top of the tree's own
    extra = lookup["prompt_lookup_tokens"] + lookup["leaf_lookup_tokens"] * (
        0 if tree is None or tree == DYNAMIC else tree.retrieve_paths.shape[0])
    plus = (" + prompt_lookup_tokens" if lookup["prompt_lookup_tokens"] else "") + (
        " + leaf_lookup_tokens x leaves" if lookup["leaf_lookup_tokens"] else "")
    if tree == DYNAMIC:
        # Clover-1's dynamic tree: up to `nodes` nodes per request, one head per depth.
        if k is not None and k != nodes + extra:
            raise CloverSpecError(f"with tree 'dynamic', num_speculative_tokens is dynamic_tree_nodes"
                                  f"{plus} ({nodes + extra}); leave it out (got {k!r})")
        k = nodes + extra
        options.update(tree=DYNAMIC, tree_name=DYNAMIC, tree_depth=config.num_heads, dynamic_tree_nodes=nodes)
    elif tree is not None:
        # vLLM sizes its draft buffers, KV slots and metrics by num_speculative_tokens: with a
        # tree that is the node count N (drafts are the BFS-ordered nodes), not the head count.
        if k is not None and k != tree.num_nodes + extra:
            raise CloverSpecError(
                f"with tree {tree.name!r}, num_speculative_tokens is its node count{plus} "
                f"({tree.num_nodes + extra}); leave it out (got {k!r})")
        k = tree.num_nodes + extra
        options.update(tree=[list(p) for p in tree.paths], tree_name=tree.name, tree_depth=tree.max_depth)
    if tree is not None:
        warn_tree_over_budget(tree, nodes, options["tree_token_budget"], extra)
    if k is None:
        k = config.num_heads
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise CloverSpecError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    if tree is None and k > config.num_heads:
        raise CloverSpecError(
            f"num_speculative_tokens={k} is larger than the {config.num_heads} heads of "
            f"Clover checkpoint {path}; use at most {config.num_heads}")
    if disable_at is not None:
        if "num_speculative_tokens_per_batch_size" in spec:
            raise CloverSpecError("disable_by_batch_size and num_speculative_tokens_per_batch_size "
                                  "are mutually exclusive")
        spec["num_speculative_tokens_per_batch_size"] = batch_size_schedule(disable_at, k)
    args.speculative_config = {"method": "medusa", "model": str(path), "num_speculative_tokens": k, **spec}
    args.additional_config = {
        **(args.additional_config or {}),
        "clover": {**options, "checkpoint": str(path), "checkpoint_num_heads": config.num_heads,
                   "variant": config.variant},
    }


def batch_size_schedule(disable_at: Any, k: int) -> list[list[int]]:
    """vLLM's dynamic speculative-decoding schedule (``num_speculative_tokens_per_batch_size``,
    inclusive batch-size ranges -> K) for Clover's ``disable_by_batch_size`` option: K drafts
    below ``disable_at`` running requests, none from there on (the tail is carried forward).

    Why: verification multiplies the target's work by K+1 tokens per request; once the batch
    makes the target compute-bound (CPU: a handful of requests) drafting only costs.
    """
    if isinstance(disable_at, bool) or not isinstance(disable_at, int) or disable_at < 1:
        raise CloverSpecError(f"disable_by_batch_size must be an integer >= 1, got {disable_at!r}")
    if disable_at == 1:
        return [[1, 1, 0]]
    return [[1, disable_at - 1, k], [disable_at, disable_at, 0]]


def tree_option(value: Any, num_heads: int) -> Any:
    """The ``tree`` option -> a ``tree.StaticTree``, or None for chain drafting.

    Accepted: None / "chain" (off), a preset name (``tree.PRESETS``), "chain<K>", a list of
    top-k paths (Medusa / EAGLE style, e.g. ``[[0], [1], [0, 0]]``), or "dynamic" (returned
    as is: Clover-1's per-request tree, ``tree.build_dynamic_tree``). A static tree's depth
    must not exceed the checkpoint's heads (head d drafts depth d+1)."""
    from vllm_clover.drafting.tree import PRESETS, StaticTree, get_tree

    if value is None or value == "chain":
        return None
    if value == DYNAMIC:
        return DYNAMIC
    try:
        if isinstance(value, str):
            tree = get_tree(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in value):
            tree = StaticTree([tuple(p) for p in value], name="custom")
        else:
            raise ValueError(f"expected a preset name, 'chain<K>' or a list of paths, got {value!r}")
    except (KeyError, ValueError, TypeError) as exc:
        raise CloverSpecError(f"clover option tree: {str(exc).strip(chr(39))} "
                              f"(presets: {sorted(PRESETS)}, 'chain<K>', 'dynamic', or a list of top-k paths)") from None
    if tree.max_depth > num_heads:
        raise CloverSpecError(f"clover option tree {tree.name!r} is {tree.max_depth} deep but the "
                              f"checkpoint has {num_heads} heads (one per depth)")
    return tree


def prompt_lookup_options(spec: dict[str, Any], tree: Any) -> dict[str, int]:
    """Pop and check ``prompt_lookup_tokens`` / ``_min`` / ``_max`` and ``leaf_lookup_tokens``
    from ``spec``.

    Lookup candidates are grafted into the tree (lookup.py), so they need tree
    verification: without a tree the option is an error naming the fix."""
    tokens = spec.pop("prompt_lookup_tokens", DEFAULT_OPTIONS["prompt_lookup_tokens"])
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise CloverSpecError(f"prompt_lookup_tokens must be an integer >= 0, got {tokens!r}")
    out = {"prompt_lookup_tokens": tokens}
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        out[key] = positive_int(spec.pop(key, DEFAULT_OPTIONS[key]), key)
    if out["prompt_lookup_min"] > out["prompt_lookup_max"]:
        raise CloverSpecError(f"prompt_lookup_min ({out['prompt_lookup_min']}) is larger than "
                              f"prompt_lookup_max ({out['prompt_lookup_max']})")
    if out["prompt_lookup_tokens"] and tree is None:
        raise CloverSpecError("prompt_lookup_tokens grafts lookup candidates into a token tree and needs "
                              "the tree option (e.g. \"tree\": \"small_4\", or \"chain2\" for Clover's chain)")
    leaf = spec.pop("leaf_lookup_tokens", DEFAULT_OPTIONS["leaf_lookup_tokens"])
    if isinstance(leaf, bool) or not isinstance(leaf, int) or leaf < 0:
        raise CloverSpecError(f"leaf_lookup_tokens must be an integer >= 0, got {leaf!r}")
    if leaf and not out["prompt_lookup_tokens"]:
        raise CloverSpecError("leaf_lookup_tokens extends the prompt lookup under the tree's leaves: "
                              "set prompt_lookup_tokens too (e.g. 16)")
    if leaf and tree == DYNAMIC:
        raise CloverSpecError("leaf_lookup_tokens needs a static tree (a preset or a list of paths), "
                              "not 'dynamic'")
    out["leaf_lookup_tokens"] = leaf
    return out


def fraction(value: Any, name: str) -> float:
    """A number in [0, 1] (ints allowed), else a one-line CloverSpecError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise CloverSpecError(f"{name} must be a number between 0 and 1, got {value!r}")
    return float(value)


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


def warn_tree_over_budget(tree: Any, dynamic_nodes: int, budget: int, lookup_tokens: int = 0) -> None:
    """Say at start-up when even a batch of one cannot draft the configured tree: the tree
    would silently become a chain (static) or be capped (dynamic) at every step."""
    from vllm.logger import init_logger

    own = dynamic_nodes if tree == DYNAMIC else tree.num_nodes
    n = own + lookup_tokens
    if n + 1 <= budget:
        return
    name = DYNAMIC if tree == DYNAMIC else repr(tree.name)
    if own + 1 <= budget:  # the tree fits; the lookup tokens fill what is left
        effect = f"prompt lookup adds at most {budget - 1 - own} of its {lookup_tokens} tokens"
    elif tree == DYNAMIC:
        effect = f"dynamic trees get at most {budget - 1} nodes"
    else:
        effect = f"every step drafts a chain of {max(1, min(tree.max_depth, budget - 1))} instead"
    init_logger(__name__).warning(
        "vllm-clover: tree %s needs %d verify tokens per request but tree_token_budget is %d "
        "(default on this device: %s); %s. Raise tree_token_budget to use the whole tree.",
        name, n + 1, budget, TREE_TOKEN_BUDGET, effect)


def _on_cpu() -> bool:
    """Is this vLLM's CPU build?"""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def default_tree_token_budget() -> int:
    """``TREE_TOKEN_BUDGET`` for the platform vLLM runs on (CPU build or not)."""
    return TREE_TOKEN_BUDGET["cpu" if _on_cpu() else "gpu"]


def positive_int(value: Any, name: str) -> int:
    """A positive integer option (``tree_token_budget``: verify tokens per step a tree may
    take, B * (N + 1); ``dynamic_tree_nodes``: nodes per dynamic tree)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CloverSpecError(f"{name} must be an integer >= 1, got {value!r}")
    return value


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


def _merged_spec_dict(args: Any) -> dict[str, Any]:
    """--speculative-config plus the --spec-*/--speculative-model flags, as vLLM merges them."""
    raw = args.speculative_config
    if raw is not None and not isinstance(raw, dict):
        raise CloverSpecError(f"speculative_config must be a JSON object / dict, got {type(raw).__name__}")
    spec = {k.replace("-", "_"): v for k, v in (raw or {}).items()}
    for flag, key, value in (
        ("--spec-method", "method", args.spec_method),
        ("--speculative-model/--spec-model", "model", args.spec_model),
        ("--num-speculative-tokens/--spec-tokens", "num_speculative_tokens", args.spec_tokens),
    ):
        if value is None:
            continue
        if key in spec:
            raise CloverSpecError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    # Consumed here; vLLM's own merge must not see them again.
    args.spec_method = args.spec_model = args.spec_tokens = None
    return spec


# ============================================================================ worker side
def is_clover_vllm_config(vllm_config: Any) -> bool:
    """True when a (translated) VllmConfig runs a Clover drafter through the medusa slot."""
    return is_clover_spec_config(getattr(vllm_config, "speculative_config", None))


def clover_options(vllm_config: Any) -> dict[str, Any]:
    """Clover-only options stashed by the front end (defaults if absent)."""
    extra = (getattr(vllm_config, "additional_config", None) or {}).get("clover") or {}
    return {**DEFAULT_OPTIONS, "tree_token_budget": default_tree_token_budget(), **extra}


# ============================================================================ hooks
# What the front-end patches install (vllm_clover/patches/frontend.py): each ``wrap_*`` takes
# vLLM's original and returns the function that replaces it.
def wrap_add_cli_args(orig: Any) -> Any:
    """``EngineArgs.add_cli_args`` (a staticmethod) that also adds our two flags."""

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = orig(parser, *args, **kwargs)
        add_clover_cli_args(parser)
        return parser

    return add_cli_args


def wrap_create_speculative_config(orig: Any) -> Any:
    """``EngineArgs.create_speculative_config`` that translates Clover before vLLM sees it."""

    def create_speculative_config(self: Any, target_model_config: Any, target_parallel_config: Any) -> Any:
        if wants_clover(self):
            translate_engine_args(self, target_model_config)
        return orig(self, target_model_config, target_parallel_config)

    return create_speculative_config


def wrap_use_eagle_block_drop(orig: Any) -> Any:
    """``SpeculativeConfig.use_eagle_block_drop`` that is True for Clover too (unless the
    user set ``disable_eagle_block_drop``), as for EAGLE.

    Why: the trunk KV at position p depends on the token at p+1 (the EAGLE shift), which
    is not part of the hash of p's KV block. On a prefix-cache hit that ends at a block
    boundary, the last cached position's trunk KV was written with the *first* request's
    next token. vLLM's "EAGLE block drop" (scheduler.py:315-333, kv_cache_coordinator.py)
    drops the last matched block so it is recomputed with the new request's tokens; only
    acceptance is at stake (never outputs), and the price is one block of prefill per hit.
    """

    def use_eagle_block_drop(self: Any) -> bool:
        if orig(self):
            return True
        return is_clover_spec_config(self) and not self.disable_eagle_block_drop

    return use_eagle_block_drop


def is_clover_spec_config(spec: Any) -> bool:
    """A (translated) SpeculativeConfig running a Clover checkpoint in the medusa slot."""
    if spec is None or spec.method != "medusa" or spec.draft_model_config is None:
        return False
    return ARCHITECTURE in (getattr(spec.draft_model_config.hf_config, "architectures", None) or [])


def clover_config_errors() -> tuple[type[Exception], ...]:
    """The plugin's own configuration errors: each message is one complete line."""
    from vllm_clover.model.checkpoint import CloverCheckpointError

    return (CloverSpecError, CloverCheckpointError)


def wrap_serve_cmd(orig: Any) -> Any:
    """``vllm serve``'s command (``ServeSubcommand.cmd``, a staticmethod) that ends the CLI
    on a Clover configuration error (bad checkpoint, K > heads, target mismatch, any
    spelling, including ``--speculative-config`` JSON) with one ``vllm serve: error: ...``
    line on stderr and exit status 2, as argparse does, instead of a traceback.

    Only the CLI is affected: ``LLM(...)`` / ``AsyncLLM`` users still get the exception.
    """

    def cmd(args: Any) -> None:
        try:
            return orig(args)
        except clover_config_errors() as exc:
            print(f"vllm serve: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return cmd
