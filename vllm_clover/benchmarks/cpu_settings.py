"""Side-by-side decode throughput of plain vLLM on CPU under the settings we choose defaults for.

Settings: dtype (float32 / bfloat16) x Intel OpenMP preload (on / off), and
``float32+iomp+reserve1``: vLLM's own core reservation (one core kept for the EngineCore,
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``) instead of ours (none on machines with at most 2 CPUs;
``vllm_clover/cpu/env.py``). ``--spec JSON`` runs every setting with that speculative
config (e.g. Clover's serve default) instead of plain vLLM. Each setting runs in
its own subprocess (LD_PRELOAD must be set at process start), rounds alternate settings to
spread machine noise, and every run uses the same prompts: the first turns of the first
8 MT-Bench questions through the chat template, greedy, ``--max-tokens`` new tokens with
``ignore_eos``, eager mode, 1 GiB KV cache. Throughput = generated tokens / wall time of
``generate`` (prefill included), after one warm-up request.

Run:  python -m vllm_clover.benchmarks.cpu_settings [--rounds 2] [--max-tokens 128] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from vllm_clover.cpu.env import RESERVED_CPU_ENV

# name -> (dtype, VLLM_CLOVER_PRELOAD_IOMP, VLLM_CPU_NUM_OF_RESERVED_CPU or None for ours)
SETTINGS = {
    "float32+iomp": ("float32", "1", None),
    "float32-no-iomp": ("float32", "0", None),
    "bfloat16+iomp": ("bfloat16", "1", None),
    "bfloat16-no-iomp": ("bfloat16", "0", None),
    "float32+iomp+reserve1": ("float32", "1", "1"),
}


def measure(dtype: str, max_tokens: int, spec: dict | None = None) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    from vllm_clover.training.data import load_mtbench
    from vllm_clover.default_model import ensure_default_model

    llm = LLM(model=str(ensure_default_model(verbose=False)), dtype=dtype, enforce_eager=True,
              kv_cache_memory_bytes=1 << 30, max_model_len=2048, speculative_config=spec)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                       tokenize=False, add_generation_prompt=True)
               for q in load_mtbench()[:8]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    result = {}
    for batch in (1, 8):
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        result[f"batch{batch}_tok_s"] = n / (time.perf_counter() - t0)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--spec", default="", help="speculative_config JSON for every setting")
    ap.add_argument("--output")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.spec) if args.spec else None
        print("RESULT " + json.dumps(measure(args.one, args.max_tokens, spec)), flush=True)
        return
    runs: dict[str, list[dict]] = {name: [] for name in args.settings.split(",")}
    for r in range(args.rounds):
        for name in runs:
            dtype, iomp, reserved = SETTINGS[name]
            env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", RESERVED_CPU_ENV)}
            env["VLLM_CLOVER_PRELOAD_IOMP"] = iomp  # the plugin sets LD_PRELOAD for workers
            if reserved is not None:  # else the plugin's own rule (cpu_env.with_worker_cores)
                env[RESERVED_CPU_ENV] = reserved
            proc = subprocess.run([sys.executable, "-m", "vllm_clover.benchmarks.cpu_settings", "--one", dtype,
                                   "--max-tokens", str(args.max_tokens), "--spec", args.spec],
                                  capture_output=True, text=True, env=env)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                print(f"round {r} {name}: FAILED rc={proc.returncode}\n{proc.stderr[-1500:]}")
                continue
            res = json.loads(line[0][7:])
            runs[name].append(res)
            print(f"round {r} {name:18s} " + "  ".join(f"{k}={v:.1f}" for k, v in res.items()),
                  flush=True)
    summary = {name: {k: sum(x[k] for x in rs) / len(rs) for k in rs[0]} for name, rs in runs.items() if rs}
    base = summary.get("float32+iomp")
    print("\nmean over rounds (ratio to float32+iomp):")
    for name, res in summary.items():
        print(f"  {name:18s} " + "  ".join(
            f"{k}={v:.1f}" + (f" ({v / base[k]:.2f}x)" if base else "") for k, v in res.items()))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"conditions": {"machine": platform.processor() or platform.machine(),
                                      "cpus": os.cpu_count(), "max_tokens": args.max_tokens,
                                      "prompts": "MT-Bench first turns 1-8", "rounds": args.rounds,
                                      "speculative_config": args.spec or None},
                       "runs": runs, "mean": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
