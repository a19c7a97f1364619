"""The CPU tree-attention kernel (``vllm_clover/kernels/tree_attention_cpu.py``) at the default model's
attention shapes, optionally side by side with a second build from another source file.

    python -m vllm_clover.benchmarks.bench_tree_cpu --rows 3,8,14 --positions 100,400,800
    git show HEAD:vllm_clover/kernels/csrc/tree_attention_cpu.cpp > /tmp/base.cpp
    python -m vllm_clover.benchmarks.bench_tree_cpu --baseline-source /tmp/base.cpp

One tree request per call, as at batch 1: ``rows`` tree rows (a chain: each row sees the ones
before it) after ``positions`` cached tokens, 9 query / 3 KV heads of 64, float32 cache in
vLLM's ``vec`` layout, blocks of 128 in shuffled order. Per shape: median microseconds of one
call (what one layer's tree rows cost), the builds timed in alternation, baseline / current,
and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128


def tree_inputs(rows: int, positions: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random query [rows, Hq, D], a vec-layout cache [NB, Hkv, BS, 2D] holding
    ``positions + rows`` tokens, meta [1, 4], block table [1, NB], chain ancestor mask."""
    g = torch.Generator().manual_seed(seed)
    nb = (positions + rows + BLOCK - 1) // BLOCK
    kv = torch.randn(nb + 2, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g)
    table = torch.randperm(nb + 2, generator=g)[:nb].to(torch.int32)[None].contiguous()
    anc = torch.tril(torch.ones(rows, rows, dtype=torch.uint8))[None].contiguous()
    return {"query": torch.randn(rows, HEADS, HEAD_DIM, generator=g), "kv_cache": kv,
            "meta": torch.tensor([[0, rows, positions, 0]]), "block_table": table, "anc": anc}


def call(module: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = torch.zeros_like(inputs["query"])
    module.tree_attention_cpu(inputs["query"], inputs["kv_cache"], out, inputs["meta"], inputs["block_table"],
                              inputs["anc"], HEAD_DIM ** -0.5, 0, False)
    return out


def median_us(module: Any, inputs: dict[str, torch.Tensor], iters: int) -> float:
    call(module, inputs)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call(module, inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="3,8,14")
    ap.add_argument("--positions", default="100,400,800")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the builds")
    ap.add_argument("--baseline-source", type=Path, help="a second tree_attention_cpu.cpp to time against")
    args = ap.parse_args(argv)

    from vllm_clover.kernels import tree_attention_cpu

    current = tree_attention_cpu.load()
    builds = {"current": current}
    if args.baseline_source:
        builds = {"baseline": tree_attention_cpu.build_extension(
            "vllm_clover_tree_attention_cpu_baseline", args.baseline_source,
            ["-O3", "-ffast-math", "-fopenmp", *tree_attention_cpu._isa_flags()], tree_attention_cpu.ENV_VAR),
            **builds}
    print(f"threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'rows':>5} {'positions':>9} " + " ".join(f"{name + ' us':>12}" for name in builds)
          + (f" {'ratio':>6} {'max diff':>9}" if len(builds) > 1 else ""))
    for n1 in [int(r) for r in args.rows.split(",")]:
        for positions in [int(p) for p in args.positions.split(",")]:
            inputs = tree_inputs(n1, positions)
            times: dict[str, list[float]] = {name: [] for name in builds}
            for _ in range(args.rounds):
                for name, module in builds.items():
                    times[name].append(median_us(module, inputs, args.iters))
            med = {name: statistics.median(t) for name, t in times.items()}
            line = f"{n1:5d} {positions:9d} " + " ".join(f"{med[name]:12.1f}" for name in builds)
            if len(builds) > 1:
                diff = (call(builds["baseline"], inputs) - call(current, inputs)).abs().max().item()
                line += f" {med['baseline'] / med['current']:6.2f} {diff:9.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
