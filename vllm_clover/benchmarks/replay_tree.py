"""Offline replay of Clover's whole CPU draft, the heads' static tree with the retrieval chain
grafted into it, on the target's greedy answers: tokens per decode step and verified rows per
step, no engine.

Why: a tree shape or a retrieval setting changes which tokens a step verifies, and greedy
verification is exact, so its acceptance can be measured by replaying the target's greedy
answers step by step, in about a minute for 80 answers, without machine noise, before an
engine benchmark (``vllm-clover bench``) measures what the extra verified rows cost.

    python -m vllm_clover.benchmarks.replay_tree --trees small_4,wide_9 --k 16 --num-prompts 80

What is replayed: at each decode step the proposer's draft (``CloverProposer._draft_tree``):
the heads expand the static tree from the trunk state of the last committed row
(``tree.expand_static_tree``, top-k over the draft vocabulary), then the retrieval chain
(prompt lookup, else the datastore) is grafted from the root and, with ``--leaf-k``, under
each leaf of the heads' tree (``lookup.graft_retrieval``, the proposer's own function). The
trunk runs once over each whole sequence: it is causal, so its state at a row equals the
engine's when the committed tokens are the answer's, which they are in greedy decoding. Features (x_t) come from the target in float32 (transformers), the
heads run in float32. In float32 the replay matches the engine's tokens per step to about
0.01 (docs/results/*-wide-tree-leaf-lookup.md). bf16 engines answer differently (greedy decoding follows the rounding,
and even the batch shape): replay their answers with ``--dtype bfloat16`` for trends, and
expect the per-prompt numbers to differ from an engine run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vllm_clover.benchmarks.replay_retrieval import ReplayStats, make_retrieve, mtbench_answers, replay_tree

DEFAULT_HEADS = Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-instruct-clover2"


@torch.inference_mode()
def head_tree_tokens(drafter, x: torch.Tensor, ids: torch.Tensor, trees: Sequence, lm_head: torch.Tensor,
                     draft_ids: torch.Tensor | None) -> list[np.ndarray]:
    """The heads' tree at every row of one sequence, for each static tree in ``trees``.

    x [L, H] float32: the target's pre-norm last-layer states of ``ids`` [L]; lm_head [V, H].
    Row t's tree is drafted from the trunk state at t (whose fused token is ids[t+1], the
    root): the tree the proposer drafts once ids[:t+2] are committed. Returns, per tree, the
    tokens [L, N+1] (column 0 the root, then nodes 1..N in the tree's order)."""
    from vllm_clover.drafting.tree import expand_static_tree

    shifted = torch.zeros_like(ids)
    shifted[:-1] = ids[1:]
    z, _ = drafter.trunk(x[None], shifted[None])
    z = z[0]
    weight = lm_head if draft_ids is None else lm_head[draft_ids]

    def head(state: torch.Tensor, prev: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        state, o = drafter.head_step(state, prev, i)
        return state, torch.nn.functional.linear(o, weight)

    def topk(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, None]:
        local = logits.topk(n, dim=-1).indices
        return (local if draft_ids is None else draft_ids[local]), None

    return [expand_static_tree(head, z, shifted, tree, topk).tokens.numpy() for tree in trees]


def clover_drafter(rows: np.ndarray, parent: Sequence[int], retrieve=None, root_tokens: int = 0,
                   leaf_tokens: int = 0):
    """TreeDrafter of one answer: the heads' tree of the last committed row (``rows`` [L, N+1]
    from :func:`head_tree_tokens`) with the proposer's retrieval chains grafted
    (``lookup.graft_retrieval``; ``retrieve`` None: the heads' tree alone)."""
    from vllm_clover.drafting.lookup import graft_retrieval

    parent = tuple(int(p) for p in parent)

    def draft(committed: np.ndarray) -> tuple[list[int], tuple[int, ...]]:
        tokens = [int(t) for t in rows[committed.size - 2, 1:]]
        if retrieve is None:
            return tokens, parent
        return graft_retrieval(tokens, parent, committed, retrieve, root_tokens, leaf_tokens)

    return draft


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--trees", default="small_4", help="comma-separated static trees (tree.PRESETS or chain<K>)")
    ap.add_argument("--heads", default=str(DEFAULT_HEADS), help="Clover checkpoint directory")
    ap.add_argument("--draft-vocab-size", type=int, default=4096, help="0: the full vocabulary")
    ap.add_argument("--retrieval", default="lookup+datastore.npz",
                    help="none, lookup, PATH.npz or lookup+PATH.npz (a relative .npz path is taken in --heads)")
    ap.add_argument("--k", type=int, default=16, help="retrieval tokens from the root (prompt_lookup_tokens)")
    ap.add_argument("--leaf-k", type=int, default=0, help="retrieval tokens under each leaf (leaf_lookup_tokens)")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--min-confidence", type=float, default=0.2, help="datastore_min_confidence")
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded model)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype the target answers in (the features are float32 either way)")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--output", default=None, help="JSON with the conditions and one row per tree")
    args = ap.parse_args(argv)

    from vllm_clover.model.checkpoint import load_drafter
    from vllm_clover.default_model import ensure_default_model
    from vllm_clover.model.draft_vocab import load_draft_vocab
    from vllm_clover.training.features import load_target_for_features, load_target_head, prenorm_hidden
    from vllm_clover.engine.options import tree_option

    target = args.target or str(ensure_default_model())
    pairs = [(p, a) for p, a in mtbench_answers(target, args.num_prompts, args.max_tokens, args.dtype) if len(a) > 1]
    _model, decoder, norm = load_target_for_features(target, "float32")
    _norm_w, _eps, lm_head, embed = load_target_head(target, torch.float32)
    drafter = load_drafter(args.heads, dtype=torch.float32, lm_head_weight=lm_head, embed_weight=embed)
    vocab = lm_head.shape[0]
    draft_ids = load_draft_vocab(args.heads, args.draft_vocab_size, vocab) if args.draft_vocab_size else None
    trees = [tree_option(name.strip(), drafter.config.num_heads) for name in args.trees.split(",") if name.strip()]
    retrieve = None
    if args.retrieval != "none":
        spec = "+".join(str(Path(args.heads) / part) if part.endswith(".npz") and not Path(part).is_absolute()
                        else part for part in args.retrieval.split("+"))
        retrieve = make_retrieve(spec, args.lookup_min, args.lookup_max, args.min_confidence, vocab)
    stats: list[list[ReplayStats]] = [[] for _ in trees]
    for prompt, answer in pairs:
        ids = torch.tensor(prompt + answer)
        x = prenorm_hidden(decoder, norm, ids[None], torch.ones_like(ids)[None])[0].float()
        for i, rows in enumerate(head_tree_tokens(drafter, x, ids, trees, lm_head, draft_ids)):
            draft = clover_drafter(rows, trees[i].parent.tolist(), retrieve, args.k, args.leaf_k)
            stats[i].append(replay_tree(np.asarray(prompt), np.asarray(answer), draft))
    results = []
    for tree, per_answer in zip(trees, stats):
        total = ReplayStats(*(sum(getattr(s, f) for s in per_answer) for f in ("steps", "tokens", "drafted", "accepted")))
        results.append({"tree": tree.name, "nodes": tree.num_nodes, "tokens_per_step": round(total.tokens_per_step, 4),
                        "rows_per_step": round(total.rows_per_step, 4), "steps": total.steps})
        print(f"{tree.name:14s} {tree.num_nodes:3d} nodes + {args.retrieval} ({args.k}, leaves {args.leaf_k})  tokens/step "
              f"{total.tokens_per_step:.3f}  draft rows/step {total.rows_per_step:.2f}", flush=True)
    if args.output:
        conditions = {"target": target, "heads": args.heads, "draft_vocab_size": args.draft_vocab_size,
                      "prompts": f"mtbench[:{args.num_prompts}] first turns", "max_tokens": args.max_tokens,
                      "answers_dtype": args.dtype, "features_dtype": "float32", "greedy": True,
                      "retrieval": args.retrieval, "k": args.k, "leaf_k": args.leaf_k, "lookup_min": args.lookup_min,
                      "lookup_max": args.lookup_max, "min_confidence": args.min_confidence}
        Path(args.output).write_text(json.dumps({"conditions": conditions, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
