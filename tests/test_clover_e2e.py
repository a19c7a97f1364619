"""Clover inside vLLM's engine is lossless: greedy float32 outputs are token-identical to
plain vLLM, across batch sizes, chunked prefill, prefix-cache hits, chat templates, stop
strings, max_tokens and generation up to max_model_len; sampling runs with draft
probabilities. One plain and one Clover LLM per module (started one after the other)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import shutdown_llm

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
LLM_KWARGS = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                  max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256, max_num_seqs=16,
                  enable_prefix_caching=True, disable_log_stats=False)
K = 3

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. ") * 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours:",
    LONG + "\nSummarise the passage above in one sentence:",   # > 256 tokens: chunked prefill
    "Q: What is 12 times 7?\nA:",
    "Write a haiku about the sea.",
    LONG[:400] + " In conclusion,",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Translate to French: I like apples.",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi! Who are you?"},
     {"role": "assistant", "content": "I am a helpful assistant."},
     {"role": "user", "content": "Tell me a fun fact about cats."}],
]
# Near max_model_len: max_tokens=None lets generation run into the length limit.
NEAR_LIMIT = LONG * 2 + " And then"


def _run_suite(llm, tokenizer) -> dict:
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=32)

    def ids(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]

    near_ids = tokenizer(NEAR_LIMIT)["input_ids"][: MAX_MODEL_LEN - 40]
    res = {
        "batch": ids(llm.generate(PROMPTS, greedy, use_tqdm=False)),
        "batch_again": ids(llm.generate(PROMPTS, greedy, use_tqdm=False)),  # prefix-cache hits
        "single": [ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in (PROMPTS[0], PROMPTS[3])],
        "chat": ids(llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)),
        "stop": [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, stop=[".", "\n\n"]), use_tqdm=False)],
        "max_tokens": ids(llm.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=7),
                                       use_tqdm=False)),
        "to_max_model_len": ids(llm.generate(
            [{"prompt_token_ids": near_ids}], SamplingParams(temperature=0.0, max_tokens=None,
                                                             ignore_eos=True), use_tqdm=False)),
        "prompt_len_near": len(near_ids),
    }
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7),
                           use_tqdm=False)
    res["sampled"] = [len(o.outputs[0].token_ids) for o in sampled]
    res["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                      if m.name.startswith("vllm:spec_decode")}
    return res


@pytest.fixture(scope="module")
def results(default_model_dir: Path, clover_ckpt_dir: Path) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    plain = LLM(model=str(default_model_dir), **LLM_KWARGS)
    try:
        ref = _run_suite(plain, tokenizer)
    finally:
        shutdown_llm(plain)
        del plain
    clover = LLM(model=str(default_model_dir), speculative_config={
        "method": "clover", "model": str(clover_ckpt_dir), "num_speculative_tokens": K}, **LLM_KWARGS)
    try:
        got = _run_suite(clover, tokenizer)
    finally:
        shutdown_llm(clover)
    return {"ref": ref, "clover": got}


@pytest.mark.parametrize("case", ["batch", "batch_again", "single", "chat", "stop", "max_tokens",
                                  "to_max_model_len"])
def test_greedy_outputs_identical_to_plain_vllm(results: dict, case: str) -> None:
    assert results["clover"][case] == results["ref"][case]


def test_cases_cover_what_they_claim(results: dict) -> None:
    ref = results["ref"]
    assert len(PROMPTS) >= 8
    assert all(reason == "length" and len(t) == 7 for t, reason in ref["max_tokens"])
    assert any(reason == "stop" for _, reason in ref["stop"])
    tokens, reason = ref["to_max_model_len"][0]
    assert reason == "length" and ref["prompt_len_near"] + len(tokens) == MAX_MODEL_LEN


def test_drafts_were_proposed_and_verified(results: dict) -> None:
    metrics = results["clover"]["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0, metrics
    assert metrics["vllm:spec_decode_num_draft_tokens"] >= metrics["vllm:spec_decode_num_drafts"]
    assert not results["ref"]["metrics"].get("vllm:spec_decode_num_drafts")


def test_sampling_with_draft_probabilities_runs(results: dict) -> None:
    assert results["clover"]["sampled"] == results["ref"]["sampled"] or \
        all(0 < n <= 24 for n in results["clover"]["sampled"])
