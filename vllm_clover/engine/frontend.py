"""Front end: how users ask for Clover, and its translation into a method vLLM knows.

Accepted spellings (all end up in ``EngineArgs.create_speculative_config``)::

    vllm serve M --speculative-model clover:<dir> [--num-speculative-tokens K]
    vllm serve M --speculative-config '{"method": "clover", "model": "<dir>", "num_speculative_tokens": K}'
    vllm serve M --speculative-config '{"model": "clover:<dir>", ...}'
    LLM(M, speculative_config={"method": "clover", "model": "<dir>", ...})

vLLM's ``method`` is a closed pydantic Literal and is dispatched on in many places, so
"clover" never reaches vLLM: the hook rewrites the request to ``method="medusa"`` with the
Clover directory (whose config.json names our registered architecture), moves Clover-only
options into ``additional_config["clover"]`` (``SpeculativeConfig`` forbids extra keys; the
options are ``vllm_clover.engine.options.CloverOptions``), and validates the checkpoint
against the target *here*, in the front-end process, before any engine process is spawned:
a bad path or checkpoint is one readable line, not a worker traceback. K defaults to the
checkpoint's number of heads.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_clover.engine.options import (ADAPTIVE, DYNAMIC, PREFIX, TREE_TOKEN_BUDGET, CloverOptions,
                                        CloverSpecError, checkpoint_path)
from vllm_clover.model.config import ARCHITECTURE

METHOD = "clover"


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


def translate_engine_args(args: Any, target_model_config: Any) -> None:
    """Rewrite a Clover request on ``args`` (EngineArgs) in place into vLLM's medusa form.

    Raises CloverSpecError / CloverCheckpointError (both ValueError, one line each).
    """
    spec = clover_spec(args)
    options = CloverOptions.from_spec(spec, target_model_config.hf_text_config)
    refuse_unsupported(args, options, target_model_config.dtype)
    select_tree_backend(args, options)
    k = speculative_tokens(options, spec.pop("num_speculative_tokens", None))
    rewrite_args(args, spec, options, k)


def select_tree_backend(args: Any, options: CloverOptions, on_cpu: bool | None = None) -> None:
    """With a tree on a GPU and no attention backend chosen, choose the plugin's tree backend
    (``CUSTOM``: FlashAttention's, with the step's tree metadata in its attention metadata;
    vllm_clover/engine/attention_backend.py). FLASH_ATTN chosen explicitly also verifies trees
    (the tree-rows hook reads the same metadata from the engine's context)."""
    if options.tree is None:
        return
    if on_cpu is None:
        from vllm_clover.engine.options import _on_cpu

        on_cpu = _on_cpu()
    attention_config = getattr(args, "attention_config", None)
    if on_cpu or args.attention_backend is not None or getattr(attention_config, "backend", None) is not None:
        return
    args.attention_backend = "CUSTOM"


# ============================================================================ refusals
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# KV-cache dtypes tree verification reads and compacts as plain tensors: unquantised ones.
TREE_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# Attention backends (AttentionBackendEnum names) whose layers run the tree rows on GPU:
# FlashAttention (the tree-rows hook) and the plugin's tree backend registered as CUSTOM
# (vllm_clover/engine/attention_backend.py), which is FlashAttention's with tree metadata.
TREE_GPU_BACKENDS = ("FLASH_ATTN", "CUSTOM")


def refuse_unsupported(args: Any, options: CloverOptions, model_dtype: Any, on_cpu: bool | None = None) -> None:
    """Refuse, before any engine process starts, the settings Clover cannot run right, each
    with one :class:`CloverSpecError` line naming the setting and the way out.

    ``args``: the EngineArgs; ``model_dtype``: the target's resolved torch dtype;
    ``on_cpu``: vLLM's CPU build (default: the platform vLLM runs on)."""
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        # The plugin's runner patches wrap the V1 GPUModelRunner; vLLM picks the V1 runner for
        # the medusa slot on its own (VllmConfig.use_v2_model_runner, checked by the patch
        # catalogue) unless this variable forces V2.
        raise CloverSpecError(f"{V2_RUNNER_ENV}=1 selects vLLM's V2 model runner, which Clover does not "
                              f"support (it runs in the V1 runner's medusa slot); unset {V2_RUNNER_ENV} "
                              "or set it to 0")
    # Tensor parallelism runs (vocab_parallel.py). With pipeline stages the drafter would need the
    # last stage's hidden states on the first stage's ranks, which vLLM 0.32's medusa slot does
    # not pass; refused here, before the target loads.
    pp = getattr(args, "pipeline_parallel_size", 1)
    if pp and pp > 1:
        raise CloverSpecError(f"pipeline_parallel_size={pp}: Clover runs with tensor parallelism "
                              "(--tensor-parallel-size) but not with pipeline stages; leave "
                              "pipeline_parallel_size at 1 or serve without Clover")
    if options.tree is None:
        return
    cache_dtype = str(getattr(args, "kv_cache_dtype", "auto") or "auto")
    if cache_dtype not in TREE_KV_CACHE_DTYPES:
        raise CloverSpecError(f"kv_cache_dtype={cache_dtype!r} with the tree option: tree verification "
                              f"reads and moves unquantised KV only ({', '.join(TREE_KV_CACHE_DTYPES)}); "
                              "use kv_cache_dtype 'auto' or chain drafting (leave out the tree option)")
    if on_cpu is None:
        from vllm_clover.engine.options import _on_cpu

        on_cpu = _on_cpu()
    if on_cpu:
        return  # CPU_ATTN is the only CPU backend; its KV layout is checked at start-up
    attention_config = getattr(args, "attention_config", None)
    backend = getattr(args, "attention_backend", None) or getattr(attention_config, "backend", None)
    name = str(getattr(backend, "name", backend)).upper() if backend is not None else None
    if name is not None and name not in TREE_GPU_BACKENDS:
        raise CloverSpecError(f"attention backend {name} with the tree option: tree verification on GPU "
                              f"runs in {' or '.join(TREE_GPU_BACKENDS)}; leave --attention-backend unset "
                              "or use chain drafting (leave out the tree option)")
    import torch

    if model_dtype == torch.float32:
        raise CloverSpecError("dtype float32 with the tree option on GPU: tree verification runs in "
                              "FlashAttention, which has no float32 kernels (vLLM would pick TRITON_ATTN); "
                              "use --dtype bfloat16 or float16, or chain drafting (leave out the tree option)")


def clover_spec(args: Any) -> dict[str, Any]:
    """Phase 1, the spelling: one speculative_config dict from the JSON and the flags,
    ``method`` checked and removed."""
    spec = _merged_spec_dict(args)
    method = spec.pop("method", METHOD)
    if method != METHOD:
        raise CloverSpecError(f"method {method!r} cannot be combined with a clover: model; "
                              f"use method 'clover' or leave it out")
    return spec


def speculative_tokens(options: CloverOptions, k: Any) -> int:
    """Phase 3, sizing: vLLM's ``num_speculative_tokens`` for these options (``k``: the
    user's, or None). vLLM sizes its draft buffers, KV slots and metrics by it: with a tree
    that is the node count N (drafts are the BFS-ordered nodes) plus the grafted lookup
    nodes, not the head count; without one at most the checkpoint's heads."""
    heads = options.checkpoint_num_heads
    tree = options.drafting_tree()
    # grafted nodes on top of the tree's own
    extra = options.prompt_lookup_tokens + options.leaf_lookup_tokens * (
        0 if tree is None or tree in (DYNAMIC, ADAPTIVE) else tree.retrieve_paths.shape[0])
    plus = (" + prompt_lookup_tokens" if options.prompt_lookup_tokens else "") + (
        " + leaf_lookup_tokens x leaves" if options.leaf_lookup_tokens else "")
    if tree in (DYNAMIC, ADAPTIVE):
        # Clover-1's dynamic tree: up to dynamic_tree_nodes nodes per request, one head per depth;
        # the adaptive tree: up to adaptive_max_nodes (engine/adaptive.py).
        nodes = options.dynamic_tree_nodes if tree == DYNAMIC else options.adaptive_max_nodes
        if k is not None and k != nodes + extra:
            field = "dynamic_tree_nodes" if tree == DYNAMIC else "adaptive_max_nodes"
            raise CloverSpecError(f"with tree {tree!r}, num_speculative_tokens is {field}"
                                  f"{plus} ({nodes + extra}); leave it out (got {k!r})")
        k = nodes + extra
    elif tree is not None:
        if k is not None and k != tree.num_nodes + extra:
            raise CloverSpecError(
                f"with tree {tree.name!r}, num_speculative_tokens is its node count{plus} "
                f"({tree.num_nodes + extra}); leave it out (got {k!r})")
        k = tree.num_nodes + extra
    if tree is not None and tree != ADAPTIVE:  # the adaptive tree prices its rows itself
        warn_tree_over_budget(tree, options.dynamic_tree_nodes, options.tree_token_budget, extra)
    if k is None:
        k = heads
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise CloverSpecError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    if tree is None and k > heads:
        raise CloverSpecError(
            f"num_speculative_tokens={k} is larger than the {heads} heads of "
            f"Clover checkpoint {options.checkpoint}; use at most {heads}")
    return k


def rewrite_args(args: Any, spec: dict[str, Any], options: CloverOptions, k: int) -> None:
    """Phase 4: ``args`` in vLLM's medusa form (``spec``: the keys left for vLLM), the
    options in ``additional_config["clover"]``."""
    if options.disable_by_batch_size is not None:
        if "num_speculative_tokens_per_batch_size" in spec:
            raise CloverSpecError("disable_by_batch_size and num_speculative_tokens_per_batch_size "
                                  "are mutually exclusive")
        spec["num_speculative_tokens_per_batch_size"] = batch_size_schedule(options.disable_by_batch_size, k)
    args.speculative_config = {"method": "medusa", "model": options.checkpoint, "num_speculative_tokens": k,
                               **spec}
    args.additional_config = {**(args.additional_config or {}), "clover": options.to_dict()}


def batch_size_schedule(disable_at: int, k: int) -> list[list[int]]:
    """vLLM's dynamic speculative-decoding schedule (``num_speculative_tokens_per_batch_size``,
    inclusive batch-size ranges -> K) for Clover's ``disable_by_batch_size`` option (>= 1,
    checked by ``CloverOptions.from_spec``): K drafts below ``disable_at`` running requests,
    none from there on (the tail is carried forward).

    Why: verification multiplies the target's work by K+1 tokens per request; once the batch
    makes the target compute-bound (CPU: a handful of requests) drafting only costs.
    """
    if disable_at == 1:
        return [[1, 1, 0]]
    return [[1, disable_at - 1, k], [disable_at, disable_at, 0]]


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
