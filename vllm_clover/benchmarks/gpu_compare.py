"""Stage 2 of the GPU check (gpu_check.sh): plain vLLM against Clover chain, the adaptive chain
(the GPU serve default, serve_defaults.ADAPTIVE_CHAIN_OPTIONS) and Clover tree on one CUDA GPU,
with the default model and the shipped heads.

* float32, greedy: Clover chain and the adaptive chain must be token-identical to plain vLLM
  (the losslessness claim). A tree in float32 is refused on a GPU (FlashAttention has no float32 kernels;
  ``frontend.refuse_unsupported``), so the tree is not part of this comparison.
* bfloat16: output tokens per second of each method at batch 1 (one prompt at a time, as the
  README's results), the mean accepted length (1 + accepted / drafts, vLLM's counters), and for
  Clover how many outputs equal plain vLLM's (bf16 kernels may differ in the last bit between
  batch shapes, so this is reported, not required).

Prints one JSON object and writes it to ``--out`` when given. Exits 1 when the float32
identity fails. Needs a CUDA build of vLLM 0.32 and the vllm-clover package importable.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours:",
    "Q: What is 12 times 7?\nA:",
    "Write a haiku about the sea.",
    "Translate to French: I like apples.",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Explain in two sentences why the sky is blue.",
]
TREE = "small_4"


def _engine(model: str, dtype: str, spec: dict[str, Any] | None, eager: bool) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(model=model, dtype=dtype, enforce_eager=eager, max_model_len=1024,
                                  gpu_memory_utilization=0.3, disable_log_stats=False, seed=0)
    if spec is not None:
        kwargs["speculative_config"] = spec
    return LLM(**kwargs)


def _counters(llm: Any) -> dict[str, float]:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            out[m.name] = float(m.value)
    return out


def _run(model: str, dtype: str, spec: dict[str, Any] | None, max_tokens: int, eager: bool) -> dict[str, Any]:
    """Generate every prompt greedily, one at a time (after one warm-up request); outputs,
    output tokens per second and mean accepted length."""
    import torch
    from vllm import SamplingParams

    llm = _engine(model, dtype, spec, eager)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        llm.generate([PROMPTS[0]], params, use_tqdm=False)  # warm-up
        before = _counters(llm)
        outputs, tokens, seconds = [], 0, 0.0
        for prompt in PROMPTS:
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - t0
            outputs.append(list(out.token_ids))
            tokens += len(out.token_ids)
        after = _counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    drafts = after.get("vllm:spec_decode_num_drafts", 0.0) - before.get("vllm:spec_decode_num_drafts", 0.0)
    accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0.0)
                - before.get("vllm:spec_decode_num_accepted_tokens", 0.0))
    return {"outputs": outputs, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "accepted_length": 1 + accepted / drafts if drafts else None, "drafts": drafts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="write the JSON report here too")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eager", action="store_true",
                        help="bfloat16 runs in eager mode too (default: vLLM's compiled mode, "
                             "piecewise CUDA graphs, as vllm serve runs)")
    args = parser.parse_args(argv)

    import torch
    import vllm

    from vllm_clover.default_model import ensure_default_model
    from vllm_clover.serve_defaults import ADAPTIVE_CHAIN_OPTIONS
    from vllm_clover.training.train import shipped_heads_dir

    model, heads = str(ensure_default_model()), str(shipped_heads_dir())
    chain = {"method": "clover", "model": heads, "num_speculative_tokens": 2}
    tree = {"method": "clover", "model": heads, "tree": TREE}
    adaptive = {"method": "clover", "model": heads, **ADAPTIVE_CHAIN_OPTIONS}
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "vllm": vllm.__version__,
                              "prompts": len(PROMPTS), "max_tokens": args.max_tokens}
    plain32 = _run(model, "float32", None, args.max_tokens, eager=True)
    chain32 = _run(model, "float32", chain, args.max_tokens, eager=True)
    report["float32_chain_identical"] = chain32["outputs"] == plain32["outputs"]
    adaptive32 = _run(model, "float32", adaptive, args.max_tokens, eager=True)
    report["float32_adaptive_chain_identical"] = adaptive32["outputs"] == plain32["outputs"]
    report["float32_tree"] = "refused on GPU (FlashAttention has no float32 kernels)"
    bf16 = {}
    for name, spec in (("plain", None), ("chain", chain), ("adaptive_chain", adaptive), ("tree", tree)):
        bf16[name] = _run(model, "bfloat16", spec, args.max_tokens, eager=args.eager)
    report["bfloat16"] = {
        name: {"tokens_per_s": round(r["tokens_per_s"], 1), "accepted_length": r["accepted_length"],
               "outputs_equal_plain": sum(a == b for a, b in zip(r["outputs"], bf16["plain"]["outputs"]))}
        for name, r in bf16.items()}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["float32_chain_identical"] and report["float32_adaptive_chain_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
