"""Front end: Clover spellings are translated to vLLM's medusa slot, bad input fails
fast (before any engine process is spawned) with one readable line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from vllm_clover.model.checkpoint import CloverCheckpointError
from vllm_clover.engine.options import TREE_TOKEN_BUDGET, CloverOptions, CloverSpecError


def _engine_config(model_dir: Path, spec: dict, **kw):
    """What LLM(...) and `vllm serve` run in the front-end process, minus the engine."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=512,
                      speculative_config=spec, **kw)
    return args, args.create_engine_config()


def _one_line_error(excinfo: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.fixture
def ckpt_copy(clover_ckpt_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(clover_ckpt_dir, dst)
    return dst


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path.write_text(json.dumps(data))


# ============================================================================ translation
@pytest.mark.parametrize("spec", [
    {"method": "clover", "model": "{dir}", "num_speculative_tokens": 3},
    {"model": "clover:{dir}", "num_speculative_tokens": 3},
    {"method": "clover", "model": "clover:{dir}", "num_speculative_tokens": 3, "draft_sampling": "greedy"},
    {"method": "clover", "model": "{dir}", "num_speculative_tokens": 3, "draft_dtype": "bfloat16"},
])
def test_clover_spec_becomes_medusa_with_clover_options(default_model_dir, clover_ckpt_dir, spec) -> None:
    spec = {k: v.format(dir=clover_ckpt_dir) if isinstance(v, str) else v for k, v in spec.items()}
    _, config = _engine_config(default_model_dir, spec)
    sc = config.speculative_config
    assert sc.method == "medusa" and sc.num_speculative_tokens == 3
    assert Path(sc.model) == clover_ckpt_dir.resolve()
    assert sc.draft_model_config.hf_config.architectures == ["CloverForSpeculativeDecoding"]
    opts = config.additional_config["clover"]
    assert opts["draft_sampling"] == spec.get("draft_sampling", "sample")
    assert opts["draft_dtype"] == spec.get("draft_dtype", "auto")
    from vllm_clover.engine.frontend import is_clover_vllm_config

    assert is_clover_vllm_config(config)


def test_k_defaults_to_checkpoint_heads(default_model_dir, clover_ckpt_dir) -> None:
    from vllm_clover.model.checkpoint import load_config

    _, config = _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir)})
    assert config.speculative_config.num_speculative_tokens == load_config(clover_ckpt_dir).num_heads


def test_cli_flags_translate(default_model_dir, clover_ckpt_dir) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", str(default_model_dir), "--dtype", "float32", "--max-model-len", "512",
                            "--speculative-model", f"clover:{clover_ckpt_dir}",
                            "--num-speculative-tokens", "2"])
    config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
    assert config.speculative_config.method == "medusa"
    assert config.speculative_config.num_speculative_tokens == 2


def test_non_clover_speculation_is_untouched(default_model_dir) -> None:
    _, config = _engine_config(default_model_dir, {"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 3})
    assert config.speculative_config.method == "ngram"
    assert "clover" not in (config.additional_config or {})
    assert not config.speculative_config.use_eagle_block_drop()


def test_prefix_cache_block_drop_on_for_clover(default_model_dir, clover_ckpt_dir) -> None:
    """Like EAGLE, Clover drops the last matched prefix-cache block (its trunk KV at the
    boundary depends on the next token); the user can opt out with vLLM's own key."""
    spec = {"method": "clover", "model": str(clover_ckpt_dir), "num_speculative_tokens": 2}
    assert _engine_config(default_model_dir, spec)[1].speculative_config.use_eagle_block_drop()
    _, config = _engine_config(default_model_dir, {**spec, "disable_eagle_block_drop": True})
    assert not config.speculative_config.use_eagle_block_drop()


# ============================================================================ start-up errors
def test_cli_rejects_clover_prefix_without_path(capsys) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--speculative-model", "clover:"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-model" in err and "no checkpoint directory" in err


def test_empty_clover_path(default_model_dir) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"model": "clover:", "num_speculative_tokens": 2})
    _one_line_error(excinfo, "no checkpoint directory")


def test_missing_directory(default_model_dir, tmp_path) -> None:
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(tmp_path / "nope")})
    _one_line_error(excinfo, "does not exist", "nope")


def test_missing_weights(default_model_dir, ckpt_copy) -> None:
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(ckpt_copy)})
    _one_line_error(excinfo, "model.safetensors", "missing")


def test_truncated_weights(default_model_dir, ckpt_copy) -> None:
    path = ckpt_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(ckpt_copy)})
    _one_line_error(excinfo, "model.safetensors", "truncated or corrupt")


def test_corrupt_weights_header(default_model_dir, ckpt_copy) -> None:
    (ckpt_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(ckpt_copy)})
    _one_line_error(excinfo, "truncated or corrupt")


def test_checkpoint_for_another_target_hidden_size(default_model_dir, tmp_path) -> None:
    from vllm_clover.model.checkpoint import save_drafter
    from vllm_clover.model.config import CloverConfig
    from vllm_clover.model.drafter import CloverDrafter

    cfg = CloverConfig(hidden_size=64, vocab_size=49152, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, num_heads=3)
    save_drafter(tmp_path / "other", CloverDrafter(cfg), dtype=torch.float32)
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(tmp_path / "other")})
    _one_line_error(excinfo, "hidden_size 64", "target has 576")


def test_checkpoint_for_another_target_vocab(default_model_dir, ckpt_copy) -> None:
    _edit_config(ckpt_copy, vocab_size=32000)
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(ckpt_copy)})
    _one_line_error(excinfo, "vocab_size 32000", "target has 49152")


def test_unknown_variant(default_model_dir, ckpt_copy) -> None:
    _edit_config(ckpt_copy, clover__variant="clover3")
    with pytest.raises(CloverCheckpointError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(ckpt_copy)})
    _one_line_error(excinfo, "unknown variant 'clover3'")


def test_k_larger_than_heads(default_model_dir, clover_ckpt_dir) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                           "num_speculative_tokens": 99})
    _one_line_error(excinfo, "num_speculative_tokens=99", "heads")


def test_unknown_clover_option_value(default_model_dir, clover_ckpt_dir) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                           "draft_sampling": "beam"})
    _one_line_error(excinfo, "draft_sampling='beam'")


def test_adaptive_chain_option(default_model_dir, clover_ckpt_dir) -> None:
    """adaptive_chain is chain drafting sized by the heads; a tree beside it, or a value that is
    not a boolean, is one line naming the fix."""
    base = {"method": "clover", "model": str(clover_ckpt_dir)}
    _, config = _engine_config(default_model_dir, {**base, "adaptive_chain": True})
    options = CloverOptions.from_vllm_config(config)
    assert options.adaptive_chain and options.adaptive and options.tree is None
    assert config.speculative_config.num_speculative_tokens == options.checkpoint_num_heads
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {**base, "adaptive_chain": True, "tree": "small_4"})
    _one_line_error(excinfo, "adaptive_chain", "tree")
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {**base, "adaptive_chain": "yes"})
    _one_line_error(excinfo, "adaptive_chain must be true or false")


def test_draft_dtype_option_errors(default_model_dir, clover_ckpt_dir, monkeypatch) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                           "draft_dtype": "float16"})
    _one_line_error(excinfo, "draft_dtype='float16'", "'bfloat16'")
    # On a GPU the drafter runs in the model's dtype: an explicit choice is refused.
    import vllm_clover.engine.options as options

    monkeypatch.setattr(options, "_on_cpu", lambda: False)
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                           "draft_dtype": "bfloat16"})
    _one_line_error(excinfo, "draft_dtype='bfloat16'", "CPU build")


def test_llm_constructor_fails_in_front_end(default_model_dir, tmp_path) -> None:
    """LLM(...) raises the checkpoint error itself, before spawning EngineCore."""
    import multiprocessing

    from vllm import LLM

    with pytest.raises(CloverCheckpointError) as excinfo:
        LLM(model=str(default_model_dir), dtype="float32", max_model_len=512,
            speculative_config={"method": "clover", "model": str(tmp_path / "missing")})
    _one_line_error(excinfo, "does not exist")
    assert not multiprocessing.active_children()


# ============================================================================ trunk inputs
def test_trunk_inputs_eagle_shift() -> None:
    """Three requests in one step: a decode with 2 drafts (1 accepted), a full prefill
    with 2 prefix-cached tokens, and a partial prefill chunk."""
    from vllm_clover.engine.proposer import trunk_inputs

    tokens = torch.zeros(3, 16, dtype=torch.int32)
    tokens[0, :7] = torch.tensor([10, 11, 12, 13, 14, 15, 16])  # 4 old + accepted 15 + bonus 16
    tokens[1, :6] = torch.tensor([20, 21, 22, 23, 24, 25])      # 5 prompt + sampled 25
    tokens[2, :8] = torch.tensor([30, 31, 32, 33, 34, 35, 36, 37])  # 8-token prompt
    num_tokens = torch.tensor([7, 6, 8])
    # req0: 5 committed (pos 0-4), rows at pos 4 (token 14) and 5, 6 (drafts); 1 accepted.
    positions = torch.tensor([4, 5, 6, 2, 3, 4, 0, 1, 2])
    qsl = torch.tensor([0, 3, 6, 9])
    y, last, first = trunk_inputs(tokens, num_tokens, positions, qsl)
    assert y.tolist() == [15, 16, 0, 23, 24, 25, 31, 32, 33]
    assert last.tolist() == [1, 5, 8]
    assert first.tolist() == [16, 25, 37]


# ============================================================================ CLI errors
def test_cli_rejects_missing_checkpoint_directory_at_parse_time(tmp_path, capsys) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit) as excinfo:
        parser.parse_args(["--model", "m", "--speculative-model", f"clover:{missing}"])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-model" in err and str(missing) in err and "does not exist" in err
    # Non-Clover values are not checked here (vLLM's --spec-model semantics).
    ns = parser.parse_args(["--model", "m", "--speculative-model", "some/draft-model"])
    assert ns.spec_model == "some/draft-model"


def test_serve_command_prints_clover_errors_as_one_line(monkeypatch, capsys) -> None:
    """The wrapped `vllm serve` command turns the plugin's configuration errors into one
    stderr line and exit 2; other exceptions pass through untouched."""
    import types

    from vllm_clover.patches import frontend
    class ServeSubcommand:
        @staticmethod
        def cmd(args):
            raise args.error

    fake = types.ModuleType(frontend.SERVE_MODULE)
    fake.ServeSubcommand = ServeSubcommand
    monkeypatch.setitem(__import__("sys").modules, frontend.SERVE_MODULE, fake)
    frontend.install_serve_errors()
    wrapped = ServeSubcommand.cmd
    frontend.install_serve_errors()  # idempotent
    assert ServeSubcommand.cmd is wrapped and getattr(wrapped, "__vllm_clover_wrapped__", False)

    for error in (CloverCheckpointError("checkpoint directory /x does not exist"),
                  CloverSpecError("num_speculative_tokens=9 is larger than the 4 heads")):
        with pytest.raises(SystemExit) as excinfo:
            ServeSubcommand.cmd(types.SimpleNamespace(error=error))
        assert excinfo.value.code == 2
        err = capsys.readouterr().err
        assert err == f"vllm serve: error: {error}\n"
    with pytest.raises(RuntimeError, match="engine"):
        ServeSubcommand.cmd(types.SimpleNamespace(error=RuntimeError("engine died")))


def test_serve_error_wrap_is_noop_without_the_cli(monkeypatch) -> None:
    from vllm_clover.patches import frontend
    monkeypatch.delitem(__import__("sys").modules, frontend.SERVE_MODULE, raising=False)
    frontend.install_serve_errors()  # nothing to wrap, nothing imported
    assert frontend.SERVE_MODULE not in __import__("sys").modules


# ============================================================================ runner fixes
def test_discarded_rows_cpu_generators_are_hidden_for_clover_only() -> None:
    """vLLM 0.32's partial-prefill generator rewind crashes on CPU generators; for Clover
    engines the generators of discarded rows are hidden during sample_tokens."""
    import types

    import numpy as np

    from vllm_clover.engine.runner_hooks import hide_discarded_cpu_generators, wrap_sample_tokens

    gens = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2),
            3: torch.Generator().manual_seed(3)}
    runner = types.SimpleNamespace(
        drafter=types.SimpleNamespace(is_clover=True), execute_model_state=object(),
        input_batch=types.SimpleNamespace(generators=gens, num_reqs=3),
        discard_request_mask=types.SimpleNamespace(np=np.array([True, True, False, True])))
    seen = {}

    def orig(self, grammar_output):  # what vLLM's rewind loop would iterate over
        seen["rows"] = sorted(self.input_batch.generators)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        wrap_sample_tokens(orig)(runner, None)
    assert seen["rows"] == [2, 3]  # row 0 hidden (discarded); row 3 is past num_reqs
    assert sorted(gens) == [0, 2, 3] and gens[0].initial_seed() == 1  # restored, even on error
    runner.drafter.is_clover = False
    assert hide_discarded_cpu_generators(runner) == {}


def test_cpu_expand_kernel_fix() -> None:
    """vLLM 0.32's CPU fallback of the rejection sampler's expand_kernel drops its result
    for float / int32 tensors (per-token temperature, top-p, top-k of verification rows);
    the plugin's replacement expands correctly through vLLM's own entry point."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from vllm_clover import patches
    patches.apply_all()
    CpuPlatform.register_triton_kernel_overrides()  # what each CPU worker does after plugins
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    temp = expand_batch_to_tokens(torch.tensor([0.8, 0.0, 1.3]), cu, 6, replace_from=0, replace_to=1)
    assert temp.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.3, 1.3, 1.3])
    top_k = expand_batch_to_tokens(torch.tensor([5, 7, 9], dtype=torch.int32), cu, 6)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 7, 9, 9, 9]


def test_disable_by_batch_size_becomes_vllms_dynamic_schedule(default_model_dir, clover_ckpt_dir) -> None:
    from vllm_clover.engine.frontend import batch_size_schedule

    assert batch_size_schedule(3, 2) == [[1, 2, 2], [3, 3, 0]]
    assert batch_size_schedule(1, 4) == [[1, 1, 0]]
    _, config = _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                                   "num_speculative_tokens": 2, "disable_by_batch_size": 3})
    assert [list(r) for r in config.speculative_config.num_speculative_tokens_per_batch_size] == [[1, 2, 2], [3, 3, 0]]


@pytest.mark.parametrize("value", [0, -2, "3", True])
def test_bad_disable_by_batch_size_is_one_line(default_model_dir, clover_ckpt_dir, value) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                           "disable_by_batch_size": value})
    _one_line_error(excinfo, "disable_by_batch_size must be an integer >= 1")


# ============================================================================ tree option
def test_tree_option_sets_k_to_the_node_count(default_model_dir, clover_ckpt_dir) -> None:
    """With ``tree``, vLLM's num_speculative_tokens is the node count (drafts are the BFS
    nodes); the drafter still loads every checkpoint head (one per depth)."""
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    _, config = _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                                   "tree": tree, "tree_token_budget": 40})
    assert config.speculative_config.num_speculative_tokens == 5
    opts = config.additional_config["clover"]
    assert opts["tree"] == tree and opts["tree_depth"] == 3 and opts["tree_token_budget"] == 40
    assert opts["checkpoint_num_heads"] >= 3


def test_dynamic_tree_option(default_model_dir, clover_ckpt_dir) -> None:
    _, config = _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir),
                                                   "tree": "dynamic", "dynamic_tree_nodes": 12})
    assert config.speculative_config.num_speculative_tokens == 12
    opts = config.additional_config["clover"]
    assert opts["tree"] == "dynamic" and opts["tree_depth"] == opts["checkpoint_num_heads"]
    assert opts["tree_token_budget"] == TREE_TOKEN_BUDGET["cpu"]  # this suite runs the CPU build


def test_worker_side_options_default_to_the_device_tree_budget() -> None:
    """A config the front end never stashed options in still gets a usable budget."""
    from types import SimpleNamespace

    from vllm_clover.engine.options import CloverOptions

    options = CloverOptions.from_vllm_config(SimpleNamespace(additional_config=None))
    assert options.tree_token_budget == TREE_TOKEN_BUDGET["cpu"]


def test_tree_over_budget_warns_at_start_up(default_model_dir, clover_ckpt_dir, caplog) -> None:
    """small_10 (11 verify tokens) does not fit the CPU default budget of 8 even at batch 1:
    start-up says it will draft a chain; with room for it nothing is said."""
    spec = {"method": "clover", "model": str(clover_ckpt_dir), "tree": "small_10"}
    with caplog.at_level(logging.WARNING, logger="vllm_clover.engine.frontend"):
        _engine_config(default_model_dir, spec)
    assert "tree 'small_10' needs 11 verify tokens" in caplog.text and "chain of 5" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_clover.engine.frontend"):
        _engine_config(default_model_dir, {**spec, "tree_token_budget": 11})
    assert "verify tokens" not in caplog.text


@pytest.mark.parametrize("extra,needles", [
    ({"tree": "dynamic", "dynamic_tree_nodes": 0}, ("dynamic_tree_nodes",)),
    ({"tree": "dynamic", "num_speculative_tokens": 3}, ("dynamic_tree_nodes (25)",)),
    ({"tree": "no_such_tree"}, ("unknown tree 'no_such_tree'",)),
    ({"tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]}, ("6 deep", "heads")),
    ({"tree": [[1]]}, ("tree",)),
    ({"tree": "small_10", "num_speculative_tokens": 3}, ("node count (10)", "leave it out")),
    ({"tree": "small_10", "tree_token_budget": 0}, ("tree_token_budget",)),
])
def test_bad_tree_options_are_one_line_errors(default_model_dir, clover_ckpt_dir, extra, needles) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir), **extra})
    _one_line_error(excinfo, *needles)


def test_prompt_lookup_tokens_add_to_the_node_count(default_model_dir, clover_ckpt_dir) -> None:
    """Grafted lookup nodes are drafts too: vLLM's K is the tree's nodes plus them."""
    base = {"method": "clover", "model": str(clover_ckpt_dir), "tree_token_budget": 40}
    _, config = _engine_config(default_model_dir, {**base, "tree": "small_4", "prompt_lookup_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert config.speculative_config.num_speculative_tokens == 4 + 3
    opts = config.additional_config["clover"]
    assert (opts["prompt_lookup_tokens"], opts["prompt_lookup_min"], opts["prompt_lookup_max"]) == (3, 1, 3)
    _, config = _engine_config(default_model_dir, {**base, "tree": "dynamic", "dynamic_tree_nodes": 6,
                                                   "prompt_lookup_tokens": 2})
    assert config.speculative_config.num_speculative_tokens == 8
    assert config.additional_config["clover"]["prompt_lookup_min"] == 2  # vLLM ngram's bench default
    _, config = _engine_config(default_model_dir, {**base, "tree": "small_4"})
    assert config.additional_config["clover"]["prompt_lookup_tokens"] == 0
    assert config.additional_config["clover"]["leaf_lookup_tokens"] == 0
    # Leaf lookups: up to that many nodes under each leaf (small_4 has 2 leaves, wide_9 5).
    _, config = _engine_config(default_model_dir, {**base, "tree": "small_4", "prompt_lookup_tokens": 3,
                                                   "leaf_lookup_tokens": 2})
    assert config.speculative_config.num_speculative_tokens == 4 + 3 + 2 * 2
    assert config.additional_config["clover"]["leaf_lookup_tokens"] == 2
    _, config = _engine_config(default_model_dir, {**base, "tree": "wide_9", "prompt_lookup_tokens": 16,
                                                   "leaf_lookup_tokens": 2})
    assert config.speculative_config.num_speculative_tokens == 9 + 16 + 5 * 2


def test_prompt_lookup_over_budget_warns(default_model_dir, clover_ckpt_dir, caplog) -> None:
    spec = {"method": "clover", "model": str(clover_ckpt_dir), "tree": "small_4", "prompt_lookup_tokens": 5}
    with caplog.at_level(logging.WARNING, logger="vllm_clover.engine.frontend"):
        _engine_config(default_model_dir, spec)  # 4 + 5 + 1 = 10 > 8
    assert "needs 10 verify tokens" in caplog.text and "prompt lookup adds at most 3 of its 5" in caplog.text


@pytest.mark.parametrize("extra,needles", [
    ({"prompt_lookup_tokens": 3}, ("prompt_lookup_tokens", "tree option", "chain2")),
    ({"tree": "small_4", "prompt_lookup_tokens": -1}, ("prompt_lookup_tokens must be an integer >= 0",)),
    ({"tree": "small_4", "prompt_lookup_tokens": True}, ("prompt_lookup_tokens",)),
    ({"tree": "small_4", "prompt_lookup_tokens": 2, "prompt_lookup_min": 0}, ("prompt_lookup_min must be an integer >= 1",)),
    ({"tree": "small_4", "prompt_lookup_tokens": 2, "prompt_lookup_min": 5}, ("prompt_lookup_min (5)", "prompt_lookup_max (4)")),
    ({"tree": "small_4", "prompt_lookup_tokens": 2, "num_speculative_tokens": 4}, ("node count + prompt_lookup_tokens (6)",)),
    ({"tree": "dynamic", "prompt_lookup_tokens": 2, "num_speculative_tokens": 4},
     ("dynamic_tree_nodes + prompt_lookup_tokens (27)",)),
    ({"tree": "small_4", "leaf_lookup_tokens": 2}, ("leaf_lookup_tokens", "set prompt_lookup_tokens too")),
    ({"tree": "small_4", "prompt_lookup_tokens": 2, "leaf_lookup_tokens": -1},
     ("leaf_lookup_tokens must be an integer >= 0",)),
    ({"tree": "dynamic", "prompt_lookup_tokens": 2, "leaf_lookup_tokens": 1}, ("leaf_lookup_tokens needs a static tree",)),
    ({"tree": "small_4", "prompt_lookup_tokens": 2, "leaf_lookup_tokens": 1, "num_speculative_tokens": 6},
     ("node count + prompt_lookup_tokens + leaf_lookup_tokens x leaves (8)",)),
])
def test_bad_prompt_lookup_options_are_one_line_errors(default_model_dir, clover_ckpt_dir, extra, needles) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _engine_config(default_model_dir, {"method": "clover", "model": str(clover_ckpt_dir), **extra})
    _one_line_error(excinfo, *needles)


def test_datastore_option_paths_and_errors(default_model_dir, ckpt_copy, tmp_path) -> None:
    """``datastore``: relative to the checkpoint directory, or absolute; it must load, fit
    the target's vocabulary and come with prompt-lookup slots; each failure is one line."""
    from vllm_clover.drafting.datastore import build_datastore, save_datastore

    save_datastore(build_datastore([[1, 2, 3, 1, 2, 3]], vocab_size=49152, min_count=1), ckpt_copy / "ds.npz")
    base = {"method": "clover", "model": str(ckpt_copy), "tree": "chain2", "prompt_lookup_tokens": 3}
    _, config = _engine_config(default_model_dir, {**base, "datastore": "ds.npz"})
    assert config.additional_config["clover"]["datastore"] == str((ckpt_copy / "ds.npz").resolve())
    assert config.speculative_config.num_speculative_tokens == 2 + 3  # the lookup's slots, no more
    _, config = _engine_config(default_model_dir, {**base, "datastore": str(ckpt_copy / "ds.npz")})
    assert config.additional_config["clover"]["datastore"] == str((ckpt_copy / "ds.npz").resolve())
    _, config = _engine_config(default_model_dir, base)
    assert config.additional_config["clover"]["datastore"] == ""
    assert config.additional_config["clover"]["datastore_min_confidence"] == 0.2
    _, config = _engine_config(default_model_dir, {**base, "datastore": "ds.npz", "datastore_min_confidence": 0})
    assert config.additional_config["clover"]["datastore_min_confidence"] == 0.0
    save_datastore(build_datastore([[1, 2]], vocab_size=100, min_count=1), tmp_path / "small.npz")
    for extra, needles in [
        ({"datastore": "nope.npz"}, ("clover option datastore", "nope.npz", "does not exist")),
        ({"datastore": str(tmp_path / "small.npz")}, ("100-token vocabulary", "49152")),
        ({"datastore": 3}, ("datastore must be a path",)),
        ({"datastore": "ds.npz", "prompt_lookup_tokens": 0}, ("prompt_lookup_tokens",)),
        ({"datastore": "ds.npz", "datastore_min_confidence": 1.5}, ("datastore_min_confidence", "between 0 and 1")),
        ({"datastore": "ds.npz", "datastore_min_confidence": "high"}, ("datastore_min_confidence",)),
    ]:
        with pytest.raises(CloverSpecError) as excinfo:
            _engine_config(default_model_dir, {**base, **extra})
        _one_line_error(excinfo, *needles)
