"""Front-end patches: the CLI flags, the Clover translation, the prefix-cache block drop and
``vllm serve``'s error line. The wrapper bodies live in vllm_clover/engine/frontend.py."""

from __future__ import annotations

import importlib
import sys
import typing

from vllm_clover.patches.patching import Patch, params, source, wrap

SERVE_MODULE = "vllm.entrypoints.cli.serve"


# ------------------------------------------------------------------ CLI flags
def install_cli_flags() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_clover.engine import frontend

    wrap(EngineArgs, "add_cli_args", frontend.wrap_add_cli_args, CLI_FLAGS)


def check_cli_flags() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    assert isinstance(EngineArgs.__dict__["add_cli_args"], staticmethod)
    assert params(EngineArgs.add_cli_args) == ["parser"]
    # Our flags reuse these dests; vLLM must still read them in create_speculative_config.
    fields = EngineArgs.__dataclass_fields__
    assert {"spec_model", "spec_tokens", "spec_method", "speculative_config", "additional_config"} <= set(fields)
    assert "load_general_plugins()" in source(AsyncEngineArgs.add_cli_args)


CLI_FLAGS = Patch(
    name="cli-speculative-model-flags",
    target="vllm.engine.arg_utils.EngineArgs.add_cli_args",
    why=("Adds --speculative-model (clover:<dir>) and --num-speculative-tokens to every EngineArgs "
         "parser, reusing vLLM's dests spec_model / spec_tokens; plugins load before it runs."),
    upstream="none known",
    remove_when="vLLM offers these flags, or a hook for plugin CLI arguments",
    apply=install_cli_flags,
    check=check_cli_flags,
)


# ------------------------------------------------------------------ translation
def install_translation() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_clover.engine import frontend

    wrap(EngineArgs, "create_speculative_config", frontend.wrap_create_speculative_config, TRANSLATION)


def check_translation() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.configs.medusa import MedusaConfig

    fn = getattr(EngineArgs.create_speculative_config, "__wrapped__", EngineArgs.create_speculative_config)
    assert params(fn) == ["self", "target_model_config", "target_parallel_config"]
    assert "medusa" in typing.get_args(SpeculativeConfig.__dataclass_fields__["method"].type) or \
        "medusa" in str(SpeculativeConfig.__dataclass_fields__["method"].type)
    # MedusaConfig keeps "architectures" (our registered class resolves), renames top-level
    # num*heads / num*layers keys (why our config.json nests the rest), and maps
    # num_lookahead_tokens onto num_heads (so vLLM sets num_heads = K).
    cfg = MedusaConfig(hidden_size=8, vocab_size=16, num_heads=3, architectures=["X"], clover={"a": 1})
    assert cfg.architectures == ["X"] and cfg.to_dict()["clover"] == {"a": 1}
    cfg.num_lookahead_tokens = 2
    assert cfg.num_heads == 2
    src = source(MedusaConfig.from_pretrained)
    assert '"num" in k' in src and 'config_dict["num_heads"]' in src


TRANSLATION = Patch(
    name="speculative-config-clover-translation",
    target="vllm.engine.arg_utils.EngineArgs.create_speculative_config",
    why=("SpeculativeConfig.method is a closed Literal, so method 'clover' (or 'clover:<dir>') becomes "
         "'medusa' with the Clover directory, and the Clover-only options go to additional_config['clover']. "
         "The checkpoint is validated in the front-end process, one clear line before any engine starts."),
    upstream="vllm-project/vllm#36219 (RFC: a proposer registry for speculative methods)",
    remove_when="vLLM lets plugins register speculative methods",
    apply=install_translation,
    check=check_translation,
)


# ------------------------------------------------------------------ prefix-cache block drop
def install_block_drop() -> None:
    from vllm.config.speculative import SpeculativeConfig

    from vllm_clover.engine import frontend

    wrap(SpeculativeConfig, "use_eagle_block_drop", frontend.wrap_use_eagle_block_drop, BLOCK_DROP)


def check_block_drop() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler

    assert params(SpeculativeConfig.use_eagle_block_drop) == ["self"]
    assert "disable_eagle_block_drop" in SpeculativeConfig.__dataclass_fields__
    sched = source(Scheduler.__init__)
    assert "speculative_config.use_eagle_block_drop()" in sched
    assert "use_eagle=self.use_eagle_block_drop" in sched
    # With no KV-cache group flagged as EAGLE's, every group gets the drop (ours share
    # the target's group 0).
    assert "if use_eagle and not self.eagle_group_ids" in source(KVCacheCoordinator.__init__)


BLOCK_DROP = Patch(
    name="clover-prefix-cache-block-drop",
    target="vllm.config.speculative.SpeculativeConfig.use_eagle_block_drop",
    why=("The trunk KV at position p depends on token p+1, outside p's block hash, so like EAGLE a "
         "Clover engine recomputes the last matched block of a prefix-cache hit; else drafts after "
         "a hit read a stale trunk entry (acceptance only). Honours disable_eagle_block_drop."),
    upstream="vllm-project/vllm#50438 (RFC: lookahead-aware prefix-cache hashing for EAGLE-style drafters)",
    remove_when="vLLM keys the block drop on 'drafter uses target hidden states', not the method",
    apply=install_block_drop,
    check=check_block_drop,
)


# ------------------------------------------------------------------ vllm serve errors
def install_serve_errors() -> None:
    """Wrap ``ServeSubcommand.cmd`` if the CLI module is already imported, as it is in the
    ``vllm`` CLI process when plugins load (``vllm/entrypoints/cli/main.py`` imports every
    command module before building the parsers that load plugins); engine and worker
    processes never import it, and this imports nothing."""
    module = sys.modules.get(SERVE_MODULE)
    if module is None:
        return
    from vllm_clover.engine import frontend

    wrap(module.ServeSubcommand, "cmd", frontend.wrap_serve_cmd, SERVE_ERRORS)


def check_serve_errors() -> None:
    module = importlib.import_module(SERVE_MODULE)
    cls = module.ServeSubcommand
    assert isinstance(cls.__dict__["cmd"], staticmethod)
    assert params(cls.cmd) == ["args"]
    # main() imports every command module before building parsers (which load plugins)
    # and reads dispatch_function=cmd.cmd after subparser_init, i.e. after our wrap.
    main_src = source(importlib.import_module("vllm.entrypoints.cli.main").main)
    assert "import vllm.entrypoints.cli.serve" in main_src
    assert "cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)" in main_src


SERVE_ERRORS = Patch(
    name="serve-clover-errors-one-line",
    target="vllm.entrypoints.cli.serve.ServeSubcommand.cmd",
    why=("In the `vllm serve` process only, a Clover configuration error (bad checkpoint, K > heads, "
         "target mismatch) ends the CLI with one 'vllm serve: error: ...' line and exit 2 instead of "
         "a traceback; LLM(...) users still get the exception."),
    upstream="none known",
    remove_when="vLLM prints ValueErrors from engine configuration without a traceback",
    apply=install_serve_errors,
    check=check_serve_errors,
)
