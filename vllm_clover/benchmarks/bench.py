"""Side-by-side speculative-decoding benchmark: vanilla, ngram, medusa, eagle, eagle3, clover.

For every method and batch size it runs vLLM on the same prompts with the same settings,
alternating methods and repeating to spread machine noise, and reports per
(method, batch size): output tokens/s, mean acceptance length (tokens per step, bonus
token included), acceptance rate per draft position, and speedup over ``vanilla`` from
the same run.

    vllm-clover bench --methods vanilla,ngram,clover:vllm_clover/heads/smollm2-135m-instruct-clover2 \
        --batch-sizes 1,8,32 --prompts mtbench --max-tokens 256 --output result.json --plot plots/

Bare ``clover`` is the served default: the shipped heads with exactly the options
``vllm-clover serve`` uses on this machine for ``--dtype`` (its row of
vllm_clover/serve_defaults.py, printed by ``vllm-clover serve --print-config``; the adaptive
tree on CPUs), no checkpoint path or options needed; ``clover?KEY=VALUE&...`` changes some of
them (e.g. ``clover?tree=small_5&tree_token_budget=14``). ``clover:PATH`` runs a checkpoint of
your own with only the options given.

Method syntax: ``NAME[:PATH][@K][?KEY=VALUE&...][!VAR=VALUE;...]`` (``@K`` overrides
``--num-speculative-tokens`` for that method; ``?...`` adds integer or string entries to its
``speculative_config``, e.g. Clover's ``draft_vocab_size``; ``!...`` sets environment
variables of that method's process, e.g. ``vanilla!VLLM_CLOVER_CPU_LINEAR=0``), e.g.
``ngram@4``, ``medusa:/ckpt/medusa``, ``eagle:/ckpt/eagle@3``, ``eagle3:/ckpt/eagle3@3``,
``clover:/ckpt/clover@4?draft_vocab_size=4096``. A method with environment variables is
compared with the ``vanilla`` run under the same variables when the run has one (like for
like), else with plain ``vanilla``.

How it measures (conditions are written into the JSON):
- Each (method, repeat) runs in a fresh subprocess with one ``LLM`` (``max_num_seqs`` = the
  largest batch size), so methods never share process state or Prometheus counters. The
  subprocess is ``python -m vllm_clover.benchmarks.bench`` in the current directory: from a
  checkout's root it imports that checkout's ``vllm_clover`` (no reinstall after an edit; do
  not edit code while a bench runs). The ``vllm-clover bench`` console script itself
  (argument parsing, aggregation) is the installed copy: after changing this file run
  ``python -m vllm_clover.benchmarks.bench`` from the root, or ``make``.
- Batch size ``b``: the prompts are submitted in waves of ``b`` concurrent requests; tokens/s
  = generated tokens / wall time over all waves (prefill included; one warm-up wave first).
- Acceptance: differences of vLLM's own counters (``LLM.get_metrics()``) around each batch
  size. Mean acceptance length = tokens per decode step of a request, bonus included, over
  *every* decode step: (T - R) / decode request-steps for T generated tokens of R requests
  (the first token comes from prefill). At batch 1 the steps are counted: engine iterations
  (``vllm:iteration_tokens_total``) minus one prefill per request. At larger batches they are
  inferred as the larger of vLLM's draft count (request-steps that drafted) and
  T - R - accepted (each request-step yields accepted + 1 tokens): the latter alone comes out
  short, because vLLM counts as accepted the drafts of a request's last step that run past
  ``max_tokens`` or a stop and are dropped (up to a whole lookup span; used alone it
  overstates tokens per step by 1-3% with 5-9 lookup tokens and up to 13% with 16,
  docs/results/*-amx-bf16-tiles.md). vLLM's own ratio, 1 + accepted / drafts, counts only steps that
  drafted, which flatters ngram (no draft where nothing matches); it is kept as
  ``acceptance_length_when_drafting``. Per-position rate = accepted at position i / drafts.
- Draft cost (Clover): wall time inside the Clover proposer (trunk + heads, measured in the
  worker, ``CloverWorkerExtension.clover_timing``) divided by the rest of the wall time of
  the same steps (target forward, sampling, scheduling): ``draft_cost_vs_target_step``.

Output schema (``--output``)::

    {"conditions": {"model", "dtype", "max_tokens", "temperature", "seed", "prompt_set", "num_prompts",
                    "repeats", "machine", "vllm", "torch_threads", "date"},
     "results": [{"method", "batch_size", "tokens_per_s", "mean_acceptance_length",
                  "acceptance_per_position", "speedup_vs_vanilla",
                  "tokens_per_s_runs", "speedup_vs_vanilla_runs", "num_speculative_tokens", "checkpoint",
                  "draft_cost_vs_target_step", "acceptance_length_when_drafting", "env",
                  "adaptive_runs" (the adaptive tree only: per repeat, the steps per "nodes+lookup"
                  shape chosen at that batch size, "0+0" = no drafts, and the learnt
                  plain_overhead_ms / row_overhead_ms)}]}

``tokens_per_s`` is the mean over repeats (``tokens_per_s_runs`` lists them, in repeat order;
``speedup_vs_vanilla_runs`` divides each by vanilla's run of the same repeat);
``mean_acceptance_length`` is 1.0 and ``acceptance_per_position`` empty for vanilla;
``env`` holds the method's ``!VAR=VALUE`` settings ({} without).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

METHODS = ("vanilla", "ngram", "medusa", "eagle", "eagle3", "clover")


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as given on the command line
    name: str
    path: str | None
    k: int | None
    options: tuple[tuple[str, object], ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # environment of the method's process (``!VAR=VALUE``)


def _option_value(text: str) -> int | float | str:
    """``5`` -> 5, ``0.2`` -> 0.2, anything else stays a string (tree names, paths)."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _parse_env(text: str, label: str) -> tuple[tuple[str, str], ...]:
    """``VAR=VALUE;VAR=VALUE`` -> ((VAR, VALUE), ...); VAR must be an environment variable name."""
    env = []
    for item in [i for i in text.split(";") if i]:
        var, eq, value = item.partition("=")
        if not eq or not var.replace("_", "a").isalnum() or var[0].isdigit():
            raise ValueError(f"bad environment setting {item!r} in {label!r}; expected VAR=VALUE")
        env.append((var, value))
    return tuple(env)


def parse_method(text: str) -> MethodSpec:
    """``NAME[:PATH][@K][?KEY=VALUE&...][!VAR=VALUE;...]`` -> MethodSpec; a clear error for
    anything else."""
    rest, _, env_text = text.partition("!")
    env = _parse_env(env_text, text)
    text_body, _, query = rest.partition("?")
    options = []
    for item in [i for i in query.split("&") if i]:
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise ValueError(f"bad option {item!r} in {text!r}; expected KEY=VALUE")
        options.append((key, _option_value(value)))
    body, _, k = text_body.partition("@")
    name, _, path = body.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} in {text!r}; choose from {', '.join(METHODS)}")
    if name in ("medusa", "eagle", "eagle3") and not path:  # bare clover: the served default
        raise ValueError(f"method {name!r} needs a checkpoint path: {name}:PATH")
    if name in ("vanilla", "ngram") and path:
        raise ValueError(f"method {name!r} takes no checkpoint path (got {path!r})")
    if k and not k.isdigit():
        raise ValueError(f"bad speculative token count {k!r} in {text!r}")
    if options and name in ("vanilla",):
        raise ValueError(f"method {name!r} takes no options (got {query!r})")
    return MethodSpec(text, name, path or None, int(k) if k else None, tuple(options), env)


def resolve_method(spec: MethodSpec, dtype: str | None) -> MethodSpec:
    """A ``clover`` method without a path: the shipped heads with exactly the options
    ``vllm-clover serve`` gives them on this machine for ``dtype`` (its row of
    vllm_clover/serve_defaults.py), the method's own ``?KEY=VALUE`` entries on top. Every
    other method as given."""
    if spec.name != "clover" or spec.path:
        return spec
    from vllm_clover.serve_defaults import shipped_serve_options
    from vllm_clover.training.train import shipped_heads_dir

    options = {**shipped_serve_options(dtype), **dict(spec.options)}
    return MethodSpec(spec.label, spec.name, str(shipped_heads_dir()), spec.k, tuple(options.items()), spec.env)


def speculative_config(spec: MethodSpec, default_k: int) -> dict | None:
    """The ``speculative_config`` dict vLLM gets for a method (None for vanilla)."""
    if spec.name == "vanilla":
        return None
    k = spec.k or default_k
    if spec.name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_max": 4, "prompt_lookup_min": 2, **dict(spec.options)}
    config = {"method": spec.name, "model": spec.path, "num_speculative_tokens": k, **dict(spec.options)}
    if spec.name == "clover" and "tree" in config and spec.k is None:
        del config["num_speculative_tokens"]  # a tree's node count is its K
    return config


def load_prompts(source: str, num_prompts: int) -> tuple[list[dict], str]:
    """Records with ``turns`` (chat, first turn) or ``prompt`` (raw text).

    ``mtbench`` = MT-Bench questions; ``sharegpt-heldout`` = first user turns of the fixed
    held-out ShareGPT slice (never trained on); anything else is a JSONL file.
    """
    from vllm_clover.training import data
    if source == "mtbench":
        records = [{"turns": q["turns"]} for q in data.load_mtbench()]
    elif source == "sharegpt-heldout":
        _, heldout = data.split_heldout(data.load_sharegpt())
        records = [{"turns": [c.messages[0]["content"]]} for c in heldout]
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {source} does not exist")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for i, r in enumerate(records):
            if not (isinstance(r.get("turns"), list) and r["turns"]) and not isinstance(r.get("prompt"), str):
                raise ValueError(f"{source}:{i + 1}: record needs 'turns' (non-empty list) or 'prompt'")
    if len(records) < num_prompts:
        raise ValueError(f"prompt set {source} has {len(records)} prompts, {num_prompts} requested")
    return records[:num_prompts], source


def render_prompts(records: list[dict], tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}],
                                          tokenize=False, add_generation_prompt=True)
            if "turns" in r else r["prompt"] for r in records]


def _spec_counters(llm) -> dict[str, object]:
    wanted = {"vllm:spec_decode_num_drafts": "drafts",
              "vllm:spec_decode_num_accepted_tokens": "accepted",
              "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}
    out: dict[str, object] = {"drafts": 0, "accepted": 0, "per_pos": [], "iterations": 0}
    for m in llm.get_metrics():
        if m.name in wanted:
            out[wanted[m.name]] = list(m.values) if hasattr(m, "values") else m.value
        elif m.name == "vllm:iteration_tokens_total":  # one observation per engine iteration
            out["iterations"] = m.count
    return out


def run_method(args: argparse.Namespace, spec: MethodSpec) -> list[dict]:
    """Inside the subprocess: one LLM, every batch size."""
    from vllm import LLM, SamplingParams

    from vllm_clover.default_model import ensure_default_model
    from vllm_clover.engine.options import CloverOptions

    model = args.model or str(ensure_default_model(verbose=False))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    clover = spec.name == "clover"
    extra = {"worker_extension_cls": "vllm_clover.engine.runner_hooks.CloverWorkerExtension"} if clover else {}
    llm = LLM(model=model, dtype=args.dtype, enforce_eager=args.enforce_eager,
              kv_cache_memory_bytes=args.kv_cache_gib << 30, max_model_len=args.max_model_len,
              max_num_seqs=max(batch_sizes), disable_log_stats=False, seed=args.seed,
              speculative_config=speculative_config(spec, args.num_speculative_tokens), **extra)
    records, _ = load_prompts(args.prompts, args.num_prompts)
    prompts = render_prompts(records, llm.get_tokenizer())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    llm.generate(prompts[:max(batch_sizes)], SamplingParams(max_tokens=16), use_tqdm=False)
    spec_config = llm.llm_engine.vllm_config.speculative_config
    k = None if spec_config is None else spec_config.num_speculative_tokens  # a tree's: its nodes
    adaptive = clover and CloverOptions.from_vllm_config(llm.llm_engine.vllm_config).adaptive
    rows = []
    for b in batch_sizes:
        if clover:
            llm.collective_rpc("clover_timing")  # reset
        before = _spec_counters(llm)
        t0, tokens, requests = time.perf_counter(), 0, 0
        for i in range(0, len(prompts), b):
            outs = llm.generate(prompts[i:i + b], params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            requests += len(outs)
        elapsed = time.perf_counter() - t0
        after = _spec_counters(llm)
        drafts = after["drafts"] - before["drafts"]
        accepted = after["accepted"] - before["accepted"]
        # Batch 1 runs one request at a time: each engine iteration is one of its steps.
        decode_steps = after["iterations"] - before["iterations"] - requests if b == 1 else None
        if decode_steps is not None and decode_steps < 0:
            raise RuntimeError("vLLM's vllm:iteration_tokens_total counted fewer engine iterations than "
                               "requests: cannot count decode steps (did its metrics change?)")
        per_pos = [a - b_ for a, b_ in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
        draft_s = llm.collective_rpc("clover_timing")[0]["draft_s"] if clover else None
        rows.append({"method": spec.label, "batch_size": b, "tokens_per_s": tokens / elapsed,
                     "num_speculative_tokens": k,
                     "tokens": tokens, "seconds": elapsed, "draft_seconds": draft_s,
                     "draft_cost_vs_target_step": draft_s / (elapsed - draft_s) if clover else None,
                     "decode_steps": decode_steps,
                     "mean_acceptance_length": tokens_per_decode_step(tokens, requests, accepted, drafts,
                                                                      decode_steps),
                     "acceptance_length_when_drafting": 1 + accepted / drafts if drafts else 1.0,
                     "acceptance_per_position": [p / drafts for p in per_pos] if drafts else []})
        if adaptive:
            rows[-1]["adaptive"] = adaptive_record(llm.collective_rpc("clover_adaptive_state")[0], b)
    return rows


def adaptive_record(state: dict, batch: int) -> dict:
    """What the adaptive tree chose at ``batch`` (steps per heads nodes and lookup tokens, 0/0:
    no drafts, cumulative over the engine's life) and the overheads it had learnt by then."""
    return {"chosen": {f"{n}+{k}": c for b, n, k, c in state["chosen"] if b == batch},
            "plain_overhead_ms": state["plain_overhead_ms"].get(str(batch)),
            "row_overhead_ms": state["row_overhead_ms"].get(str(batch))}


def tokens_per_decode_step(tokens: int, requests: int, accepted: int, drafts: int = 0,
                           decode_steps: int | None = None) -> float:
    """Generated tokens per decode step of a request, bonus included, every step counted
    (steps that drafted nothing too); the first token of each request comes from its prefill.
    ``decode_steps``: the request-steps after prefill when counted (batch 1); else inferred as
    max(drafts, tokens - requests - accepted): each request-step yields accepted + 1 tokens,
    except that drafts of a last step past ``max_tokens`` or a stop are counted as accepted by
    vLLM but dropped, and every drafting request-step is a step."""
    steps = decode_steps if decode_steps is not None else max(drafts, tokens - requests - accepted)
    return (tokens - requests) / steps if steps > 0 else 1.0


def aggregate(runs: list[dict], methods: list[MethodSpec], default_k: int) -> list[dict]:
    """Mean over repeats per (method, batch size), plus speedup vs vanilla of the same run."""
    results, result_specs = [], []
    for spec in methods:
        for b in sorted({r["batch_size"] for r in runs}):
            mine = [r for r in runs if r["method"] == spec.label and r["batch_size"] == b]
            if not mine:
                continue
            result_specs.append(spec)
            tps = [r["tokens_per_s"] for r in mine]
            npos = max(len(r["acceptance_per_position"]) for r in mine)
            results.append({
                "method": spec.label, "batch_size": b,
                "tokens_per_s": sum(tps) / len(tps), "tokens_per_s_runs": tps,
                "mean_acceptance_length": sum(r["mean_acceptance_length"] for r in mine) / len(mine),
                "acceptance_length_when_drafting": sum(r.get("acceptance_length_when_drafting", 1.0)
                                                       for r in mine) / len(mine),
                "acceptance_per_position": [
                    sum(r["acceptance_per_position"][i] for r in mine if len(r["acceptance_per_position"]) > i)
                    / len(mine) for i in range(npos)],
                "draft_cost_vs_target_step": (None if mine[0].get("draft_cost_vs_target_step") is None else
                                              sum(r["draft_cost_vs_target_step"] for r in mine) / len(mine)),
                # The engine's K (runs record it; a tree's is its node count + lookup tokens).
                "num_speculative_tokens": mine[0].get("num_speculative_tokens",
                                                      None if spec.name == "vanilla" else (spec.k or default_k)),
                "checkpoint": spec.path,
                "env": dict(spec.env),
            })
            if any("adaptive" in r for r in mine):
                results[-1]["adaptive_runs"] = [r.get("adaptive") for r in mine]
    vanillas = {spec.env: spec.label for spec in methods if spec.name == "vanilla"}
    for r, spec in zip(results, result_specs):
        base_label = vanillas.get(spec.env, vanillas.get(()))
        base = [v for v in results if v["method"] == base_label and v["batch_size"] == r["batch_size"]]
        r["speedup_vs_vanilla"] = r["tokens_per_s"] / base[0]["tokens_per_s"] if base else None
        # Per repeat (runs are listed in repeat order): methods of one repeat ran minutes
        # apart, so these ratios cancel the machine's slow drifts that the means keep.
        r["speedup_vs_vanilla_runs"] = ([m / v for m, v in zip(r["tokens_per_s_runs"], base[0]["tokens_per_s_runs"])]
                                        if base else None)
    return results


def print_table(results: list[dict]) -> None:
    print(f"\n{'method':40s} {'batch':>5s} {'tok/s':>8s} {'speedup':>8s} {'accept len':>10s} "
          f"{'(drafting)':>10s} {'draft cost':>10s}  per-position | speedup per repeat")
    for r in results:
        sp = f"{r['speedup_vs_vanilla']:.2f}x" if r["speedup_vs_vanilla"] else "-"
        pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"])
        pos += " | " + " ".join(f"{x:.2f}" for x in r.get("speedup_vs_vanilla_runs") or [])
        dc = r.get("draft_cost_vs_target_step")
        dc = f"{100 * dc:.0f}%" if dc is not None else "-"
        print(f"{r['method'][-40:]:40s} {r['batch_size']:5d} {r['tokens_per_s']:8.1f} {sp:>8s} "
              f"{r['mean_acceptance_length']:10.2f} {r.get('acceptance_length_when_drafting', 1.0):10.2f} "
              f"{dc:>10s}  {pos}")


def _label(method: str) -> str:
    """A method spec without the directories of its checkpoint path, its options on a
    second line (chart labels)."""
    name, _, rest = method.partition(":")
    label = f"{name}:{rest.split('/')[-1]}" if rest else name
    head, _, options = label.partition("?")
    # Options wrapped at ~40 characters: one long line squeezes the axes to nothing.
    return head + ("\n" + textwrap.fill(options.replace("&", ", "), 40) if options else "")


def _add_note(fig, ax, note: str) -> None:
    """The run's conditions under the x-axis label (long method labels push the axes right,
    so the note hangs from the axes, not from the figure's corner, and never overlaps it).
    Saving with bbox_inches="tight" fits the labels where tight_layout gives up on them."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        fig.tight_layout()
    ax.annotate(note, xy=(0, 0), xycoords="axes fraction", xytext=(0, -40), textcoords="offset points",
                va="top", fontsize=7)


def plot(results: list[dict], out_dir: Path, conditions: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    note = (f"{conditions['model_name']}, {conditions['dtype']}, {conditions['prompt_set']} "
            f"x{conditions['num_prompts']}, {conditions['max_tokens']} new tokens, T={conditions['temperature']}, "
            f"{conditions['cpus']} CPUs")
    methods = list(dict.fromkeys(r["method"] for r in results))
    batch_sizes = sorted({r["batch_size"] for r in results})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if len(batch_sizes) == 1:  # one batch size: bars, labelled with the speedup
        rows = [next(r for r in results if r["method"] == m) for m in methods]
        bars = ax.barh(range(len(rows)), [r["tokens_per_s"] for r in rows], color="tab:blue")
        ax.set_yticks(range(len(rows)), [_label(m) for m in methods], fontsize=8)
        ax.invert_yaxis()
        for bar, r in zip(bars, rows):
            sp = r.get("speedup_vs_vanilla")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {r['tokens_per_s']:.1f}" + (f" ({sp:.2f}x)" if sp else ""), va="center", fontsize=8)
        ax.set_xlabel("output tokens / s")
        ax.set_xlim(0, 1.25 * max(r["tokens_per_s"] for r in rows))
        ax.set_title(f"Throughput at batch {batch_sizes[0]}", fontsize=11)
    else:
        for m in methods:
            rows = [r for r in results if r["method"] == m]
            ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o",
                    label=_label(m))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("output tokens / s")
        ax.set_title("Throughput by batch size", fontsize=11)
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _add_note(fig, ax, note)
    paths = [out_dir / "throughput.png"]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    b0 = min(r["batch_size"] for r in results)
    for m in methods:
        row = [r for r in results if r["method"] == m and r["batch_size"] == b0]
        if row and row[0]["acceptance_per_position"]:
            acc = row[0]["acceptance_per_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=_label(m))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (per draft)")
    ax.set_title(f"Acceptance per draft position (batch {b0})", fontsize=11)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _add_note(fig, ax, note)
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm-clover bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="vanilla,ngram", help="comma list of NAME[:PATH][@K][?KEY=VALUE&...][!VAR=VALUE;...]")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--prompts", default="mtbench", help="mtbench | sharegpt-heldout | FILE.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the engine and of every request (sampling with --temperature > 0)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="target model dir (default: the embedded model)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    ap.add_argument("--output", type=Path)
    ap.add_argument("--plot", type=Path, help="directory for PNG charts")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one method
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        rows = run_method(args, resolve_method(parse_method(args.worker), args.dtype))
        print("BENCH_ROWS " + json.dumps(rows), flush=True)
        return
    try:
        methods = [parse_method(m) for m in args.methods.split(",") if m]
        resolved = [resolve_method(m, args.dtype) for m in methods]
        load_prompts(args.prompts, args.num_prompts)  # fail fast, before any engine starts
        for spec in resolved:
            if spec.path and not Path(spec.path).is_dir():
                raise FileNotFoundError(f"{spec.label}: checkpoint directory {spec.path} does not exist")
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"vllm-clover bench: error: {exc}")
    argv = sys.argv[1:] if argv is None else argv
    runs: list[dict] = []
    for rep in range(args.repeats):
        # Alternate the order each repeat so slow drifts of the machine hit every method.
        for spec in (methods if rep % 2 == 0 else methods[::-1]):
            cmd = [sys.executable, "-m", "vllm_clover.benchmarks.bench", *argv, "--worker", spec.label]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **dict(spec.env)})
            line = [l for l in proc.stdout.splitlines() if l.startswith("BENCH_ROWS ")]
            if proc.returncode != 0 or not line:
                sys.exit(f"vllm-clover bench: {spec.label} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
            rows = json.loads(line[0][len("BENCH_ROWS "):])
            runs += rows
            print(f"[repeat {rep}] {spec.label}: " + ", ".join(
                f"b{r['batch_size']} {r['tokens_per_s']:.1f} tok/s (acc len {r['mean_acceptance_length']:.2f})"
                for r in rows) + f"  [{time.time() - t0:.0f}s]", flush=True)
    results = aggregate(runs, resolved, args.num_speculative_tokens)
    print_table(results)
    conditions = conditions_dict(args)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"conditions": conditions, "results": results}, indent=1))
        print(f"wrote {args.output}")
    if args.plot:
        for p in plot(results, args.plot, conditions):
            print(f"wrote {p}")


def conditions_dict(args: argparse.Namespace) -> dict:
    import vllm

    from vllm_clover.default_model import DEFAULT_MODEL_NAME

    return {"model": args.model or DEFAULT_MODEL_NAME,
            "model_name": Path(args.model).name if args.model else DEFAULT_MODEL_NAME,
            "dtype": args.dtype, "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
            "prompt_set": args.prompts, "num_prompts": args.num_prompts, "repeats": args.repeats,
            "enforce_eager": args.enforce_eager,
            "machine": f"{platform.machine()} {_cpu_model()}{_cpu_vector_isa()}", "cpus": os.cpu_count(),
            "vllm": vllm.__version__, "date": _dt.date.today().isoformat()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cpu_vector_isa() -> str:
    """The CPU's widest vector ISA for the machine string, ' (AVX-512)' or ' (AVX2)':
    speculative ratios on a CPU depend on it (docs/results/README.md)."""
    from vllm_clover.cpu.env import cpu_flags

    flags = cpu_flags()
    return " (AVX-512)" if "avx512f" in flags else " (AVX2)" if "avx2" in flags else ""


if __name__ == "__main__":
    main()
