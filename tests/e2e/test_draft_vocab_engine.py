"""Clover in vLLM with a reduced draft vocabulary (``draft_vocab_size``): greedy output is still
the target's, drafts come only from the subset, sampling still runs."""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm_clover.model.draft_vocab import save_draft_vocab


@pytest.mark.slow
def test_clover_with_draft_vocab_in_vllm(default_model_dir, sensitive_ckpt_dir, tmp_path) -> None:
    """Greedy output equals HF float32 greedy, every recorded draft lies in the subset, drafts
    are accepted (the subset holds the fitted prompt's tokens), and T>0 sampling runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from tests.conftest import E2E_LLM_KWARGS, FIT_PROMPT, shutdown_llm

    ckpt = tmp_path / "ckpt"
    shutil.copytree(sensitive_ckpt_dir, ckpt)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    prompts = [FIT_PROMPT, "The capital of France is", "def fibonacci(n):"]
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        want.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                do_sample=False)[0, ids.shape[1]:].tolist())
    # Subset: the tokens of the greedy continuations first (so drafts can be accepted), then ids.
    wanted = list(dict.fromkeys(t for w in want for t in w))
    ranking = torch.tensor(wanted + [i for i in range(hf.config.vocab_size) if i not in set(wanted)][:2048])
    save_draft_vocab(ckpt, ranking, "test")
    subset = set(ranking[:256].tolist())

    llm = LLM(model=str(default_model_dir), disable_log_stats=False,
              worker_extension_cls="vllm_clover.engine.runner_hooks.CloverWorkerExtension",
              speculative_config={"method": "clover", "model": str(ckpt), "num_speculative_tokens": 3,
                                  "draft_vocab_size": 256}, **E2E_LLM_KWARGS)
    try:
        llm.collective_rpc("clover_record_drafts")
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        drafts = [d for rec in llm.collective_rpc("clover_take_drafts") for _, _, d in rec]
        accepted = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}.get("vllm:spec_decode_num_accepted_tokens", 0)
        sampled = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=1),
                               use_tqdm=False)
        timing = llm.collective_rpc("clover_timing")[0]  # what vllm_clover/benchmarks/bench.py reads
    finally:
        shutdown_llm(llm)
    for out, w in zip(outs, want):
        got = list(out.outputs[0].token_ids)
        assert got == w[:len(got)] and len(got) >= min(len(w), 8), (got, w)
    assert drafts and all(t in subset for d in drafts for t in d)
    assert accepted > 0
    assert all(len(o.outputs[0].token_ids) > 0 for o in sampled)
    assert timing["calls"] >= len(drafts) / len(prompts) and timing["draft_s"] > 0, timing
