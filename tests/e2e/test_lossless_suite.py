"""Greedy losslessness at scale, with the heads `vllm-clover serve` uses, in chain mode and
with the small_10 tree, prompt lookup and leaf lookups (issues "Clover as a speculative-decoding method inside vLLM" and
"Batched tree verification inside vLLM", correctness): 37 mixed prompts (MT-Bench first
turns through the chat template, multi-turn chats, raw text and code, a prompt longer than
the batch token budget) at batch 1 and all at once, then again under a KV cache so small
that vLLM must preempt running requests. Every output must be token-identical to plain
vLLM's in float32.

The drafter is ``clover_ckpt_dir`` (the shipped heads when they fit the default model,
with the serve defaults K and draft vocabulary; otherwise an untrained drafter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import E2E_DTYPE, shutdown_llm

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
COMMON = dict(dtype=E2E_DTYPE, enforce_eager=True, max_model_len=1024, max_num_batched_tokens=256,
              enable_prefix_caching=True, disable_log_stats=False, seed=0)
# 64 MiB of float32 KV = 1,365 tokens of the 30 target + 2 Clover layers (10 blocks of 128):
# fewer than the running requests need, so the scheduler preempts.
SMALL_KV = 64 << 20


def _prompts(tokenizer) -> list:
    from vllm_clover.training.data import load_mtbench

    from tests.e2e.test_clover import CHATS, PROMPTS

    questions = load_mtbench()
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in questions[:24]]
    chats += [[{"role": "user", "content": q["turns"][0]},
               {"role": "assistant", "content": "Sure, here is my answer."},
               {"role": "user", "content": q["turns"][1]}] for q in questions[24:28] if len(q["turns"]) > 1]
    chats += CHATS
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return rendered + PROMPTS


def _spec_config(ckpt: Path, tree: bool = False) -> dict:
    """The serve defaults; with ``tree``, the small_10 tree with 3 prompt-lookup nodes and 2
    leaf-lookup nodes under each leaf instead of K and the batch-size cut-off, and a token
    budget that keeps the tree for the whole batch (the scheduler's 256-token budget then
    truncates drafts to BFS prefixes)."""
    from vllm_clover.cli import shipped_serve_options
    from vllm_clover.model.draft_vocab import DRAFT_VOCAB_FILE

    options = dict(shipped_serve_options())  # this CPU's row of vllm_clover/serve_defaults.py
    if not (ckpt / DRAFT_VOCAB_FILE).is_file():
        options.pop("draft_vocab_size")
    if not (ckpt / options["datastore"]).is_file():  # a fallback drafter ships no datastore
        options.pop("datastore")
    if tree:
        import json

        heads = json.loads((ckpt / "config.json").read_text())["num_heads"]
        for key in ("num_speculative_tokens", "disable_by_batch_size"):
            options.pop(key, None)
        # small_10 is 5 deep; a 4-head fallback drafter gets a tree of its depth.
        tree_spec = "small_10" if heads >= 5 else [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
        options.update(tree=tree_spec, tree_token_budget=512, prompt_lookup_tokens=3, leaf_lookup_tokens=2)
    return {"method": "clover", "model": str(ckpt), **options}


def _run(model: str, prompts: list, spec: dict | None, kv_bytes: int, one_by_one: bool) -> dict:
    from vllm import LLM, SamplingParams

    extension = {"worker_extension_cls": "vllm_clover.engine.runner_hooks.CloverWorkerExtension"} if spec else {}
    llm = LLM(model=model, kv_cache_memory_bytes=kv_bytes, max_num_seqs=len(prompts),
              speculative_config=spec, **COMMON, **extension)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    try:
        out = {}
        if one_by_one:
            out["batch1"] = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        out["all"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        out["preemptions"] = metrics.get("vllm:num_preemptions", 0)
        out["accepted"] = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
        out["drafts"] = metrics.get("vllm:spec_decode_num_drafts", 0)
        if spec:
            out["drafter"] = llm.collective_rpc("clover_drafter_info")[0]
    finally:
        shutdown_llm(llm)
    return out


@pytest.fixture(scope="module")
def runs(default_model_dir: Path, clover_ckpt_dir: Path) -> dict:
    from transformers import AutoTokenizer

    prompts = _prompts(AutoTokenizer.from_pretrained(default_model_dir))
    spec = _spec_config(clover_ckpt_dir)
    model = str(default_model_dir)
    return {
        "num_prompts": len(prompts),
        "plain": _run(model, prompts, None, 1 << 30, one_by_one=True),
        "clover": _run(model, prompts, spec, 1 << 30, one_by_one=True),
        "plain_small": _run(model, prompts, None, SMALL_KV, one_by_one=False),
        "clover_small": _run(model, prompts, spec, SMALL_KV, one_by_one=False),
        "tree": _run(model, prompts, _spec_config(clover_ckpt_dir, tree=True), 1 << 30, one_by_one=True),
        "tree_small": _run(model, prompts, _spec_config(clover_ckpt_dir, tree=True), SMALL_KV, one_by_one=False),
    }


def test_at_least_32_mixed_prompts(runs) -> None:
    assert runs["num_prompts"] >= 32


@pytest.mark.parametrize("mode", ["clover", "tree"])
def test_batch_1_identical(runs, mode) -> None:
    assert runs[mode]["batch1"] == runs["plain"]["batch1"]


@pytest.mark.parametrize("mode", ["clover", "tree"])
def test_all_at_once_identical(runs, mode) -> None:
    assert runs[mode]["all"] == runs["plain"]["all"]
    assert runs[mode]["drafts"] > 0


def test_serve_default_drafts_in_bfloat16_where_the_cpu_has_it(runs, clover_ckpt_dir: Path) -> None:
    """draft_dtype "auto" (the serve default): bfloat16 products on a CPU with native
    bfloat16 matmuls or the float32 linear kernel (bfloat16 weights; the outputs above stay
    identical), float32 elsewhere; and the shipped heads still get drafts accepted at their
    usual rate with them."""
    from vllm_clover.cpu.linear import draft_matmul_dtype
    from vllm_clover.training.train import shipped_heads_dir

    expected = str(draft_matmul_dtype("auto", torch.float32)).removeprefix("torch.")
    assert runs["clover"]["drafter"] == {"matmul_dtype": expected}
    if clover_ckpt_dir.resolve() == shipped_heads_dir():
        clover = runs["clover"]
        # Accepted draft tokens per drafting step at batch 1 and all at once (one counter):
        # 1.1-1.3 on MT-Bench in the benchmarks; broken products would draft near-noise.
        assert clover["accepted"] / clover["drafts"] > 0.6, clover


@pytest.mark.parametrize("mode", ["clover", "tree"])
def test_under_preemption_identical(runs, mode) -> None:
    assert runs[f"{mode}_small"]["preemptions"] > 0, "the small KV cache did not force preemption"
    assert runs["plain_small"]["preemptions"] > 0
    assert runs[f"{mode}_small"]["all"] == runs["plain_small"]["all"]
