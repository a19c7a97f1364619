"""Data scaling of Clover heads: train in stretches on new corpus tokens, evaluate each.

    python -m vllm_clover.benchmarks.data_scaling --corpus DIR --runs DIR \\
        [--stretches 250k,500k,1M,2M,4M,8M] [--stop-at UNIX_TIME] [--threads 2]

Stretch k trains on corpus tokens [E_{k-1}, E_k) (``train --token-range``), one epoch,
starting from stretch k-1's heads (``--init-from``; stretch 0 from the target-derived
init), with its own warm-up and linear decay, so every stretch ends as a finished run and
E_k is the number of distinct tokens its heads have seen. Each finished stretch is
evaluated on the held-out split (``vllm-clover eval``, the target's own greedy answers,
draft vocabulary 4,096 as served) and ``<runs>/scaling.json`` gathers the figures;
``--plot PNG`` draws held-out agreement per head against distinct tokens.

The driver is restartable at any point: a finished stretch (``training.json``) is kept, an
interrupted one resumes from its checkpoint (exactly), a missing evaluation is redone. With
``--stop-at`` no training step starts after that time and the driver exits 0 with the
stretch to continue named in its log; SIGTERM checkpoints the same way. Results:
docs/results/*-data-scaling.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

# The recipe every stretch shares (docs/training.md, "Training on a corpus").
RECIPE = {"batch_tokens": 4096, "draft_vocab": 4096, "lr": 1e-3, "max_len": 2048, "num_heads": 5,
          "num_layers": 2, "token_value_init": "matched", "save_every": 25}
EVAL_DRAFT_VOCAB = 4096


def parse_tokens(text: str) -> int:
    scale = {"k": 10**3, "M": 10**6}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def stretch_dir(runs: Path, end: int) -> Path:
    return runs / f"tokens-{end}"


def train_stretch(corpus: str, runs: Path, start: int, end: int, prev: Path | None, threads: int,
                  deadline: float | None) -> bool:
    """Train (or resume, or skip when finished) the stretch [start, end); True when finished."""
    from vllm_clover.training.train import TrainArgs, train

    out = stretch_dir(runs, end)
    if (out / "training.json").is_file():
        return True
    args = TrainArgs(out=str(out), data=corpus, token_range=(start, end), epochs=1.0, threads=threads,
                     init_from=None if prev is None else str(prev), compute_dtype="bfloat16",
                     command=f"python -m vllm_clover.benchmarks.data_scaling (stretch {start}:{end})", **RECIPE)
    report = train(args, resume=(out / "checkpoint").is_dir(), progress=False, deadline=deadline)
    return "interrupted_at_step" not in report


def evaluate_stretch(out: Path, threads: int) -> dict[str, Any]:
    from vllm_clover.training.evaluate import EvalArgs, evaluate

    path = out / f"eval_selfdistill_dv{EVAL_DRAFT_VOCAB}.json"
    if path.is_file():
        return json.loads(path.read_text())
    return evaluate(EvalArgs(heads=str(out), threads=threads, json_path=str(path),
                             draft_vocab_size=EVAL_DRAFT_VOCAB), progress=False)


def summary_row(end: int, out: Path, ev: dict[str, Any]) -> dict[str, Any]:
    tr = json.loads((out / "training.json").read_text())
    return {"distinct_tokens": end, "dir": str(out), "steps": tr["steps"],
            "trained_tokens": tr["data"]["num_tokens"],
            "train_seconds": tr["wall_time_s"]["training"], "train_cpu_seconds": tr["wall_time_s"]["training_cpu"],
            "heldout_head_accuracy": [round(a, 4) for a in ev["per_head_accuracy"]],
            "heldout_acceptance_length_decode": {str(c["k"]): round(c["mean_acceptance_length_decode"], 4)
                                                 for c in ev["chain"]},
            "final_train_accuracy": tr["final_train_metrics"]["acc_per_head"]}


def plot(rows: list[dict[str, Any]], baseline: dict[str, Any] | None, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [r["distinct_tokens"] for r in rows]
    for h in range(len(rows[0]["heldout_head_accuracy"])):
        line, = ax.plot(xs, [r["heldout_head_accuracy"][h] for r in rows], marker="o", label=f"head {h}")
        if baseline is not None:
            ax.axhline(baseline["per_head_accuracy"][h], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("distinct training tokens (ShareGPT, all turns; one epoch)")
    ax.set_ylabel("held-out top-1 agreement with the target")
    ax.set_title("Clover-2 heads on SmolLM2-135M: data scaling\n(dotted: shipped heads, 971k tokens x 16 epochs)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus directory (`vllm-clover corpus`)")
    p.add_argument("--runs", required=True, help="folder of the stretches' outputs and scaling.json")
    p.add_argument("--stretches", default="250k,500k,1M,2M,4M,8M", help="cumulative distinct tokens")
    p.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-eval", action="store_true", help="train only")
    p.add_argument("--plot", default=None, metavar="PNG")
    p.add_argument("--baseline", default=None, metavar="EVAL_JSON", help="eval JSON of heads to draw as lines")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    ends = [parse_tokens(s) for s in a.stretches.split(",")]
    rows, prev, start = [], None, 0
    for end in ends:
        if a.stop_at is not None and time.time() >= a.stop_at:
            print(f"[data_scaling] stop time reached before stretch {start}:{end}", file=sys.stderr)
            break
        if not train_stretch(a.corpus, runs, start, end, prev, a.threads, a.stop_at):
            print(f"[data_scaling] stretch {start}:{end} checkpointed; rerun to continue", file=sys.stderr)
            break
        out = stretch_dir(runs, end)
        if not a.no_eval:
            rows.append(summary_row(end, out, evaluate_stretch(out, a.threads)))
            (runs / "scaling.json").write_text(json.dumps({"recipe": RECIPE, "rows": rows}, indent=2) + "\n")
        prev, start = out, end
    if rows and a.plot:
        plot(rows, json.loads(Path(a.baseline).read_text()) if a.baseline else None, Path(a.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
