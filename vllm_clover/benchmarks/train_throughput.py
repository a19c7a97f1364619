"""Tokens per second of the two halves of a training step, per compute dtype, on this machine.

    python -m vllm_clover.benchmarks.train_throughput --corpus DIR [--dtypes bfloat16,float32]
        [--batch-tokens 4096] [--steps 3] [--threads 2] [--json PATH]

For each dtype: the target's feature forward over corpus batches (:class:`stream.TargetFeatures`)
and the Clover-2 training step on them (:func:`train.train_step`, draft-vocabulary loss over
4,096 tokens), each timed over ``--steps`` batches after one warm-up batch. Both wall time and
process CPU time are reported: on a shared machine the wall figure moves with the load, while
tokens per CPU-second (times the thread count) estimates the unloaded rate. Figures are
in docs/training.md ("Throughput").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _timed(fn, steps: int) -> tuple[float, float]:
    fn(0)
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(1, steps + 1):
        fn(i)
    return time.perf_counter() - wall, time.process_time() - cpu


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def measure(corpus_dir: str, dtype: str, batch_tokens: int, steps: int, threads: int) -> dict:
    from vllm_clover.cpu import env as cpu_env
    from vllm_clover.training.batches import BatchPlan
    from vllm_clover.training.corpus import Corpus
    from vllm_clover.training.stream import CorpusSlice, TargetFeatures
    from vllm_clover.training.train import TrainArgs, _seeded_model, train_step
    from vllm_clover.training.inputs import check_target, resolve_target
    from vllm_clover.training.loss import frequent_vocab

    torch.set_num_threads(threads)
    target = resolve_target(None)
    ds = CorpusSlice(Corpus(corpus_dir))
    ds.features = TargetFeatures(target, dtype, torch.device("cpu"))
    plan = BatchPlan(ds.lengths, batch_tokens, seed=0).epoch(0)
    batches = [ds.collate(plan[i]) for i in range(steps + 1)]
    real = [int(b["lengths"].sum()) for b in batches[1:]]
    feat_wall, feat_cpu = _timed(lambda i: ds.features(batches[i]["input_ids"], batches[i]["attention_mask"]), steps)

    args = TrainArgs(out="-", data=corpus_dir, steps=1, compute_dtype=dtype, draft_vocab=4096)
    drafter, config, norm_w, eps, lm_head = _seeded_model(args, target, check_target(target), torch.device("cpu"))
    vocab = frequent_vocab(ds, 4096, config.vocab_size)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    drafter.train()
    step_wall, step_cpu = _timed(lambda i: train_step(drafter, opt, sched, batches[i], norm_w, eps, lm_head,
                                                      vocab, args), steps)
    n = sum(real)
    return {"dtype": dtype, "tokens": n, "batch_tokens": batch_tokens, "steps": steps, "threads": threads,
            "cpu": _cpu_name(), "isa": sorted(f for f in cpu_env.cpu_flags() if f.startswith(("avx512", "amx", "avx2"))),
            "features_tok_per_s_wall": round(n / feat_wall), "features_tok_per_cpu_s": round(n / feat_cpu),
            "train_tok_per_s_wall": round(n / step_wall), "train_tok_per_cpu_s": round(n / step_cpu),
            "loadavg_1m": round(__import__("os").getloadavg()[0], 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = [measure(a.corpus, d, a.batch_tokens, a.steps, a.threads) for d in a.dtypes.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
