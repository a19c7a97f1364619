"""Held-out evaluation of trained Clover heads and Medusa / EAGLE baselines (``vllm-clover eval``).

What is measured (also in docs/training.md)
-------------------------------------------
The held-out set is the fixed held-out slice of ShareGPT (``data.split_heldout``, never
trained on). By default (``selfdistill``) its first prompts are answered by the target
itself (greedy, float32, vLLM; cached), so the text IS the target's own greedy output:
exactly what speculative decoding has to predict. Features (x_t, the target's pre-norm
last-layer states) are computed with the target in float32.

For a sequence y_0 .. y_{L-1} with target states x_0 .. x_{L-1}, write
g_t = argmax LMHead(RMSNorm(x_t)): the target's greedy choice for position t+1.
"Trained positions" t are those whose next token y_{t+1} is an assistant token.

* **Per-head top-1 accuracy (teacher-forced).** Head i at position t (fed the true
  tokens y_{t+1} .. y_{t+1+i}) predicts position t+2+i; it is correct when its argmax is
  g_{t+1+i}. Counted over t with y_{t+1+i} an assistant token (the training mask).
  Medusa: head i reads only h-bar_t (no tokens). EAGLE: "head" i is draft step i, fed the
  true tokens but its own predicted features (baselines.eagle_predictions).
* **Chain acceptance.** At each start position t with y_{t+1} an assistant token other
  than end-of-turn, the heads draft a greedy chain d_0 .. d_{K-1} from z_t and y_{t+1}
  (``CloverDrafter.draft_chain``: each head feeds on the previous head's draft; Medusa:
  each head independently from h-bar_t; EAGLE: autoregressively on its own features and
  drafts, as vLLM's proposer, ``baselines.eagle_chain``). Draft
  d_j is accepted while every earlier one was, and d_j == g_{t+1+j} (the target's greedy
  token after the prefix y_{<=t+1}, d_0 .. d_{j-1}). The target state for that prefix is
  only known while the prefix stays on the stored text, so the count also stops after an
  accepted d_j that differs from y_{t+2+j} (never happens when the text is the target's
  own greedy output), after an accepted end-of-turn token, and at the end of the stored
  sequence. a_t is the number accepted (0..K); a chain of length K < K_max accepts
  min(a_t, K) (greedy chains are prefixes of each other).
* **Mean acceptance length, per position** = 1 + mean_t min(a_t, K): the tokens per
  target step if drafting started at every position.
* **Mean acceptance length, decode** (the headline; what vLLM reports as "mean acceptance
  length"): walk each response as greedy speculative decoding would: start at its first
  position t, emit min(a_t, K) drafts + 1 target token, jump to t + min(a_t, K) + 1;
  the mean of (accepted + 1) over the steps. Exact for the target's own greedy text.
* ``acceptance_rate_per_position[j]``: fraction of steps (decode walk) whose draft j was
  accepted, vLLM's per-position acceptance rate.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vllm_clover.model.drafter import apply_lm_head
from vllm_clover.training.args import TrainingError
from vllm_clover.training.inputs import (check_target, feature_cache_dir, resolve_target, self_distill_cached,
                                        split_sharegpt)

Tensor = torch.Tensor
# predict(x [L, H] float32, shifted [L], starts [n], k, draft_head [V, H]) ->
#   (o_i [L-i, H] per head: head i's teacher-forced output at t, predicting y_{t+2+i};
#    greedy drafts [n, k] from each start, d_j predicting y_{t+2+j})
Predictor = Callable[[Tensor, Tensor, Tensor, int, Tensor], tuple[list[Tensor], Tensor]]
# Small shards: the float32 held-out forward is slow on CPU; progress is saved per shard.
EVAL_SHARD_TOKENS = 16384


@dataclass
class EvalArgs:
    heads: str
    target: str | None = None
    data: str = "selfdistill"
    k: int | None = None
    max_len: int = 1024
    threads: int = 1
    json_path: str | None = None
    feature_dtype: str = "float32"
    max_conversations: int | None = None
    distill_max_new_tokens: int = 256
    # dtype of the drafter's LM-head products (the target's argmax is always float32)
    draft_dtype: str = "bfloat16"
    # > 0: the heads score only the checkpoint's draft vocabulary (vllm_clover/model/draft_vocab.py)
    draft_vocab_size: int = 0


# ============================================================================ per sequence
def target_greedy(x: Tensor, norm_w: Tensor, eps: float, lm_head: Tensor) -> Tensor:
    """g_t = argmax LMHead(RMSNorm(x_t)): x [L, H] -> long [L] (float32 products)."""
    from vllm_clover.training.features import rms_norm

    return F.linear(rms_norm(x, norm_w, eps), lm_head.float()).argmax(-1)


def chain_accepts(drafts: Tensor, starts: Tensor, greedy: Tensor, ids: Tensor, eos_id: int) -> Tensor:
    """Accepted drafts per start position (module docstring, "Chain acceptance").

    drafts [n, K] long: chain drafted at start t = starts[n] (d_j predicts y_{t+2+j});
    greedy [L]: g_t; ids [L]: the stored tokens y_t. Returns a [n] long in 0..K.
    """
    n, k = drafts.shape
    length = ids.shape[0]
    alive = torch.ones(n, dtype=torch.bool)
    accepted = torch.zeros(n, dtype=torch.long)
    for j in range(k):
        pos = starts + 1 + j  # the target state that judges d_j is x_pos
        inside = pos <= length - 1
        posc = pos.clamp(max=length - 1)
        ok = alive & inside & (drafts[:, j] == greedy[posc])
        accepted += ok.long()
        nxt = (pos + 1).clamp(max=length - 1)
        on_text = (pos + 1 <= length - 1) & (drafts[:, j] == ids[nxt])
        alive = ok & on_text & (drafts[:, j] != eos_id)
    return accepted


def decode_walk(accepted: Tensor, starts: Tensor, valid_start: Tensor, k: int) -> list[int]:
    """Greedy speculative decoding along the stored text with chains of length ``k``.

    accepted [n] (a_t at start positions ``starts`` [n]); valid_start [L] bool.
    Returns the accepted count (0..k) of every step, over every response in the sequence
    (a response is a maximal run of valid start positions).
    """
    a_at = {int(t): int(a) for t, a in zip(starts.tolist(), accepted.tolist())}
    valid = valid_start.tolist()
    steps, t, length = [], 0, len(valid)
    while t < length:
        if not valid[t]:
            t += 1
            continue
        # inside a response: step until it ends
        while t < length and valid[t]:
            a = min(a_at[t], k)
            steps.append(a)
            t += a + 1
    return steps


@torch.no_grad()
def clover_predictions(drafter, x: Tensor, shifted: Tensor, starts: Tensor, k: int,
                       draft_head: Tensor) -> tuple[list[Tensor], Tensor]:
    """:data:`Predictor` of a Clover drafter: teacher-forced head outputs + greedy chains."""
    length = x.shape[0]
    z, _ = drafter.trunk(x[None], shifted[None])
    z = z[0]
    outputs, state = [], z
    for i in range(drafter.config.num_heads):
        state = state[: max(length - i, 0)]
        state, o = drafter.head_step(state, shifted[i:], i)
        outputs.append(o)
    drafts, _ = drafter.draft_chain(z[starts], shifted[starts], k=k, lm_head=draft_head)
    return outputs, drafts


def predictor(method: str, drafter, norm_w: Tensor, eps: float) -> Predictor:
    """The :data:`Predictor` of a loaded drafter; Medusa and EAGLE read h-bar_t = RMSNorm(x_t)."""
    from functools import partial

    from vllm_clover.training import baselines
    from vllm_clover.training.features import rms_norm

    if method == "clover":
        return partial(clover_predictions, drafter)
    fn = baselines.medusa_predictions if method == "medusa" else baselines.eagle_predictions
    return lambda x, *rest: fn(drafter, rms_norm(x, norm_w, eps), *rest)


@torch.no_grad()
def evaluate_sequence(predict: Predictor, x: Tensor, ids: Tensor, loss_mask: Tensor, norm_w: Tensor,
                      eps: float, lm_head: Tensor, draft_head: Tensor, k: int, eos_id: int) -> dict[str, Any]:
    """Counts for one sequence. x [L, H] float32, ids [L] long, loss_mask [L] (1 = assistant).

    ``predict``: the drafter (:func:`predictor`); ``lm_head`` [V, H] float32 judges
    (target); ``draft_head`` [V, H] is used by the drafter.
    """
    length = ids.shape[0]
    shifted = torch.zeros_like(ids)
    shifted[:-1] = ids[1:]
    m = torch.zeros(length, dtype=torch.bool)
    m[:-1] = loss_mask[1:].bool()  # m[t]: y_{t+1} is an assistant token
    greedy = target_greedy(x, norm_w, eps, lm_head)
    valid_start = m & (shifted != eos_id)
    starts = valid_start.nonzero(as_tuple=True)[0]
    outputs, drafts = predict(x, shifted, starts, k, draft_head)
    # teacher-forced per-head accuracy (training mask loss_mask[:, i:])
    correct, total = [], []
    for i, o in enumerate(outputs):
        rows = m[i:].nonzero(as_tuple=True)[0]  # t with y_{t+1+i} assistant
        pred = apply_lm_head(draft_head, o[rows]).argmax(-1)
        correct.append(int((pred == greedy[rows + 1 + i]).sum()))
        total.append(len(rows))
    # chains from every start position
    accepted = chain_accepts(drafts, starts, greedy, ids, eos_id)
    walks = {kk: decode_walk(accepted, starts, valid_start, kk) for kk in range(1, k + 1)}
    return {"correct": correct, "total": total, "accepted": accepted.tolist(), "walks": walks}


# ============================================================================ aggregate
def summarize(parts: Sequence[dict[str, Any]], k: int) -> dict[str, Any]:
    """Pool per-sequence counts into the report metrics (module docstring)."""
    correct = np.sum([p["correct"] for p in parts], axis=0)
    total = np.sum([p["total"] for p in parts], axis=0)
    acc = np.concatenate([np.asarray(p["accepted"], dtype=np.int64) for p in parts]) \
        if parts else np.zeros(0, np.int64)
    per_k = []
    for kk in range(1, k + 1):
        steps = np.concatenate([np.asarray(p["walks"][kk], dtype=np.int64) for p in parts]) \
            if parts else np.zeros(0, np.int64)
        per_k.append({
            "k": kk,
            "mean_acceptance_length_decode": float(1 + steps.mean()) if len(steps) else None,
            "mean_acceptance_length_positions": float(1 + np.minimum(acc, kk).mean()) if len(acc) else None,
            "acceptance_rate_per_position": [float((steps > j).mean()) if len(steps) else None
                                             for j in range(kk)],
            "decode_steps": int(len(steps)),
        })
    return {
        "per_head_accuracy": [float(c / max(t, 1)) for c, t in zip(correct, total)],
        "per_head_positions": [int(t) for t in total],
        "chain": per_k,
        "accepted_histogram_kmax": np.bincount(acc, minlength=k + 1).tolist(),
        "num_start_positions": int(len(acc)),
    }


def heldout_conversations(source: str, target: Path, max_new_tokens: int = 256):
    """(conversations, label) of the held-out evaluation set (see module docstring)."""
    from vllm_clover.training.data import DataError, load_conversations

    _train, held = split_sharegpt()
    if source == "selfdistill":
        return self_distill_cached(target, held, "heldout", max_new_tokens, "float32"), \
            f"selfdistill(sharegpt_v3:heldout, max_new_tokens={max_new_tokens}, float32)"
    if source == "sharegpt":
        return held, "sharegpt_v3:heldout"
    path = Path(source).expanduser()
    if not path.is_file():
        raise TrainingError(f"evaluation file {path} not found (expected selfdistill, sharegpt or a .jsonl path)")
    try:
        return load_conversations(path), f"file:{path.resolve()}"
    except DataError as exc:
        raise TrainingError(str(exc)) from None


def evaluate(args: EvalArgs, progress: bool = True) -> dict[str, Any]:
    """Run the held-out evaluation; returns (and writes) the JSON report.

    ``args.heads`` may be a Clover, Medusa or EAGLE checkpoint (told apart by config.json)."""
    from vllm_clover.training.features import load_target_head

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_target(args.target)
    target_config = check_target(target)
    method, drafter, k = _load_heads(args, target_config)
    norm_w, eps, lm_head, embed = load_target_head(target, dtype=torch.float32)
    if method == "clover":
        drafter.bind_target(lm_head)
    else:
        drafter.bind_target(lm_head, embed)
    predict = predictor(method, drafter, norm_w, eps)
    draft_head = _draft_head(args, method, lm_head)
    convs, label, cache, ds = _heldout_features(args, target)
    eos_id = int(ds.manifest["tokenizer"]["eos_token_id"])
    items = range(len(ds))
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="eval", unit="seq", file=sys.stderr,
                     mininterval=1.0 if sys.stderr.isatty() else 30.0)
    parts = []
    for i in items:
        item = ds[i]
        parts.append(evaluate_sequence(predict, item["hidden"].float(), item["input_ids"],
                                       item["loss_mask"], norm_w, eps, lm_head, draft_head, k, eos_id))
    conv_index = _conv_indices(ds)
    per_sequence = [{"conversation": convs[conv_index[i]].id, "decode_steps": len(p["walks"][k]),
                     "accepted": int(sum(p["walks"][k]))} for i, p in enumerate(parts)]
    report = {
        "heads": str(Path(args.heads).resolve()),
        "method": method,
        "target": str(target),
        "data": label,
        "feature_cache": str(cache),
        "num_sequences": len(ds),
        "k_max": k,
        **summarize(parts, k),
        "args": asdict(args),
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "per_sequence_kmax": per_sequence,
    }
    return _write_report(args, report)


def _load_heads(args: EvalArgs, target_config: dict[str, Any]) -> tuple[str, Any, int]:
    """(method, drafter in float32 eval mode, chain length K) of ``args.heads``; K is
    checked against the number of heads."""
    from vllm_clover.model.checkpoint import load_drafter
    from vllm_clover.training.baselines import checkpoint_method, load_baseline

    method = checkpoint_method(args.heads)
    if method == "clover":
        drafter = load_drafter(args.heads, target_config=target_config)  # float32, eval mode
    else:
        drafter = load_baseline(args.heads, target_config=target_config)
    k = args.k or drafter.config.num_heads
    # EAGLE is one autoregressive draft model: any chain length; the others have K heads.
    k_max = None if method == "eagle" else drafter.config.num_heads
    if k < 1 or (k_max is not None and k > k_max):
        bound = f"in 1..{k_max} (the number of heads)" if k_max else ">= 1"
        raise TrainingError(f"-k {k} must be {bound}")
    return method, drafter, k


def _draft_head(args: EvalArgs, method: str, lm_head: Tensor) -> Tensor:
    """The LM head [V, H] the drafter scores with: in ``draft_dtype``, restricted to the
    checkpoint's draft vocabulary when ``draft_vocab_size`` is set."""
    from vllm_clover.model.draft_vocab import DraftVocabError, load_draft_vocab, subset_logits_fn

    draft_head = lm_head.to(getattr(torch, args.draft_dtype))
    if args.draft_vocab_size:
        if method != "clover":
            raise TrainingError("--draft-vocab applies to Clover checkpoints only")
        try:
            ids = load_draft_vocab(args.heads, args.draft_vocab_size, lm_head.shape[0])
        except DraftVocabError as exc:
            raise TrainingError(str(exc)) from None
        draft_head = subset_logits_fn(draft_head, ids)
    return draft_head


def _heldout_features(args: EvalArgs, target: Path):
    """(conversations, label, feature-cache dir, FeatureDataset) of the held-out set; the
    features are computed on first use."""
    from vllm_clover.training.features import FeatureDataset, extract_features

    convs, label = heldout_conversations(args.data, target, args.distill_max_new_tokens)
    if args.max_conversations:
        convs = convs[: args.max_conversations]
    if not convs:
        raise TrainingError(f"no evaluation conversations from --data {args.data}")
    cache = feature_cache_dir(target, convs, args.max_len, args.feature_dtype)
    extract_features(target, convs, cache, max_len=args.max_len, dtype=args.feature_dtype,
                     data_source=label, num_threads=args.threads or None, shard_tokens=EVAL_SHARD_TOKENS)
    return convs, label, cache, FeatureDataset(cache)


def _write_report(args: EvalArgs, report: dict[str, Any]) -> dict[str, Any]:
    """Write ``report`` to ``--json`` or ``<heads>/eval_<data>[_dv<N>].json``; adds ``json_path``."""
    suffix = f"_dv{args.draft_vocab_size}" if args.draft_vocab_size else ""
    out = Path(args.json_path) if args.json_path else Path(args.heads) / f"eval_{_slug(args.data)}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    report["json_path"] = str(out)
    return report


def _conv_indices(ds) -> list[int]:
    """Index (in the evaluated conversation list) of every sequence of a feature cache."""
    from safetensors import safe_open

    out: list[int] = []
    for path in ds.files:
        with safe_open(str(path), "pt") as f:
            out.extend(f.get_tensor("conv_index").tolist())
    return out


def _slug(source: str) -> str:
    return source if source in ("selfdistill", "sharegpt") else Path(source).stem


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of the report."""
    lines = [f"heads {report['heads']} ({report.get('method', 'clover')})", f"held-out data: {report['data']} "
             f"({report['num_sequences']} sequences, {report['num_start_positions']} start positions)",
             "", "head  top-1 acc (teacher-forced)  positions"]
    for i, (a, n) in enumerate(zip(report["per_head_accuracy"], report["per_head_positions"])):
        lines.append(f"{i:>4}  {a:>26.3f}  {n:>9}")
    lines += ["", "  K  mean acceptance length (decode)  (per position)  acceptance rate per draft position"]
    for row in report["chain"]:
        rates = " ".join(f"{r:.2f}" for r in row["acceptance_rate_per_position"])
        lines.append(f"{row['k']:>3}  {row['mean_acceptance_length_decode']:>32.3f}  "
                     f"{row['mean_acceptance_length_positions']:>14.3f}  {rates}")
    if report.get("json_path"):
        lines += ["", f"wrote {report['json_path']}"]
    return "\n".join(lines)
