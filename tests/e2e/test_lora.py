"""LoRA with Clover: ``enable_lora`` with the shipped test adapter (tests/data/lora/, PEFT format,
made by tests/data/lora/make_adapter.py) on the default target, requests with and without the
adapter mixed in one batch.

* The adapter is real and changes the output: plain vLLM with it differs from plain vLLM
  without it on most prompts, and a request without the adapter batched next to one with it
  gets exactly what it gets alone (vLLM's CPU LoRA ops applied the adapter to it before patch
  ``cpu-lora-no-adapter-rows``).
* Lossless: Clover with this CPU's fixed served preset (a static tree + prompt lookup +
  datastore, no batch-size cut-off) and with a chain of 3 give plain vLLM's tokens (float32
  greedy) for each batch, the mixed one included.
* Acceptance: Clover's heads were trained on the base model's states; the mean acceptance
  length with and without the adapter is printed (docs/structured-output-and-lora.md).
* ``vllm-clover serve --enable-lora --lora-modules``: the adapter by name over HTTP, next to
  the base model, gives plain vLLM's text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.conftest import E2E_LLM_KWARGS, REPO, shutdown_llm, venv_bin
from tests.e2e.server import free_port, running_server
from tests.e2e.test_structured_output import clover_spec

pytestmark = pytest.mark.slow

# Short requests, a handful at a time: a small KV cache keeps each engine's memory low.
LLM_KWARGS = {**E2E_LLM_KWARGS, "kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024}
# The server imports this checkout (as the in-process engines do), not an older installed copy.
SERVE_ENV = {"PYTHONPATH": str(REPO)}
SERVE_FLAGS = ["--enforce-eager", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)]

ADAPTER = Path(__file__).resolve().parents[1] / "data/lora/smollm2-random-r4"
LORA_KWARGS = dict(enable_lora=True, max_lora_rank=8, max_loras=1)  # max_loras=1: vLLM's default
MAX_TOKENS = 48
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
           "List three colours:", "Q: What is 12 times 7?\nA:", "Explain what a CPU cache is."]


def _lora():
    from vllm.lora.request import LoRARequest

    return LoRARequest("smollm2-random-r4", 1, str(ADAPTER))


def _counts(llm) -> tuple[float, float]:
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
    return m.get("vllm:spec_decode_num_drafts", 0), m.get("vllm:spec_decode_num_accepted_tokens", 0)


def _run(model: str, spec: dict | None) -> dict:
    """Three batches: all without the adapter, all with it, and the two mixed (alternating);
    greedy token ids per request, and for Clover the mean acceptance length of the first two."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=spec, disable_log_stats=False, max_num_seqs=16,
              **LLM_KWARGS, **LORA_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    lora = _lora()
    try:
        out: dict = {}
        for name, requests_lora in (("base", [None] * len(PROMPTS)), ("adapter", [lora] * len(PROMPTS)),
                                    ("mixed", [lora if i % 2 == 0 else None for i in range(len(PROMPTS))])):
            drafts0, accepted0 = _counts(llm)
            outs = llm.generate(PROMPTS, params, lora_request=requests_lora, use_tqdm=False)
            out[name] = [list(o.outputs[0].token_ids) for o in outs]
            drafts, accepted = _counts(llm)
            if spec and drafts > drafts0:
                out[f"{name}_acceptance_length"] = 1 + (accepted - accepted0) / (drafts - drafts0)
        return out
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def runs(default_model_dir: Path, clover_ckpt_dir: Path) -> dict:
    model = str(default_model_dir)
    return {"plain": _run(model, None), "tree": _run(model, clover_spec(clover_ckpt_dir, "served")),
            "chain": _run(model, clover_spec(clover_ckpt_dir, "chain"))}


def test_adapter_files_are_small_peft_lora() -> None:
    import json

    config = json.loads((ADAPTER / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert (ADAPTER / "adapter_model.safetensors").stat().st_size < 2 << 20


def test_adapter_changes_the_output(runs: dict) -> None:
    plain = runs["plain"]
    changed = sum(a != b for a, b in zip(plain["adapter"], plain["base"]))
    assert changed >= len(PROMPTS) - 1, (changed, plain)


def test_mixed_batch_rows_get_their_own_adapter(runs: dict) -> None:
    """In plain vLLM, each request of the mixed batch gets what it gets in a batch of its own
    kind: the adapter's rows the adapter, the others none (the CPU LoRA fix)."""
    plain = runs["plain"]
    expected = [plain["adapter"][i] if i % 2 == 0 else plain["base"][i] for i in range(len(PROMPTS))]
    assert plain["mixed"] == expected


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_clover_lossless_with_adapter(runs: dict, mode: str) -> None:
    for batch in ("base", "adapter", "mixed"):
        assert runs[mode][batch] == runs["plain"][batch], batch


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_acceptance_with_and_without_adapter(runs: dict, mode: str, capsys) -> None:
    """Printed for docs/structured-output-and-lora.md: the served tree preset (heads + prompt
    lookup + datastore) and the heads alone (a chain of 3)."""
    base, adapter = runs[mode]["base_acceptance_length"], runs[mode]["adapter_acceptance_length"]
    with capsys.disabled():
        print(f"\n[lora acceptance] {mode}: mean acceptance length {base:.2f} without the adapter, "
              f"{adapter:.2f} with it ({len(PROMPTS)} prompts x {MAX_TOKENS} tokens, greedy)")
    assert base > 1.0 and adapter > 1.0


def test_serve_enable_lora_over_http(runs: dict, tmp_path: Path) -> None:
    """``vllm-clover serve --enable-lora --lora-modules NAME=DIR`` keeps Clover on; the adapter's
    name and the base model answer side by side with plain vLLM's text."""
    from transformers import AutoTokenizer

    from vllm_clover.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(verbose=False))
    port = free_port()
    cmd = [venv_bin("vllm-clover"), "serve", "--port", str(port), *SERVE_FLAGS, "--enable-lora", "--max-lora-rank", "8",
           "--lora-modules", f"smollm2-random-r4={ADAPTER}"]
    with running_server(cmd, port, tmp_path / "serve.log", env=SERVE_ENV) as server:
        got = {}
        for model in ("smollm2-random-r4", "SmolLM2-135M-Instruct"):
            r = requests.post(server.url + "/v1/completions", timeout=300, json={
                "model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200, r.text
            got[model] = r.json()["choices"][0]["text"]
        log = server.log_tail(400_000)
    assert '"method": "clover"' in log
    assert got["smollm2-random-r4"] == tokenizer.decode(runs["plain"]["adapter"][1])
    assert got["SmolLM2-135M-Instruct"] == tokenizer.decode(runs["plain"]["base"][1])
    assert server.shutdown == {"returncode": 0, "leftover_children": []}
