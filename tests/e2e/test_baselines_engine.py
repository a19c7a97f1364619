"""vLLM's own medusa / eagle methods serve baselines trained by ``vllm-clover train --method``."""

from __future__ import annotations

import pytest
import torch

from vllm_clover.training import train as T

from tests.unit.training.test_baselines import METHODS, sharpen
from tests.unit.training.test_train import _args

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_vllm_serves_trained_baselines(default_model_dir, convs_file, tmp_path) -> None:
    """vLLM's built-in medusa / eagle methods run checkpoints trained by ``train --method`` end
    to end: greedy output equals the target's own (HF) greedy output and drafts were made.
    The target is a sharpened tiny Llama with head size 64 (vLLM's CPU attention refuses 8)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    from tests.conftest import make_tiny_llama, shutdown_llm

    sharp_target = sharpen(make_tiny_llama(tmp_path / "hd64", default_model_dir, hidden_size=128,
                                           intermediate_size=128, num_attention_heads=2, num_key_value_heads=1),
                           tmp_path / "hd64_sharp", scale=10.0)
    runs = {m: tmp_path / m for m in METHODS}
    for method in METHODS:
        T.train(_args(sharp_target, convs_file, runs[method], method=method, num_layers=1, steps=10,
                      warmup_steps=1, lr=3e-3), progress=False)
    tok = AutoTokenizer.from_pretrained(str(sharp_target))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from alpha."}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(sharp_target), dtype=torch.float32)
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                       pad_token_id=2)[0, ids.shape[1]:].tolist()
    for method in METHODS:
        llm = LLM(model=str(sharp_target), dtype="float32", enforce_eager=True, max_model_len=256,
                  kv_cache_memory_bytes=1 << 28, max_num_seqs=4, disable_log_stats=False,
                  speculative_config={"method": method, "model": str(runs[method]), "num_speculative_tokens": 3})
        try:
            out = llm.generate([{"prompt_token_ids": ids[0].tolist()}],
                               SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            counters = {m.name: m.value for m in llm.get_metrics()
                        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
        finally:
            shutdown_llm(llm)
        got = list(out[0].outputs[0].token_ids)
        n = min(len(got), len(want))  # HF stops at the eos id, vLLM ignores it
        assert len(got) == 24 and n >= 8 and got[:n] == want[:n], (method, got, want)
        assert counters.get("vllm:spec_decode_num_drafts", 0) > 0, (method, counters)
