"""The adaptive tree (the `vllm-clover serve` default) is lossless in float32 greedy decoding,
with the shape it chooses and with shapes forced to change at every step (heads trees of
different sizes, lookup tokens, lookup only, chains, no drafts), at batch 1 and with a batch
of mixed prompts; and its start-up calibration is cached and reused."""

from __future__ import annotations

import pytest

from tests.conftest import E2E_DTYPE, shutdown_llm

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
COMMON = dict(dtype=E2E_DTYPE, enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=1 << 30,
              disable_log_stats=False, seed=0)
# (heads nodes, lookup tokens) cycled per step: off, a large tree with lookup, a chain, lookup
# only, one node, a mid-size tree.
FORCED = [(0, 0), (12, 6), (3, 0), (0, 5), (1, 0), (6, 2), (16, 16), (2, 1)]


def _prompts(tokenizer) -> list[str]:
    from vllm_clover.training.data import load_mtbench

    from tests.e2e.test_clover import PROMPTS

    chats = [[{"role": "user", "content": q["turns"][0]}] for q in load_mtbench()[:6]]
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return rendered + list(PROMPTS[:4])


def _spec(ckpt) -> dict:
    from vllm_clover.model.draft_vocab import DRAFT_VOCAB_FILE
    from vllm_clover.serve_defaults import ADAPTIVE_OPTIONS

    options = dict(ADAPTIVE_OPTIONS)
    if not (ckpt / DRAFT_VOCAB_FILE).is_file():
        options.pop("draft_vocab_size")
    if not (ckpt / options["datastore"]).is_file():
        options.pop("datastore")
    return {"method": "clover", "model": str(ckpt), **options}


def _generate(llm, prompts: list[str], batch: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = []
    for i in range(0, len(prompts), batch):
        out += [list(o.outputs[0].token_ids) for o in llm.generate(prompts[i:i + batch], params, use_tqdm=False)]
    return out


@pytest.fixture(scope="module")
def reference(default_model_dir):
    from vllm import LLM

    llm = LLM(model=str(default_model_dir), max_num_seqs=16, **COMMON)
    try:
        prompts = _prompts(llm.get_tokenizer())
        yield prompts, _generate(llm, prompts, len(prompts))
    finally:
        shutdown_llm(llm)


def test_adaptive_default_is_lossless_with_forced_shape_changes(default_model_dir, clover_ckpt_dir, reference,
                                                                tmp_path, monkeypatch):
    """Chosen shapes, then shapes forced to change every step: identical tokens to plain vLLM;
    a second engine reuses the cached calibration."""
    from vllm import LLM

    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))
    prompts, expected = reference
    extension = {"worker_extension_cls": "vllm_clover.engine.runner_hooks.CloverWorkerExtension"}
    llm = LLM(model=str(default_model_dir), max_num_seqs=16, speculative_config=_spec(clover_ckpt_dir),
              **COMMON, **extension)
    try:
        state = llm.collective_rpc("clover_adaptive_state")[0]
        assert state["curve"]["measure_s"] < 30, state["curve"]["measure_s"]  # ~6 s budget + the drafter
        assert len(state["curve"]["target_ms"]) == len(state["curve"]["tokens"]) > 5
        for batch in (1, len(prompts)):
            assert _generate(llm, prompts, batch) == expected, f"chosen shapes, batch {batch}"
        assert llm.collective_rpc("clover_adaptive_state")[0]["steps"] > 0
        assert llm.collective_rpc("clover_adaptive_force", args=(FORCED,)) == [len(FORCED)]
        for batch in (1, 3, len(prompts)):
            assert _generate(llm, prompts, batch) == expected, f"forced shapes, batch {batch}"
    finally:
        shutdown_llm(llm)
    cached = list((tmp_path / "calibration").glob("*.json"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    llm = LLM(model=str(default_model_dir), max_num_seqs=16, speculative_config=_spec(clover_ckpt_dir),
              **COMMON, **extension)
    try:
        assert llm.collective_rpc("clover_adaptive_state")[0]["curve"] == state["curve"]
        assert _generate(llm, prompts[:2], 2) == expected[:2]
    finally:
        shutdown_llm(llm)
    assert cached[0].stat().st_mtime_ns == stamp  # reused, not measured again


def test_adaptive_chain_is_lossless_and_drafts_chains(default_model_dir, clover_ckpt_dir, reference, tmp_path,
                                                      monkeypatch):
    """The GPU serve default (serve_defaults.ADAPTIVE_CHAIN_OPTIONS) on the CPU: chosen chain
    lengths, then lengths forced to change every step (off, 1..5, lookup-only shapes as no
    drafts), token-identical to plain vLLM, with drafts accepted by vLLM's own sampler."""
    from vllm import LLM

    from vllm_clover.benchmarks.bench import _spec_counters
    from vllm_clover.model.draft_vocab import DRAFT_VOCAB_FILE
    from vllm_clover.serve_defaults import ADAPTIVE_CHAIN_OPTIONS

    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))
    prompts, expected = reference
    options = {k: v for k, v in ADAPTIVE_CHAIN_OPTIONS.items() if k != "draft_vocab_size"
               or (clover_ckpt_dir / DRAFT_VOCAB_FILE).is_file()}
    extension = {"worker_extension_cls": "vllm_clover.engine.runner_hooks.CloverWorkerExtension"}
    llm = LLM(model=str(default_model_dir), max_num_seqs=16,
              speculative_config={"method": "clover", "model": str(clover_ckpt_dir), **options},
              **COMMON, **extension)
    try:
        assert _generate(llm, prompts, 1) == expected, "chosen chains, batch 1"
        state = llm.collective_rpc("clover_adaptive_state")[0]
        assert all(k == 0 for _, _, k, _ in state["chosen"])  # never a lookup token
        assert llm.collective_rpc("clover_adaptive_force", args=(FORCED,)) == [len(FORCED)]
        for batch in (1, len(prompts)):
            assert _generate(llm, prompts, batch) == expected, f"forced chains, batch {batch}"
        assert _spec_counters(llm)["accepted"] > 0
    finally:
        shutdown_llm(llm)
