"""float32 linear layers of a Llama-shaped model at decode / verify row counts: vLLM's oneDNN
path (``ops.onednn_mm``, what vLLM's CPU build runs for float32 weights) against
``vllm_clover.kernels.linear_cpu``, side by side in one run.

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so python -m vllm_clover.benchmarks.bench_linear_cpu --rows 1,4,10,16,20,32

Shapes: the default model's (SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536,
30 layers, 49,152-token LM head) with random weights, each layer its own tensors, so the
weights stream from memory as in a decode step. Per row count: median milliseconds of one pass
over all layers (+ the LM head), each path timed in alternation, and oneDNN / kernel.
``--shapes drafter``: instead the products of one Clover-2 drafting step at batch 1 with the
shipped heads (2 Augmenting layers, the trunk's and a head's Attention Decoder, head0_proj,
head_proj, two 4,096-row draft LM heads); ``--bf16-weights`` adds the kernel over weights
packed in bfloat16 (``draft_dtype`` bfloat16) as a third column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch


def llama_linear_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears: fused qkv, o, fused gate_up, down."""
    return [(hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * mlp), (mlp, hidden)]


def drafter_linear_shapes(hidden: int = 576, draft_vocab: int = 4096) -> list[tuple[int, int]]:
    """(in, out) of one Clover-2 drafting step at batch 1 with a chain of 2 heads: the trunk's
    Attention Decoder (q, k, v), 2 Augmenting layers, head 0 (head0_proj + LM head), head 1
    (Attention Decoder, head_proj over [s, e], LM head)."""
    attn_decoder = [(hidden, hidden)] * 3
    head0 = [(hidden, hidden), (hidden, draft_vocab)]
    head1 = attn_decoder + [(2 * hidden, hidden), (hidden, draft_vocab)]
    return attn_decoder + llama_linear_shapes(hidden, 9, 3, 64, 1536) * 2 + head0 + head1


def median_ms(fn: Callable[[], None], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,10,12,16,20,24,32,48", help="comma-separated row counts")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152, help="LM head rows (0: no LM head)")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the paths")
    ap.add_argument("--shapes", choices=("target", "drafter"), default="target")
    ap.add_argument("--bf16-weights", action="store_true", help="also the kernel over bfloat16 weights")
    args = ap.parse_args(argv)

    from vllm import _custom_ops as ops

    from vllm_clover.kernels import linear_cpu

    torch.manual_seed(0)
    if args.shapes == "drafter":
        shapes = drafter_linear_shapes()
    else:
        shapes = llama_linear_shapes(576, 9, 3, 64, 1536) * args.layers + ([(576, args.vocab)] if args.vocab else [])
    onednn, ours, halves = [], [], []
    for k, n in shapes:
        w = torch.randn(n, k) * 0.02
        onednn.append((ops.create_onednn_mm(w.t(), 32), k))  # as dispatch_cpu_unquantized_gemm does
        ours.append((linear_cpu.pack_weight(w), n, k))
        if args.bf16_weights:
            halves.append((linear_cpu.pack_weight(w, torch.bfloat16), n, k))
    print(f"threads {torch.get_num_threads()}, {len(shapes)} float32 linears "
          f"({sum(n * k for k, n in shapes) * 4 / 1e6:.0f} MB of weights)")
    print(f"{'rows':>5} {'oneDNN ms':>10} {'kernel ms':>10} {'ratio':>6}"
          + (f" {'bf16w ms':>10} {'ratio':>6}" if halves else ""))
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in {k for k, _ in shapes}}
        a, b, c = [], [], []
        for _ in range(args.rounds):
            a.append(median_ms(lambda: [ops.onednn_mm(h, xs[k], None) for h, k in onednn], args.iters))
            b.append(median_ms(lambda: [linear_cpu.linear(xs[k], p, n) for p, n, k in ours], args.iters))
            if halves:
                c.append(median_ms(lambda: [linear_cpu.linear(xs[k], p, n) for p, n, k in halves], args.iters))
        line = f"{m:5d} {statistics.median(a):10.2f} {statistics.median(b):10.2f} " \
               f"{statistics.median(a) / statistics.median(b):6.2f}"
        if halves:
            line += f" {statistics.median(c):10.2f} {statistics.median(a) / statistics.median(c):6.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
