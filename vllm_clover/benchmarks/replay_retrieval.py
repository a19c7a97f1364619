"""Offline replay of the retrieval drafters (prompt lookup, n-gram datastores) on the target's
own greedy answers: tokens per decode step and verified retrieval rows per step, no engine.

Why: a datastore or lookup setting changes only which tokens fill the lookup's verify slots,
and verification is exact, so its acceptance on greedy decoding can be measured by replaying
the target's greedy answers step by step, in seconds instead of a benchmark's minutes, and
without machine noise. The engine benchmark (``vllm-clover bench``) then checks the winner.

    python -m vllm_clover.benchmarks.replay_retrieval --num-prompts 40 \
        --drafters "lookup,lookup+vllm_clover/heads/smollm2-135m-instruct-clover2/datastore.npz,lookup+my.npz"

Answers: greedy float32 answers of the target to MT-Bench first turns (``--max-tokens``),
generated once with vLLM and cached under ``$VLLM_CLOVER_CACHE/replay/``. A drafter is
``lookup`` (prompt lookup only), ``PATH.npz`` (datastore only) or ``lookup+PATH.npz``
(prompt lookup, else the datastore: the proposer's rule). Heads are not replayed: their
drafts depend on hidden states (``vllm-clover eval`` measures them).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

# Drafter: committed tokens [L] (the root last) -> up to k draft tokens.
Drafter = Callable[[np.ndarray], np.ndarray]
# TreeDrafter: committed tokens [L] -> (tokens [N] of nodes 1..N, parent [N+1], root -1).
TreeDrafter = Callable[[np.ndarray], tuple[Sequence[int], Sequence[int]]]


@dataclass(frozen=True)
class ReplayStats:
    steps: int
    tokens: int  # tokens produced by decode steps (each step: accepted drafts + 1)
    drafted: int  # draft tokens proposed, i.e. retrieval rows verified
    accepted: int

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(self.steps, 1)

    @property
    def rows_per_step(self) -> float:
        return self.drafted / max(self.steps, 1)


def accepted_length(tokens: Sequence[int], parent: Sequence[int], truth: np.ndarray) -> int:
    """Drafts a greedy target accepts from a tree: the depth of the deepest node whose path
    from the root spells ``truth`` [T] (the answer's next tokens) from its start.

    tokens [N]: nodes 1..N; parent [N+1]: parent index of each node, -1 for the root (node
    0); a parent comes before its children (BFS order, as the proposer builds trees)."""
    children: dict[int, list[int]] = {}
    for n in range(1, len(parent)):
        children.setdefault(int(parent[n]), []).append(n)
    node = depth = 0
    while depth < truth.size:
        node = next((c for c in children.get(node, ()) if tokens[c - 1] == truth[depth]), -1)
        if node < 0:
            break
        depth += 1
    return depth


def replay_tree(prompt: np.ndarray, answer: np.ndarray, draft: TreeDrafter) -> ReplayStats:
    """Greedy speculative decoding of ``answer`` [T] after ``prompt`` [P] with tree drafts.

    The first answer token comes from prefill (as in vLLM, and as the bench counts); each
    decode step drafts a tree after the committed tokens, accepts the deepest path equal to
    the answer's next tokens and adds the target's own next token (the bonus), or ends the
    answer. ``drafted`` counts the nodes no deeper than the tokens left in the answer."""
    seq = np.concatenate([prompt, answer]).astype(np.int64)
    pos, end = prompt.size + 1, seq.size  # committed = seq[:pos]
    steps = drafted = accepted = 0
    while pos < end:
        tokens, parent = draft(seq[:pos])
        depth = [0] * len(parent)
        for n in range(1, len(parent)):
            depth[n] = depth[parent[n]] + 1
        n = accepted_length(tokens, parent, seq[pos:end])
        steps, accepted = steps + 1, accepted + n
        drafted += sum(1 for d in depth[1:] if d <= end - pos)
        pos = min(end, pos + n + 1)
    return ReplayStats(steps, end - prompt.size - 1, drafted, accepted)


def replay(prompt: np.ndarray, answer: np.ndarray, drafter: Drafter) -> ReplayStats:
    """:func:`replay_tree` with a chain drafter (each draft the child of the previous one)."""
    def as_tree(committed: np.ndarray) -> tuple[list[int], list[int]]:
        chain = [int(t) for t in drafter(committed)]
        return chain, list(range(-1, len(chain)))

    return replay_tree(prompt, answer, as_tree)


def make_retrieve(spec: str, lookup_min: int, lookup_max: int, min_confidence: float,
                  vocab_size: int) -> Callable[[np.ndarray, int], np.ndarray]:
    """``lookup``, ``PATH.npz`` or ``lookup+PATH.npz`` as ``retrieve(committed, k)``: up to
    ``k`` draft tokens after ``committed`` (lookup.retrieval_chain, the proposer's rule)."""
    from vllm_clover.drafting.datastore import load_datastore
    from vllm_clover.drafting.lookup import retrieval_chain

    parts = spec.split("+", 1)
    use_lookup = parts[0] == "lookup"
    path = parts[1] if use_lookup and len(parts) == 2 else (None if use_lookup else spec)
    store = load_datastore(path, vocab_size) if path else None

    def retrieve(committed: np.ndarray, k: int) -> np.ndarray:
        if use_lookup:
            return retrieval_chain(committed, k, lookup_min, lookup_max, store, min_confidence)
        return store.continuation(committed, k, min_confidence)

    return retrieve


def make_drafter(spec: str, k: int, lookup_min: int, lookup_max: int, min_confidence: float,
                 vocab_size: int) -> Drafter:
    """``lookup``, ``PATH.npz`` or ``lookup+PATH.npz`` as a drafter of up to ``k`` tokens."""
    retrieve = make_retrieve(spec, lookup_min, lookup_max, min_confidence, vocab_size)
    return lambda committed: retrieve(committed, k)


def mtbench_answers(model_dir: str, num_prompts: int, max_tokens: int,
                    dtype: str = "float32") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of the first ``num_prompts`` MT-Bench first turns,
    answered by the target in ``dtype``; cached. Starts vLLM when not cached: call under
    ``__main__``. The answers differ between dtypes (greedy decoding follows rounding), and
    so does how much of them repeats: replay in the dtype you serve."""
    from vllm_clover.default_model import cache_dir

    path = cache_dir() / "replay" / f"{Path(model_dir).name}-mtbench{num_prompts}-mnt{max_tokens}-{dtype}.json"
    if path.is_file():
        return [tuple(r) for r in json.loads(path.read_text())]
    from transformers import AutoTokenizer

    from vllm_clover.benchmarks.bench import load_prompts, render_prompts
    from vllm_clover.cpu import env as cpu_env
    cpu_env.set_cpu_env_for_children()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records, _ = load_prompts("mtbench", num_prompts)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"]
               for text in render_prompts(records, tokenizer)]
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=cpu_env.DEFAULT_KV_CACHE_BYTES)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    pairs = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pairs))
    return pairs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--drafters", required=True, help="comma-separated: lookup, PATH.npz, lookup+PATH.npz")
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded model)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype the target answers in (the answers are cached per dtype)")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per step (prompt_lookup_tokens)")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--min-confidence", type=float, default=0.2, help="datastore_min_confidence")
    ap.add_argument("--output", default=None, help="JSON with the conditions and one row per drafter")
    args = ap.parse_args(argv)

    from transformers import AutoConfig

    from vllm_clover.default_model import ensure_default_model

    target = args.target or str(ensure_default_model())
    vocab = AutoConfig.from_pretrained(target).get_text_config().vocab_size
    pairs = mtbench_answers(target, args.num_prompts, args.max_tokens, args.dtype)
    rows = []
    for spec in [s.strip() for s in args.drafters.split(",") if s.strip()]:
        drafter = make_drafter(spec, args.k, args.lookup_min, args.lookup_max, args.min_confidence, vocab)
        stats = [replay(np.asarray(p), np.asarray(a), drafter) for p, a in pairs if len(a) > 1]
        total = ReplayStats(*(sum(getattr(s, f) for s in stats) for f in ("steps", "tokens", "drafted", "accepted")))
        rows.append({"drafter": spec, "tokens_per_step": round(total.tokens_per_step, 4),
                     "rows_per_step": round(total.rows_per_step, 4), "steps": total.steps})
        print(f"{spec:70s} tokens/step {total.tokens_per_step:.3f}  retrieval rows/step "
              f"{total.rows_per_step:.2f}", flush=True)
    if args.output:
        conditions = {"target": target, "prompts": f"mtbench[:{args.num_prompts}] first turns",
                      "max_tokens": args.max_tokens, "dtype": args.dtype, "greedy": True, "k": args.k,
                      "lookup_min": args.lookup_min, "lookup_max": args.lookup_max,
                      "min_confidence": args.min_confidence}
        Path(args.output).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
