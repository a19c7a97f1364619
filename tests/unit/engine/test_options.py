"""CloverOptions: one documented field per option, a lossless JSON crossing into the
worker, and the README's options table generated from the fields."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_clover.engine.options import DYNAMIC, CloverOptions, options_markdown, user_fields

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_options_table_is_generated_from_the_fields() -> None:
    text = README.read_text()
    begin, end = "<!-- options:begin -->\n", "<!-- options:end -->"
    assert begin in text and end in text, "README.md lacks the options markers"
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == options_markdown(), "README options table is stale: python -m vllm_clover.engine.options"


def test_module_prints_the_table() -> None:
    out = subprocess.run([sys.executable, "-m", "vllm_clover.engine.options"], cwd=README.parent,
                         capture_output=True, text=True, check=True).stdout
    assert out == options_markdown()


def test_every_field_is_documented() -> None:
    for f in dataclasses.fields(CloverOptions):
        assert f.metadata["help"].strip(), f.name
    names = [f.name for f in user_fields()]
    assert "tree" in names and "checkpoint" not in names and "tree_depth" not in names
    assert len(options_markdown().splitlines()) == 2 + len(names)


@pytest.mark.parametrize("tree,name,depth", [
    (None, "", 0),
    (DYNAMIC, DYNAMIC, 5),
    (((0,), (1,), (0, 0)), "custom", 2),
])
def test_json_crossing_is_lossless(tree, name, depth) -> None:
    options = CloverOptions(tree=tree, tree_name=name, tree_depth=depth, tree_token_budget=12,
                            checkpoint="/ckpt", checkpoint_num_heads=5, variant="clover2",
                            disable_by_batch_size=3, datastore="/ckpt/ds.npz")
    data = json.loads(json.dumps(options.to_dict()))  # what VllmConfig.compute_hash serialises
    assert CloverOptions.from_dict(data) == options
    assert pickle.loads(pickle.dumps(options)) == options
    hash(options)
    if isinstance(tree, tuple):
        assert data["tree"] == [[0], [1], [0, 0]]
        assert options.drafting_tree().num_nodes == 3


def test_options_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CloverOptions(tree_token_budget=8).tree_token_budget = 9


def test_translated_options_reach_the_worker_typed(default_model_dir, clover_ckpt_dir) -> None:
    """The front end stores ``to_dict()``; the VllmConfig still hashes and pickles, and the
    worker side reads the same typed options back."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(default_model_dir), dtype="float32", max_model_len=512,
                      speculative_config={"method": "clover", "model": str(clover_ckpt_dir), "tree": "small_4",
                                          "prompt_lookup_tokens": 2, "tree_token_budget": 40})
    config = args.create_engine_config()
    config.compute_hash()
    options = CloverOptions.from_vllm_config(pickle.loads(pickle.dumps(config)))
    assert options.to_dict() == config.additional_config["clover"]
    assert options.tree_name == "small_4" and options.checkpoint == str(clover_ckpt_dir.resolve())
    assert options.drafting_tree().num_nodes == 4 and options.prompt_lookup_tokens == 2
