"""Reduced draft vocabulary (vllm_clover/model/draft_vocab.py): ranking, file round trip, one-line
errors, the ``draft_vocab_size`` option at start-up (Clover in vLLM with it:
tests/e2e/test_draft_vocab_engine.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from vllm_clover.model.draft_vocab import (DRAFT_VOCAB_FILE, DraftVocabError, load_draft_vocab, save_draft_vocab,
                                     subset_logits_fn, token_ranking)
from vllm_clover.engine.frontend import CloverSpecError


def _feature_files(tmp_path: Path, seqs: list[tuple[list[int], list[int]]]) -> SimpleNamespace:
    files = []
    for i, (ids, mask) in enumerate(seqs):
        path = tmp_path / f"part{i}.safetensors"
        save_file({"input_ids": np.array(ids, dtype=np.int32), "loss_mask": np.array(mask, dtype=np.uint8)},
                  str(path))
        files.append(path)
    return SimpleNamespace(files=files)


def test_ranking_puts_response_tokens_first(tmp_path) -> None:
    # token 5: 3x in responses; 7: 2x in responses, 4: 4x but only in prompts; 1: 1x prompt.
    ds = _feature_files(tmp_path, [([4, 4, 5, 7, 5], [0, 0, 1, 1, 1]), ([4, 4, 1, 5, 7], [0, 0, 0, 1, 1])])
    ranking = token_ranking(ds, vocab_size=10)
    assert ranking[:4].tolist() == [5, 7, 4, 1]
    assert sorted(ranking.tolist()) == list(range(10))  # every id exactly once; rest by id
    assert ranking[4:].tolist() == [0, 2, 3, 6, 8, 9]


def test_file_round_trip_and_errors(tmp_path) -> None:
    save_draft_vocab(tmp_path, torch.tensor([5, 7, 4, 1, 0]), "unit test")
    assert load_draft_vocab(tmp_path, 3, vocab_size=10).tolist() == [5, 7, 4]
    with pytest.raises(DraftVocabError, match="holds 5 token ids; draft_vocab_size=6 is too large"):
        load_draft_vocab(tmp_path, 6, vocab_size=10)
    with pytest.raises(DraftVocabError, match="outside the target vocabulary"):
        load_draft_vocab(tmp_path, 2, vocab_size=6)
    (tmp_path / DRAFT_VOCAB_FILE).write_text('{"token_ids": [1, 1, 2]}')
    with pytest.raises(DraftVocabError, match="repeats token ids"):
        load_draft_vocab(tmp_path, 2, vocab_size=10)
    (tmp_path / DRAFT_VOCAB_FILE).write_text("{not json")
    with pytest.raises(DraftVocabError, match="is not a draft vocabulary file"):
        load_draft_vocab(tmp_path, 2, vocab_size=10)
    with pytest.raises(DraftVocabError, match="does not exist"):
        load_draft_vocab(tmp_path / "nowhere", 2, vocab_size=10)


def test_subset_logits_equal_full_logits_on_the_subset() -> None:
    torch.manual_seed(0)
    weight, h = torch.randn(50, 8), torch.randn(3, 8)
    ids = torch.tensor([3, 17, 42, 0])
    got = subset_logits_fn(weight, ids)(h)
    full = h @ weight.T
    assert got.shape == (3, 50)
    torch.testing.assert_close(got[:, ids], full[:, ids])
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(got[:, outside]).all()
    assert torch.isin(got.argmax(-1), ids).all()


# ============================================================================ start-up option
@pytest.fixture
def ckpt_with_vocab(clover_ckpt_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(clover_ckpt_dir, dst)
    save_draft_vocab(dst, torch.arange(2000), "unit test")
    return dst


def _translate(model_dir: Path, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=512, speculative_config=spec)
    return args.create_engine_config()


def test_option_is_validated_and_passed_to_the_workers(default_model_dir, ckpt_with_vocab) -> None:
    config = _translate(default_model_dir, {"method": "clover", "model": str(ckpt_with_vocab),
                                            "draft_vocab_size": 1024})
    assert config.additional_config["clover"]["draft_vocab_size"] == 1024


@pytest.mark.parametrize("value, needle", [
    (-1, "draft_vocab_size must be an integer >= 0"),
    ("big", "draft_vocab_size must be an integer >= 0"),
    (4096, "holds 2000 token ids; draft_vocab_size=4096 is too large"),
])
def test_bad_option_is_one_line(default_model_dir, ckpt_with_vocab, value, needle) -> None:
    with pytest.raises(CloverSpecError) as excinfo:
        _translate(default_model_dir, {"method": "clover", "model": str(ckpt_with_vocab), "draft_vocab_size": value})
    assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_missing_file_is_one_line(default_model_dir, ckpt_with_vocab) -> None:
    (ckpt_with_vocab / DRAFT_VOCAB_FILE).unlink()
    with pytest.raises(CloverSpecError, match="draft_vocab.json, which does not exist"):
        _translate(default_model_dir, {"method": "clover", "model": str(ckpt_with_vocab), "draft_vocab_size": 64})
