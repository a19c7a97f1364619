"""Training Clover heads on cached target features (``vllm-clover train``).

``--method medusa`` / ``--method eagle`` train the Medusa-1 / EAGLE-1 baselines of
:mod:`vllm_clover.training.baselines` through the same pipeline (data, features, batches, optimizer,
schedule, checkpoints); only the model, its input (h-bar_t instead of x_t) and the loss
weights differ, and the output is in the format of vLLM's built-in ``medusa`` / ``eagle``.

Pipeline (docs/training.md)::

    conversations  --(optional) self-distillation with the target via vLLM, cached-->
    feature cache  --features.extract_features, computed once, reused-->
    training loop  --Clover-2 loss, AdamW, checkpoints + exact resume-->
    <out>/config.json + model.safetensors (bf16, trainable weights only) + training.json

The pieces, one module each: the run's settings (:mod:`~vllm_clover.training.args`), what it
reads (:mod:`~vllm_clover.training.inputs`: target, conversations, feature caches), the
batches (:mod:`~vllm_clover.training.batches`) and the loss
(:mod:`~vllm_clover.training.loss`: the official Clover-2 loss, computed more cheaply). This
module builds the model, runs the loop, checkpoints it and writes the result.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_clover.model.config import CloverConfig
from vllm_clover.model.drafter import CloverDrafter, init_from_target, match_token_value_scale
from vllm_clover.training.args import TrainArgs, TrainingError, device_name, log, resolve_device  # noqa: F401 (re-exported)
from vllm_clover.training.baselines import build_baseline, save_baseline, shape_config
from vllm_clover.training.batches import BatchPlan, to_device
from vllm_clover.training.corpus import Corpus, is_corpus
from vllm_clover.training.distributed import DataParallel, check_supported, world_size_from_env
from vllm_clover.training.inputs import FeatureChunks, build_feature_chunks, check_target, resolve_target, select_conversations
from vllm_clover.training.state import LEGACY_PICKLE, StateError, has_state, load_state, save_state
from vllm_clover.training.stream import CorpusSlice, TargetFeatures
from vllm_clover.training.loss import batch_vocab, clover_loss_backward, frequent_vocab, head_row_counts, \
    loss_chunk_rows, loss_settings

Tensor = torch.Tensor

# Heads shipped inside the package for the default model (docs/training.md, section 6).
SHIPPED_HEADS = "smollm2-135m-instruct-clover2"
CHECKPOINT_DIR = "checkpoint"
# While the file this variable names exists, the loop sleeps between steps (a measurement
# elsewhere on the machine wants the CPU); checkpoints and the result are unaffected.
PAUSE_ENV = "VLLM_CLOVER_PAUSE_FILE"


def shipped_heads_dir(name: str = SHIPPED_HEADS) -> Path:
    """Folder of a drafter shipped in ``vllm_clover/heads/`` (may not exist in a bare checkout)."""
    return Path(__file__).resolve().parent.parent / "heads" / name


# ============================================================================ model
def build_drafter_for_target(target: Path, target_config: dict[str, Any], variant: str = "clover2",
                             num_heads: int = 5, num_layers: int = 2
                             ) -> tuple[CloverDrafter, CloverConfig]:
    """A Clover drafter initialised from ``target`` (the official init, see init_from_target), float32, unbound."""
    from safetensors.torch import load_file

    config = CloverConfig.from_target_config(target_config, variant=variant, num_heads=num_heads,
                                             num_layers=num_layers)
    config.target_name = config.target_name or target.name
    drafter = CloverDrafter(config)
    state: dict[str, Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        state.update(load_file(str(path)))
    init_from_target(drafter, state)
    return drafter, config


def load_trained_heads(drafter: CloverDrafter, heads_dir: str | os.PathLike,
                       target_config: dict[str, Any]) -> None:
    """Copy the weights of trained Clover heads (a ``save_drafter`` directory) into ``drafter``.

    The heads must be for this target and of the same shape (variant, heads, layers); any
    difference is refused with one line naming it, never silently skipped.
    """
    from vllm_clover.model.checkpoint import CloverCheckpointError, load_drafter

    try:
        trained = load_drafter(heads_dir, target_config)
    except (CloverCheckpointError, OSError) as exc:
        raise TrainingError(f"--init-from: {exc}") from None
    mine, theirs = drafter.state_dict(), trained.state_dict()
    if trained.config.variant != drafter.config.variant:
        raise TrainingError(f"--init-from: {heads_dir} holds {trained.config.variant} heads, "
                            f"this run trains {drafter.config.variant}")
    diff = sorted(k for k in mine.keys() | theirs.keys()
                  if k not in mine or k not in theirs or mine[k].shape != theirs[k].shape)
    if diff:
        raise TrainingError(f"--init-from: {heads_dir} does not match this run's shape "
                            f"(--num-layers, or Clover-1's --num-heads): tensor(s) {', '.join(diff[:4])}"
                            f"{' ...' if len(diff) > 4 else ''} differ")
    drafter.load_state_dict({k: v.to(mine[k].dtype) for k, v in theirs.items()})


def build_model_for_target(args: TrainArgs, target: Path, target_config: dict[str, Any]):
    """(model, config) for ``args.method``, float32, unbound; call after seeding the RNGs."""
    if args.method == "clover":
        return build_drafter_for_target(target, target_config, args.variant, args.num_heads, args.num_layers)
    try:
        config = shape_config(args.method, target_config, args.num_heads, args.num_layers)
    except ValueError as exc:  # BaselineError, CloverConfigError: one line
        raise TrainingError(str(exc)) from None
    config.target_name = config.target_name or target.name
    return build_baseline(args.method, config), config


def save_model(out: Path, drafter, config: CloverConfig, method: str, target: Path,
               target_config: dict[str, Any]) -> None:
    """Write the final drafter (bf16 trainable weights) in the format vLLM loads for ``method``."""
    if method == "clover":
        from vllm_clover.model.checkpoint import save_drafter

        save_drafter(out, drafter, config, dtype=torch.bfloat16)
        return
    from vllm_clover.training.features import load_target_head

    # Medusa needs a copy of the target's LM head in the file: the stored tensor, uncast.
    lm_head = load_target_head(target)[2] if method == "medusa" else None
    save_baseline(out, drafter, target_config, lm_head, target_name=config.target_name, dtype=torch.bfloat16)


def rms(t: Tensor, mask: Tensor | None = None) -> float:
    """Root mean square of ``t`` [..., H] over all elements (rows with ``mask`` == 0 left out)."""
    t = t.detach().float()
    if mask is not None:
        t = t[mask.bool()]
    return float(t.pow(2).mean().sqrt())


def token_state_rms(drafter: CloverDrafter, batch: dict[str, Tensor]) -> dict[str, float]:
    """RMS of the state each Attention Decoder adds a token to, for ``match_token_value_scale``:
    the trunk's x_t (measured on ``batch``'s real positions) and, for head decoders, the
    normalised trunk output z, whose RMS is that of ``trunk_norm``'s weight."""
    z_rms = rms(drafter.trunk_norm.weight)
    if drafter.config.variant == "clover2":
        return {"trunk_decoder": rms(batch["x"], batch["attention_mask"]), "head_decoder": z_rms}
    return {f"head_decoders.{i}": z_rms for i in range(drafter.config.num_heads)}


# ============================================================================ the run
@dataclass
class _Run:
    """What the phases of one :func:`train` call share: the model, its frozen target head,
    the optimizer and the progress so far."""

    args: TrainArgs
    device: torch.device
    out: Path
    target: Path
    target_config: dict[str, Any]
    ds: FeatureChunks
    data_info: dict[str, Any]
    drafter: Any  # CloverDrafter, or a Medusa / EAGLE baseline
    config: CloverConfig
    norm_w: Tensor  # [H] float32: the target's final norm
    eps: float
    lm_head: Tensor  # [V, H] in compute_dtype: the target's LM head for the loss products
    vocab: Tensor | None  # long [V']: --train-vocab base subset; None = full vocabulary
    plan: BatchPlan
    total_steps: int
    warmup: int
    optimizer: torch.optim.Optimizer
    scheduler: Any
    dp: DataParallel  # this process's rank (world size 1: a single process)
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    elapsed_before: float = 0.0  # training seconds of earlier calls (resumed runs)
    train_seconds: float = 0.0  # training seconds so far, earlier calls included


def train(args: TrainArgs, resume: bool = False, stop_after: int | None = None,
          progress: bool = True, deadline: float | None = None) -> dict[str, Any]:
    """Run (or resume) a training run; returns the ``training.json`` content, or
    ``{"interrupted_at_step": n}`` when it stopped early with a checkpoint.

    ``stop_after``: stop (after checkpointing) once this many steps are done in this call,
    to simulate an interruption (tests, ``--stop-after``). ``deadline``: a ``time.time()``
    after which no new step starts (the run checkpoints and stops; ``--stop-at``).
    Under torchrun (``$WORLD_SIZE`` > 1) this process is one rank of a data-parallel run
    (:mod:`~vllm_clover.training.distributed`); every rank returns the same report.
    Raises :class:`TrainingError`.
    """
    t_start = time.perf_counter()
    args.validate()
    check_supported(args.method, is_corpus(args.data), world_size_from_env())
    dp = DataParallel.start(args.device)
    try:
        return _train(args, dp, resume, stop_after, progress, deadline, t_start)
    finally:
        dp.close()


def _train(args: TrainArgs, dp: DataParallel, resume: bool, stop_after: int | None, progress: bool,
           deadline: float | None, t_start: float) -> dict[str, Any]:
    """:func:`train` on this rank's device, once the process group (if any) is joined."""
    out, state_path = _output_dir(args, resume)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_target(args.target)
    target_config = check_target(target)
    ds, data_info, timings = _training_data(args, target, dp.device)
    run = _prepare_run(args, dp, out, target, target_config, ds, data_info)
    if resume:
        _restore_training_state(run, state_path)
    dp.barrier()  # every rank has checked and read --out before rank 0 writes into it
    if dp.is_main:
        out.mkdir(parents=True, exist_ok=True)
    if not _train_loop(run, stop_after, progress, deadline):
        return {"interrupted_at_step": run.step}
    return _finish(run, timings, t_start)


def _output_dir(args: TrainArgs, resume: bool) -> tuple[Path, Path]:
    """(output dir, checkpoint state file); refuses a resume without a checkpoint and a new
    run over an existing one."""
    out = Path(args.out).expanduser()
    state_path = out / CHECKPOINT_DIR
    if resume and not (has_state(state_path) or (state_path / LEGACY_PICKLE).is_file()):
        raise TrainingError(f"--resume: no checkpoint in {state_path}")
    if not resume and (state_path.is_dir() or (out / "training.json").is_file()):
        raise TrainingError(f"output directory {out} already holds a training run; "
                            "pass --resume to continue it or choose another --out")
    return out, state_path


def _training_data(args: TrainArgs, target: Path, device: torch.device
                   ) -> tuple[FeatureChunks | CorpusSlice, dict[str, Any], dict[str, float]]:
    """The training dataset, what training.json records about it, and the seconds spent on
    data and on features: a corpus slice whose features the target computes per batch, or
    the conversations' feature caches (computed once, reused) as one dataset."""
    t0 = time.perf_counter()
    if is_corpus(args.data):
        corpus = Corpus(args.data)
        _check_corpus_target(corpus, target)
        start, end = args.token_range if args.token_range is not None else (None, None)
        ds = CorpusSlice(corpus, start, end)
        ds.features = TargetFeatures(target, args.compute_dtype, device)
        data_info = {"source": corpus.info["source"], **ds.data_info()}
        return ds, data_info, {"data": time.perf_counter() - t0, "features": 0.0}
    chunks, label = select_conversations(args.data, args.num_conversations, target,
                                         args.distill_max_new_tokens, args.distill_dtype)
    if not chunks:
        raise TrainingError(f"no training conversations from --data {args.data}")
    t_data = time.perf_counter() - t0
    t0 = time.perf_counter()
    ds, cache_dirs = build_feature_chunks(target, chunks, label, args.max_len, args.compute_dtype,
                                          args.threads, args.feature_cache, str(device))
    t_features = time.perf_counter() - t0
    data_info = {"source": label, "feature_caches": [str(d) for d in cache_dirs], **ds.data_info()}
    return ds, data_info, {"data": t_data, "features": t_features}


def _check_corpus_target(corpus: Corpus, target: Path) -> None:
    """Refuse a corpus tokenized for another target (its config and tokenizer fingerprints)."""
    from vllm_clover.training.features import target_fingerprint

    want, have = corpus.info["target"], target_fingerprint(target)
    if want.get("config_sha256") != have.get("config_sha256"):
        raise TrainingError(f"corpus {corpus.path} was tokenized for another target "
                            f"({want.get('name') or want.get('dir')}); build one for {target}")


def _prepare_run(args: TrainArgs, dp: DataParallel, out: Path, target: Path, target_config: dict[str, Any],
                 ds: FeatureChunks | CorpusSlice, data_info: dict[str, Any]) -> _Run:
    """Seed the RNGs, build the model on the frozen target head, plan the batches and
    set up the optimizer and its schedule (in this order: the random draws depend on it).
    Under several processes every rank does the same, then takes rank 0's weights."""
    device = dp.device
    drafter, config, norm_w, eps, lm_head = _seeded_model(args, target, target_config, device)
    size = args.train_vocab or args.draft_vocab
    vocab = frequent_vocab(ds, size, config.vocab_size).to(device) if size else None
    plan = BatchPlan(ds.lengths, args.batch_tokens, args.seed)
    if args.token_value_init == "matched" and args.init_from is None and dp.is_main:
        _match_token_values(drafter, ds, plan, device)  # on the whole first batch, as one process
    dp.broadcast_module(drafter)
    total_steps = args.steps if args.steps is not None else plan.steps_for_epochs(args.epochs)
    if total_steps < 1:
        raise TrainingError("the run has 0 steps (too few conversations or epochs)")
    dp.check_batches(_planned_batches(plan, total_steps))
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=tuple(args.betas),
                                  weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _linear_warmup_decay(warmup, total_steps))
    return _Run(args, device, out, target, target_config, ds, data_info, drafter, config, norm_w, eps,
                lm_head, vocab, plan, total_steps, warmup, optimizer, scheduler, dp)


def _planned_batches(plan: BatchPlan, steps: int):
    """The batches (lists of sequence indices) of the first ``steps`` global steps."""
    epoch = 0
    while steps > 0:
        batches = plan.epoch(epoch)[:steps]
        yield from batches
        steps -= len(batches)
        epoch += 1


def _seeded_model(args: TrainArgs, target: Path, target_config: dict[str, Any], device: torch.device):
    """(model, config, norm_w [H], eps, lm_head [V, H] in compute_dtype): the model built
    right after seeding, on ``device``, bound to the target's frozen LM head (and, for the
    baselines, its embedding)."""
    from vllm_clover.training.features import load_target_head

    seed_all(args.seed)
    drafter, config = build_model_for_target(args, target, target_config)
    if args.init_from is not None:
        load_trained_heads(drafter, args.init_from, target_config)
        log(f"initialised from the trained heads in {args.init_from}")
    norm_w, eps, lm_head, embed = load_target_head(target, dtype=torch.float32)
    norm_w, lm_head, embed = (t.to(device) for t in (norm_w, lm_head, embed))
    drafter.to(device)
    if args.method == "clover":
        # E = lm_head weight as in the official code; the LM-head products run in compute_dtype.
        drafter.bind_target(lm_head)
    else:
        drafter.bind_target(lm_head, embed)  # EAGLE reads the target's embedding, as vLLM shares it
    return drafter, config, norm_w, eps, lm_head.to(getattr(torch, args.compute_dtype))


def _match_token_values(drafter: CloverDrafter, ds: FeatureChunks, plan: BatchPlan, device: torch.device) -> None:
    """``--token-value-init matched``: scale the token value projections to the states they
    are added to, measured on the first batch."""
    first = to_device(ds.collate(plan.epoch(0)[0]), device)
    scales = match_token_value_scale(drafter, token_state_rms(drafter, first), rms(drafter.embed_weight))
    log("token value projections initialised as s*I: " + ", ".join(f"{k} s={v:.1f}" for k, v in scales.items()))


def _train_loop(run: _Run, stop_after: int | None, progress: bool, deadline: float | None = None) -> bool:
    """Train from ``run.step`` to ``run.total_steps``, checkpointing every ``save_every``
    steps; False when ``stop_after`` steps of this call or the deadline stopped it early.
    Each rank trains on its share of every batch; the ranks agree before each step whether
    to pause or stop (:func:`_agreed_stop`), so they all stop at the same step."""
    args, dp = run.args, run.dp
    run.drafter.train()
    bar = _progress_bar(run) if progress and dp.is_main else None
    t_loop = time.perf_counter()
    done_here = 0
    try:
        while run.step < run.total_steps:
            reason = _agreed_stop(dp, deadline)
            if reason is not None:
                _checkpoint(run, run.elapsed_before + time.perf_counter() - t_loop)
                dp.barrier()  # no rank leaves before the checkpoint is on disk
                if reason == "signal":
                    raise TrainingError(f"interrupted at step {run.step}; continue with --resume")
                log(f"deadline reached at step {run.step}/{run.total_steps}; continue with --resume")
                return False
            epoch, j = run.plan.locate(run.step)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            batch = to_device(run.ds.collate(dp.share(run.plan.epoch(epoch)[j])), run.device)
            record = train_step(run.drafter, run.optimizer, run.scheduler, batch, run.norm_w, run.eps,
                                run.lm_head, run.vocab, args, dp)
            run.step += 1
            done_here += 1
            # CPU time next to wall time: on a shared machine the two differ a lot.
            run.history.append({"step": run.step, "epoch": epoch, **record,
                                "wall_s": round(time.perf_counter() - wall0, 3),
                                "cpu_s": round(time.process_time() - cpu0, 3)})
            if bar is not None:
                recent = _window_metrics(run.history, 20)
                bar.set_postfix_str(f"loss={recent['loss']:.3f} acc={_fmt_acc(recent['acc'])}", refresh=False)
                bar.update(1)
            if run.step % args.save_every == 0 or run.step == run.total_steps or done_here == stop_after:
                _checkpoint(run, run.elapsed_before + time.perf_counter() - t_loop)
            if stop_after is not None and done_here >= stop_after and run.step < run.total_steps:
                dp.barrier()
                return False
    except KeyboardInterrupt:  # one process: Ctrl-C / SIGTERM (the CLI maps it) land here
        _checkpoint(run, run.elapsed_before + time.perf_counter() - t_loop)
        raise TrainingError(f"interrupted at step {run.step}; continue with --resume") from None
    finally:
        if bar is not None:
            bar.close()
    run.train_seconds = run.elapsed_before + time.perf_counter() - t_loop
    return True


def _agreed_stop(dp: DataParallel, deadline: float | None) -> str | None:
    """Why the run stops before this step ("signal": SIGTERM / SIGINT under several
    processes; "deadline": ``--stop-at`` passed) or None to go on, the same answer on every
    rank (a flag any rank raises counts for all). Sleeps while any rank sees the pause file,
    agreeing again every 2 s, so no rank waits in a collective meanwhile."""
    path = os.environ.get(PAUSE_ENV)
    paused_before = False
    while True:
        paused = bool(path) and os.path.exists(path)
        late = deadline is not None and time.time() >= deadline
        signalled, late, paused = dp.any_rank([dp.signalled, late, paused])
        if signalled or late:
            return "signal" if signalled else "deadline"
        if not paused:
            if paused_before:
                log("resumed")
            return None
        if not paused_before:
            mine = bool(path) and os.path.exists(path)
            log(f"paused while {path} exists" if mine else "paused while another rank's pause file exists")
            paused_before = True
        time.sleep(2.0)


def _wait_while_paused() -> None:
    """Sleep while the pause file (``$VLLM_CLOVER_PAUSE_FILE``) exists (one process)."""
    path = os.environ.get(PAUSE_ENV)
    if not path or not os.path.exists(path):
        return
    log(f"paused while {path} exists")
    while os.path.exists(path):
        time.sleep(2.0)
    log("resumed")


def _progress_bar(run: _Run):
    from tqdm import tqdm

    return tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step", file=sys.stderr,
                dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)


def _finish(run: _Run, timings: dict[str, float], t_start: float) -> dict[str, Any]:
    """Write the final model (and Clover's draft vocabulary), training.json and
    history.jsonl; drop the checkpoint unless ``--keep-checkpoint``. Returns the report.
    Rank 0 alone writes; the others wait until it has."""
    args, out = run.args, run.out
    run.drafter.cpu()
    report = _report(run, timings, t_start)
    if run.dp.is_main:
        save_model(out, run.drafter, run.config, args.method, run.target, run.target_config)
        if args.method == "clover":
            from vllm_clover.model.draft_vocab import save_draft_vocab

            save_draft_vocab(out, run.ds.token_ranking(run.config.vocab_size), run.data_info["source"])
        (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in run.history))
        if not args.keep_checkpoint:
            shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    run.dp.barrier()
    return report


def _report(run: _Run, timings: dict[str, float], t_start: float) -> dict[str, Any]:
    """The ``training.json`` content."""
    args, config, history, vocab = run.args, run.config, run.history, run.vocab
    final = _window_metrics(history, max(1, min(50, len(history) // 10 or 1)))
    return {
        "command": args.command,
        "args": asdict(args),
        "target": {"dir": str(run.target), "architecture": (run.target_config.get("architectures") or [None])[0],
                   "hidden_size": config.hidden_size, "vocab_size": config.vocab_size},
        "device": device_name(run.device),
        "world_size": run.dp.world_size,  # processes (ranks) sharing each batch
        "data": run.data_info,
        "steps": run.total_steps,
        "warmup_steps": run.warmup,
        "epochs_covered": round(run.plan.epochs_covered(run.total_steps), 3),
        "train_vocab": ({"base": int(len(vocab)), "mean_per_step": round(float(np.mean(
            [h["vocab"] for h in history])), 1)} if vocab is not None else "full"),
        "wall_time_s": {"data": round(timings["data"], 1), "features": round(timings["features"], 1),
                        "training": round(run.train_seconds, 1),
                        "training_cpu": round(sum(h.get("cpu_s", 0.0) for h in history), 1),
                        "total_this_call": round(time.perf_counter() - t_start, 1)},
        "final_train_metrics": {"window_steps": final["steps"], "loss": round(final["loss"], 4),
                                "acc_per_head": [round(a, 4) for a in final["acc"]]},
        "num_trainable_params": sum(p.numel() for p in run.drafter.parameters() if p.requires_grad),
        "threads": args.threads,
        "versions": {"torch": torch.__version__},
    }


def train_step(drafter: CloverDrafter, optimizer, scheduler, batch: dict[str, Tensor], norm_w: Tensor,
               eps: float, lm_head: Tensor, vocab: Tensor | None, args: TrainArgs,
               dp: DataParallel | None = None) -> dict[str, Any]:
    """One optimizer step on a ``collate_features`` batch; returns its history record.

    With ``dp`` of several ranks, ``batch`` is this rank's share of the global batch: the
    loss's per-head denominators, a ``--train-vocab`` subset and the gradients are combined
    over the ranks so the step equals one process's step on the whole batch, and the record
    holds the whole batch's loss and counts.

    x [B, T, H] (bf16 cache) -> fp32 drafter under autocast to ``args.compute_dtype``
    (bf16; none for float32) (Medusa / EAGLE get
    h-bar_t = RMSNorm(x_t) instead, what vLLM feeds them); targets h-bar_{t+1} [B, T, H] from
    the target's final norm; loss and backward by clover_loss_backward over the full
    vocabulary or this batch's subset (``vocab`` = base subset, see batch_vocab), with the
    method's loss weights (:func:`loss_settings`).
    """
    from vllm_clover.training.features import rms_norm, shifted_postnorm_targets

    if getattr(drafter, "input_kind", "prenorm") == "postnorm":
        x = rms_norm(batch["x"], norm_w, eps)
    else:
        x = batch["x"].float()
    target_hidden = shifted_postnorm_targets(batch["x"], batch["lengths"], norm_w, eps)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.compute_dtype == "bfloat16"):
        outputs = drafter.forward_train(x, batch["input_ids_shifted"], batch["attention_mask"])
    optimizer.zero_grad(set_to_none=True)
    if vocab is None or args.draft_vocab:
        step_vocab = vocab  # the full vocabulary, or the served draft vocabulary as it is
    else:
        step_vocab = batch_vocab(vocab, target_hidden, batch["loss_mask"], batch["input_ids"], lm_head)
    denoms = None
    if dp is not None and dp.enabled:
        if step_vocab is not None and not args.draft_vocab:
            step_vocab = dp.union(step_vocab)  # the whole batch's subset, as one process
        # The whole batch's trained rows per head, + 1 (the official denominators).
        denoms = (dp.sum(head_row_counts(batch["loss_mask"], len(outputs))) + 1.0).tolist()
    decay, v_w, p_w = loss_settings(args)
    loss, m = clover_loss_backward(outputs, target_hidden, lm_head, batch["loss_mask"],
                                   decay, v_w, p_w, vocab=step_vocab, chunk_rows=loss_chunk_rows(x.device),
                                   denoms=denoms)
    params = [p for p in drafter.parameters() if p.requires_grad]
    if dp is not None and dp.enabled:
        dp.sum_gradients(params)
        loss, m = _summed_metrics(dp, loss, m)
    torch.nn.utils.clip_grad_value_(params, args.grad_clip_value)
    optimizer.step()
    scheduler.step()
    return {"loss": loss,
            "vloss": [round(v, 5) for v in m["vloss"].tolist()],
            "ploss": [round(v, 5) for v in m["ploss"].tolist()],
            "correct": m["correct"].tolist(), "total": m["total"].tolist(),
            "vocab": drafter.config.vocab_size if step_vocab is None else len(step_vocab),
            "lr": scheduler.get_last_lr()[0]}


def _summed_metrics(dp: DataParallel, loss: float, m: dict[str, Tensor]) -> tuple[float, dict[str, Tensor]]:
    """The whole batch's loss and per-head metrics from each rank's share (the shares' loss
    terms already carry the whole batch's denominators, so they add up)."""
    k = len(m["total"])
    # On the CPU: vloss is on the training device, the counts on the CPU (dp.sum moves them).
    parts = torch.cat([torch.tensor([loss], dtype=torch.float64)] +
                      [m[key].to("cpu", torch.float64) for key in ("vloss", "ploss", "correct", "total")])
    total = dp.sum(parts)
    out = {key: total[1 + i * k:1 + (i + 1) * k].to(torch.float32)
           for i, key in enumerate(("vloss", "ploss", "correct", "total"))}
    out["acc"] = out["correct"] / out["total"].clamp(min=1.0)
    return float(total[0]), out


def _window_metrics(history: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Mean loss and pooled per-head accuracy over the last ``n`` steps."""
    recent = history[-n:]
    correct = np.sum([h["correct"] for h in recent], axis=0)
    total = np.maximum(np.sum([h["total"] for h in recent], axis=0), 1)
    return {"steps": len(recent), "loss": float(np.mean([h["loss"] for h in recent])),
            "acc": (correct / total).tolist()}


def _linear_warmup_decay(warmup: int, total: int) -> Callable[[int], float]:
    """transformers' get_linear_schedule_with_warmup as a plain lambda."""
    def factor(step: int) -> float:
        if step < warmup:
            return float(step + 1) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    return factor


def _fmt_acc(acc: Sequence[float]) -> str:
    return "/".join(f"{a:.2f}" for a in acc)


# ============================================================================ checkpoint (exact resume)
def seed_all(seed: int) -> None:
    """Seed torch, Python's and numpy's generators (a run's draws start here)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])



def save_training_state(out: Path, drafter: CloverDrafter, optimizer, scheduler, step: int,
                        args: TrainArgs, history: list[dict[str, Any]], elapsed: float,
                        rng_ranks: list[dict[str, Any]] | None = None) -> Path:
    """Write ``<out>/checkpoint/`` (model fp32, optimizer, scheduler, RNG) as safetensors +
    JSON (:mod:`~vllm_clover.training.state`); returns the directory. ``rng_ranks``: every
    rank's RNG state of a data-parallel run, in rank order (``rng`` is then rank 0's)."""
    state = {"model": drafter.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "step": step,
             "rng": _rng_state(),  # the caller's: rank 0's in a data-parallel run
             "args": args.resume_key(), "history": history, "elapsed": elapsed}
    if rng_ranks:
        state["rng_ranks"] = rng_ranks
    save_state(out / CHECKPOINT_DIR, state, step)
    return out / CHECKPOINT_DIR


def _checkpoint(run: _Run, elapsed: float) -> None:
    """Every rank calls this (its RNG state goes to rank 0); rank 0 writes the checkpoint."""
    rngs = run.dp.gather(_rng_state())
    if run.dp.is_main:
        save_training_state(run.out, run.drafter, run.optimizer, run.scheduler, run.step, run.args,
                            run.history, elapsed, rngs if run.dp.enabled else None)


def _restore_training_state(run: _Run, state_path: Path) -> None:
    """Load model, optimizer, scheduler, progress and RNG state from ``state_path``;
    refuses a checkpoint made with other settings (``TrainArgs.resume_key``)."""
    args = run.args
    try:
        state = load_state(state_path, run.device)
    except StateError as exc:
        raise TrainingError(f"--resume: {exc}") from None
    if state["args"] != args.resume_key():
        diff = sorted(k for k in args.resume_key() if state["args"].get(k) != args.resume_key()[k])
        raise TrainingError(f"--resume: {state_path} was made with different settings ({', '.join(diff)})")
    run.drafter.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.step, run.history, run.elapsed_before = state["step"], state["history"], state["elapsed"]
    _set_rng_state(_rank_rng_state(state, getattr(run, "dp", None)))
    log(f"resumed {run.out} at step {run.step}/{run.total_steps}")


def _rank_rng_state(state: dict[str, Any], dp: DataParallel | None) -> dict[str, Any]:
    """This rank's RNG state in a checkpoint: its own when the checkpoint holds one per rank
    for the same number of ranks, else rank 0's (the loop draws no random numbers, so weights
    do not depend on it; the state is kept so that code which does draw resumes exactly)."""
    ranks = state.get("rng_ranks")
    if dp is not None and ranks and len(ranks) == dp.world_size:
        return ranks[dp.rank]
    return state["rng"]
