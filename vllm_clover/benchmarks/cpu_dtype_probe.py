"""Probe which (dtype, head size, block size) combinations vLLM's CPU attention survives.

Background: on AMX machines, bf16 selects the ``amx`` attention ISA
(``v1/attention/backends/cpu_attn.py:_get_attn_isa``), which can kill the worker with SIGILL
on 1-4 token prompts with head size 32 (docs/cpu-defaults.md "bf16: when is it usable?"). Each case runs in its own
subprocess (a crash must not end the probe) and sends every prompt length 1..12 as a
separate request, greedy, 8 new tokens. Models with random weights
(``load_format="dummy"``) share the default model's tokenizer.

Run:  python -m vllm_clover.benchmarks.cpu_dtype_probe  [--cases default-bf16,tiny32-bf16,...]
Prints one line per case: exit status and which prompt lengths completed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    # name: (model kind, dtype, head_dim, block_size or None)
    "default-bf16": ("default", "bfloat16", 64, None),
    "default-fp32": ("default", "float32", 64, None),
    "tiny32-bf16": ("tiny", "bfloat16", 32, None),
    "tiny32-bf16-block16": ("tiny", "bfloat16", 32, 16),
    "tiny64-bf16": ("tiny", "bfloat16", 64, None),
    "tiny128-bf16": ("tiny", "bfloat16", 128, None),
    "tiny32-fp32": ("tiny", "float32", 32, None),
    # The configuration first seen crashing: hidden 64 = 2 heads x 32, vocab 512.
    "probe32x2-bf16": ("probe", "bfloat16", 32, None),
    "probe32x2-bf16-block16": ("probe", "bfloat16", 32, 16),
    "probe32x2-fp32": ("probe", "float32", 32, None),
}


def make_tiny_llama(out: Path, head_dim: int, tokenizer_dir: Path, heads: int = 4,
                    kv_heads: int = 2, vocab: int | None = None) -> Path:
    """A 2-layer Llama config (weights are dummy); default tokenizer's vocabulary."""
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    cfg.update(hidden_size=heads * head_dim, head_dim=head_dim, num_attention_heads=heads,
               num_key_value_heads=kv_heads, num_hidden_layers=2, intermediate_size=256)
    if vocab:
        cfg.update(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def run_case(name: str) -> None:
    """Body of one subprocess: start vLLM and feed prompts of each length."""
    from vllm import LLM, SamplingParams

    from vllm_clover.default_model import ensure_default_model

    kind, dtype, head_dim, block = CASES[name]
    tok_dir = ensure_default_model(verbose=False)
    kwargs = dict(dtype=dtype, enforce_eager=True, kv_cache_memory_bytes=1 << 30,
                  max_model_len=512, tokenizer=str(tok_dir))
    if block:
        kwargs["block_size"] = block
    if kind == "tiny":
        model = make_tiny_llama(Path(tempfile.mkdtemp()) / f"tiny{head_dim}", head_dim, tok_dir)
        kwargs["load_format"] = "dummy"
    elif kind == "probe":
        model = make_tiny_llama(Path(tempfile.mkdtemp()) / "probe", head_dim, tok_dir,
                                heads=2, kv_heads=2, vocab=512)
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
        kwargs.pop("tokenizer")
    else:
        model = tok_dir
    llm = LLM(model=str(model), **kwargs)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for n in range(1, 13):
        prompt = {"prompt_token_ids": list(range(100, 100 + n))}
        llm.generate([prompt], params, use_tqdm=False)
        print(f"PROBE_OK {n}", flush=True)
    # All short prompts in one batch too (mixed query lengths in one kernel call).
    llm.generate([{"prompt_token_ids": list(range(100, 100 + n))} for n in range(1, 13)],
                 params, use_tqdm=False)
    print("PROBE_OK 0", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run_case(args.one)
        return
    for name in args.cases.split(","):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "vllm_clover.benchmarks.cpu_dtype_probe", "--one", name],
                              capture_output=True, text=True, env=os.environ.copy())
        ok = [int(l.split()[1]) for l in proc.stdout.splitlines() if l.startswith("PROBE_OK")]
        died = "SIGILL" if "SIGILL" in proc.stderr or proc.returncode == -4 else ""
        errors = [l.strip() for l in proc.stderr.splitlines() if "Error" in l or "SIGILL" in l]
        tail = "" if proc.returncode == 0 else errors[-1:]
        print(f"{name:22s} rc={proc.returncode:4d} {died:6s} ok_lengths={ok} "
              f"({time.time() - t0:.0f}s) {tail}", flush=True)


if __name__ == "__main__":
    main()
