"""Self-distillation (``vllm_clover.training.data.self_distill``) answers ShareGPT first turns
with the target in vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_clover.training import data as D


@pytest.mark.slow
def test_self_distill_two_conversations(default_model_dir: Path) -> None:
    convs = D.split_heldout(D.load_sharegpt())[0][:2]
    out = D.self_distill(default_model_dir, convs, max_new_tokens=8, dtype="float32")
    assert [c.id for c in out] == [c.id for c in convs]
    for src, c in zip(convs, out):
        assert c.messages[0] == src.messages[0] and c.messages[1]["role"] == "assistant"
        assert len(c.messages) == 2 and c.messages[1]["content"].strip()
        assert c.meta["self_distilled"] and isinstance(c.meta["truncated"], bool)
