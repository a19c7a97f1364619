"""Per-step time profile of one vLLM engine, in process (where the numbers in
docs/tree-verification.md "Measured" come from).

    LD_PRELOAD=.venv/lib/libiomp5.so .venv/bin/python -m vllm_clover.benchmarks.profile_step \
        --spec '{"method": "clover", "model": "vllm_clover/heads/smollm2-135m-instruct-clover2", "tree": "small_4", "draft_vocab_size": 4096}'

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that timers can wrap
the runner's methods: target forward (``GPUModelRunner.execute_model``), sampling + drafting
(``sample_tokens``), the Clover proposer, CPU attention (native kernel + tree rows), the tree
rows alone, the tree sampler and the tree plan; inside the proposer the trunk (with and
without building its attention metadata), the heads' tree, retrieval (prompt lookup, datastore)
and grafting.
The target runs eager, as ``vllm-clover bench`` runs it (``--no-enforce-eager``: compiled).
In process, the model's OpenMP threads get every core, as the multiprocess engine's worker
does on machines with at most 2 CPUs (``cpu_env.with_worker_cores``); on larger ones vLLM
keeps a core for its EngineCore (docs/cpu-defaults.md). Prompts are answered one at a time
(batch 1, greedy; ``--batch-size B``: B copies of each prompt at once, or with ``--prompts`` B
distinct prompts of a bench prompt set at once) after one warm-up request.
Prints ms per engine step for each timer. Numbers vary 10-20% between runs on a shared
2-core machine: compare configurations run back to back.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import time
from typing import Any, Callable

PROMPTS = ("Write a short story about a robot learning to paint.",
           "Explain how vaccines work to a ten-year-old.",
           "Give me three tips for writing a good essay.")


def add_timer(totals: dict[str, float], calls: collections.Counter, owner: Any, attr: str, key: str) -> None:
    """Replace ``owner.attr`` by a wrapper adding its wall time to ``totals[key]``."""
    orig: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(orig)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0
            calls[key] += 1

    setattr(owner, attr, timed)


def install_timers(totals: dict[str, float], calls: collections.Counter) -> None:
    import vllm_clover.engine.proposer as proposer
    import vllm_clover.engine.tree_verify as tree_verify
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_clover.engine.proposer import CloverProposer
    from vllm_clover.engine.vllm_model import CloverForSpeculativeDecoding

    for owner, attr, key in ((GPUModelRunner, "execute_model", "target forward"),
                             # Inside the target forward: batch bookkeeping, input and
                             # attention-metadata building (tree plan included), the model's
                             # layers, the LM head over the sampled rows.
                             (GPUModelRunner, "_update_states", "  update states"),
                             (GPUModelRunner, "_prepare_inputs", "  prepare inputs"),
                             (GPUModelRunner, "_build_attention_metadata", "  attn metadata"),
                             (GPUModelRunner, "_model_forward", "  layers"),
                             (LlamaForCausalLM, "compute_logits", "  LM head"),
                             (GPUModelRunner, "sample_tokens", "sample + draft"),
                             (CloverProposer, "propose_clover", "clover proposer"),
                             # Inside the proposer: the trunk with its attention metadata,
                             # the trunk's layers alone, the heads' tree, retrieval.
                             (CloverProposer, "_run_trunk", "  trunk + metadata"),
                             (CloverForSpeculativeDecoding, "trunk", "  trunk layers"),
                             (CloverProposer, "_draft_tree", "  tree drafting"),
                             (proposer, "expand_static_tree", "    heads (tree)"),
                             (proposer, "graft_retrieval", "    retrieval + graft"),
                             (proposer, "retrieval_chain", "      retrieval"),
                             (CPUAttentionBackendImpl, "forward", "attention"),
                             (tree_verify, "tree_attention_rows", "tree rows"),
                             (tree_verify.CloverRejectionSampler, "forward", "tree sampler"),
                             (tree_verify, "plan_tree_step", "tree plan")):
        add_timer(totals, calls, owner, attr, key)


def _op_profiler(top_ops: int) -> Any:
    """torch.profiler over the timed requests when ``top_ops`` > 0, else a no-op context."""
    if top_ops <= 0:
        return contextlib.nullcontext()
    import torch.profiler
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_clover.benchmarks.profile_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="", help="speculative_config JSON (empty: vanilla)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false",
                    help="compile the target (vLLM's default); eager by default, as the bench runs")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="requests per generate call (the prompts repeated; 1 = one at a time)")
    ap.add_argument("--prompts", default="",
                    help="a prompt set of `vllm-clover bench` (e.g. mtbench): its first --num-prompts "
                         "prompts in groups of --batch-size distinct requests, as the bench runs them "
                         "(default: the three built-in prompts, each repeated --batch-size times)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--top-ops", type=int, default=0,
                    help="also run torch.profiler over the timed requests and print the N "
                         "operators with the most self CPU time (slower: profiling overhead)")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    from vllm import LLM, SamplingParams

    from vllm_clover.default_model import ensure_default_model

    spec = json.loads(args.spec) if args.spec else None
    llm = LLM(model=str(ensure_default_model()), dtype=args.dtype, kv_cache_memory_bytes=2 << 30,
              max_num_seqs=max(4, args.batch_size), speculative_config=spec,
              enforce_eager=args.enforce_eager)
    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    install_timers(totals, calls)
    tokenizer = llm.get_tokenizer()
    if args.prompts:
        from vllm_clover.benchmarks.bench import load_prompts, render_prompts

        rendered = render_prompts(load_prompts(args.prompts, args.num_prompts)[0], tokenizer)
        groups = [rendered[i:i + args.batch_size] for i in range(0, len(rendered), args.batch_size)]
    else:
        groups = [[tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True)] * args.batch_size for q in PROMPTS]
    llm.generate(groups[0][:1], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)  # warm-up
    totals.clear()
    calls.clear()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    profiler = _op_profiler(args.top_ops)
    t0, tokens = time.perf_counter(), 0
    with profiler:
        for group in groups:
            outs = llm.generate(group, params, use_tqdm=False)
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    wall = time.perf_counter() - t0
    steps = max(1, calls["sample + draft"])
    if args.top_ops > 0:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top_ops))
    print(f"spec {spec}, batch {args.batch_size}: {tokens} tokens, {tokens / wall:.1f} tok/s, {steps} steps, "
          f"{tokens / steps:.2f} tokens/step")
    for key in totals:
        print(f"  {key:<16} {totals[key] / steps * 1e3:8.2f} ms/step  ({calls[key]} calls)")
    print(f"  {'whole step':<16} {wall / steps * 1e3:8.2f} ms/step")


if __name__ == "__main__":
    main()
