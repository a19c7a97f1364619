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


@pytest.mark.slow
def test_vllm_serves_a_trained_eagle3(default_model_dir, convs_file, tmp_path) -> None:
    """vLLM's built-in eagle3 method runs a checkpoint trained by ``train --method eagle3``
    (aux-layer ids, 1,024-token draft vocabulary with d2t): float32 greedy output equals
    plain vLLM's token for token, and drafts are accepted. The sharpened target's argmax is
    mostly the current token, so after the assistant header it repeats the newline; the
    training answers hold newlines (one word per line), so the drafter learns that too."""
    from vllm import LLM, SamplingParams
    from transformers import AutoTokenizer

    from tests.conftest import make_tiny_llama, shutdown_llm
    from tests.unit.training.test_eagle3 import eagle3_args
    from vllm_clover.training.data import Conversation, load_conversations, save_conversations
    from vllm_clover.training.eagle3 import train_eagle3

    target = sharpen(make_tiny_llama(tmp_path / "hd64", default_model_dir, hidden_size=128, intermediate_size=128,
                                     num_attention_heads=2, num_key_value_heads=1), tmp_path / "hd64_sharp", scale=10.0)
    tok = AutoTokenizer.from_pretrained(str(target))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from alpha."}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    lines = [Conversation(id=f"lines-{i}", messages=[
        {"role": "user", "content": f"List from {words[i]}."},
        {"role": "assistant", "content": "\n".join(words[(i + j) % len(words)] for j in range(30))}]) for i in range(4)]
    data = tmp_path / "train.jsonl"
    save_conversations(lines + load_conversations(convs_file), data)
    run = tmp_path / "eagle3"
    train_eagle3(eagle3_args(target, data, run, num_conversations=12, draft_vocab=1024, steps=40), progress=False)

    outputs, counters = {}, {}
    for name, spec in (("plain", None), ("eagle3", {"method": "eagle3", "model": str(run), "num_speculative_tokens": 3})):
        llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=256,
                  kv_cache_memory_bytes=1 << 28, max_num_seqs=4, disable_log_stats=False, speculative_config=spec)
        try:
            out = llm.generate([{"prompt_token_ids": ids[0].tolist()}],
                               SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
            counters[name] = {m.name: m.value for m in llm.get_metrics()
                              if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
        finally:
            shutdown_llm(llm)
        outputs[name] = list(out[0].outputs[0].token_ids)
    assert len(outputs["plain"]) == 32 and outputs["eagle3"] == outputs["plain"], outputs
    assert counters["eagle3"].get("vllm:spec_decode_num_drafts", 0) > 0, counters
    assert counters["eagle3"].get("vllm:spec_decode_num_accepted_tokens", 0) > 0, counters
