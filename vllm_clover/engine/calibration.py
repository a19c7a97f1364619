"""What a step costs on this machine: the target against its verify rows, the drafter per head step.

The adaptive tree (``tree: "adaptive"``, vllm_clover/engine/adaptive.py) picks each step's shape
from these costs and the acceptance it observes. They are measured once per (model, dtype,
machine, vLLM version), right after vLLM's own warm-up (patch ``worker-calibrate-after-warm-up``,
which calls :func:`calibrate` from the worker's ``compile_or_warm_up_model``), and cached as JSON
under ``$VLLM_CLOVER_CACHE/calibration/`` so that a restart reuses them.

What is measured, each point the fastest of two timed runs after one untimed, the curves
made non-decreasing (:func:`monotone`), in at most about :data:`BUDGET_S` seconds:

* ``target_ms[T]``: vLLM's own dummy forward of the target over T tokens
  (``GPUModelRunner._dummy_run``: the same compiled / eager path and linear kernels as a real
  step, attention metadata left out) plus the LM head over those T rows (``compute_logits``),
  for T on :data:`TOKEN_GRID`. A verify step of B requests with r_i rows each costs about
  ``target(sum r_i)``; attention over the context and the engine's per-step bookkeeping are
  not in it: :class:`adaptive.StepClock` learns them online as the difference between the
  measured step and this curve.
* ``head_ms[M]``: one head step of the drafter plus its draft LM head over M rows, and
  ``trunk_ms[M]``: the drafter's trunk over M rows (attention metadata left out), for M on
  :data:`ROW_GRID`.

The curve is plain data (:class:`CostCurve`); the unit tests build synthetic ones (a CPU-like
curve whose rows cost compute, a GPU-like flat one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from vllm_clover.engine.vocab_parallel import from_first_rank, is_first_rank, tp_group

logger = logging.getLogger(__name__)

# Total verify tokens per step the target curve is measured at (capped by the engine's
# max_num_batched_tokens); beyond the last point the curve goes on with its last slope.
TOKEN_GRID = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64, 96, 128)
# Rows the drafter's head step and trunk are measured at.
ROW_GRID = (1, 2, 4, 8, 16, 32, 64, 128)
# Seconds the target's curve may take: past it the larger token counts are left out (the curve
# goes on with its last slope). The points up to MIN_TOKENS are always measured.
BUDGET_S = 6.0
MIN_TOKENS = 16
# Set to 1 to measure again although a cached curve matches (e.g. after it was measured on a
# machine busy with other work).
RECALIBRATE_ENV = "VLLM_CLOVER_RECALIBRATE"
# Bump when what is measured changes, so that cached curves are measured again.
CURVE_VERSION = 1


def interp(x: Any, xs: Sequence[float], ys: Sequence[float]) -> np.ndarray:
    """Piecewise-linear through (xs, ys) at x (a number or an array), extended past the
    last point with the steeper of the last segment's slope and the mean slope over the upper
    half of the points (a last segment flattened by :func:`monotone` must not make rows past
    the curve look free), and below the first towards 0."""
    x = np.asarray(x, dtype=np.float64)
    xs_, ys_ = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    out = np.interp(x, xs_, ys_)
    if len(xs_) > 1:
        mid = int(np.searchsorted(xs_, xs_[-1] / 2, side="right")) - 1
        mid = min(max(mid, 0), len(xs_) - 2)
        slope = max(0.0, (ys_[-1] - ys_[-2]) / (xs_[-1] - xs_[-2]), (ys_[-1] - ys_[mid]) / (xs_[-1] - xs_[mid]))
        out = np.where(x > xs_[-1], ys_[-1] + slope * (x - xs_[-1]), out)
    out = np.where(x < xs_[0], ys_[0] * np.clip(x, 0, None) / xs_[0], out)
    return out


@dataclass
class CostCurve:
    """Measured step costs, milliseconds (see the module docstring)."""

    tokens: list[int]
    target_ms: list[float]
    rows: list[int]
    head_ms: list[float]
    trunk_ms: list[float]
    key: dict[str, Any] = field(default_factory=dict)
    measure_s: float = 0.0  # wall time the measurement took

    def target(self, tokens: Any) -> Any:
        """Target forward + LM head over ``tokens`` verify tokens (all requests together);
        a number or an array of them."""
        out = interp(tokens, self.tokens, self.target_ms)
        return float(out) if out.ndim == 0 else out

    def head(self, rows: Any) -> Any:
        """One head step + draft LM head over ``rows`` rows (0 rows: nothing)."""
        out = np.where(np.asarray(rows) > 0, interp(rows, self.rows, self.head_ms), 0.0)
        return float(out) if out.ndim == 0 else out

    def trunk(self, rows: Any) -> Any:
        """The drafter's trunk over ``rows`` rows (0 rows: nothing)."""
        out = np.where(np.asarray(rows) > 0, interp(rows, self.rows, self.trunk_ms), 0.0)
        return float(out) if out.ndim == 0 else out

    def summary(self) -> str:
        """One log line: the target at a few token counts, the drafter at 1 row."""
        points = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= self.tokens[-1]]
        target = ", ".join(f"{t}: {self.target(t):.1f}" for t in points)
        return (f"target ms by verify tokens {{{target}}}; head step {self.head(1):.2f} ms, "
                f"trunk {self.trunk(1):.2f} ms at 1 row")

    def to_json(self) -> str:
        return json.dumps({"version": CURVE_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostCurve:
        data = json.loads(text)
        if data.pop("version", None) != CURVE_VERSION:
            raise ValueError("calibration file of another version")
        return cls(**data)


# ============================================================================ cache
def machine_id() -> str:
    """The device the costs belong to: the GPU's name, or the CPU's model name, its vector
    flags and the threads torch computes with."""
    import torch

    if torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(0)}"
    from vllm_clover.cpu.env import cpu_flags

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    linear = os.environ.get("VLLM_CLOVER_CPU_LINEAR", "1")
    return f"cpu {model} [{' '.join(flags)}] threads={torch.get_num_threads()} linear={linear}"


def curve_key(vllm_config: Any, checkpoint: str, draft_vocab_size: int) -> dict[str, Any]:
    """What a cached curve must match: model, dtype, machine, vLLM, the drafter."""
    import vllm

    mc = vllm_config.model_config
    return {"model": str(mc.model), "dtype": str(mc.dtype).removeprefix("torch."),
            "max_model_len": int(mc.max_model_len), "machine": machine_id(), "vllm": vllm.__version__,
            "eager": bool(mc.enforce_eager), "drafter": str(checkpoint), "draft_vocab_size": draft_vocab_size,
            "tensor_parallel_size": int(vllm_config.parallel_config.tensor_parallel_size)}


def cache_path(key: dict[str, Any]) -> Path:
    """``$VLLM_CLOVER_CACHE/calibration/<model>-<hash of the key>.json``."""
    from vllm_clover.default_model import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{Path(key['model']).name}-{digest}.json"


def load_cached(key: dict[str, Any]) -> CostCurve | None:
    """The cached curve for ``key``, or None (absent, unreadable or for another key)."""
    path = cache_path(key)
    try:
        curve = CostCurve.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None
    return curve if curve.key == key else None


def store(curve: CostCurve) -> Path | None:
    """Write ``curve`` to its cache file (atomically); None where the folder is not writable."""
    path = cache_path(curve.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(curve.to_json())
        tmp.replace(path)
    except OSError as exc:
        logger.warning("vllm-clover: could not cache the calibration in %s (%s)", path, exc)
        return None
    return path


# ============================================================================ measuring
def time_ms(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Fastest wall time of ``fn`` over ``repeats`` runs after one untimed run, in ms (other
    work on the machine only ever adds time)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def monotone(values: Sequence[float]) -> list[float]:
    """A step never costs less for more rows: each point capped by every later one (noise
    spikes of a busy machine removed)."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def measure(runner: Any, drafter: Any, key: dict[str, Any]) -> CostCurve:
    """Time the target (:func:`time_ms` of ``runner._dummy_run`` + ``compute_logits``) and
    the drafter (head step + draft LM head, trunk) on the grids, for this engine."""
    import torch
    from vllm.forward_context import set_forward_context

    t_start = time.perf_counter()
    device = torch.device(drafter.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    max_tokens = int(runner.max_num_tokens)
    tokens = [t for t in TOKEN_GRID if t <= max_tokens] or [1]
    model = runner.get_model()

    def target(t: int) -> None:
        hidden, _ = runner._dummy_run(t)
        model.compute_logits(hidden[:t])

    target_ms = []
    for t in tokens:
        # Under tensor parallelism every rank runs the same forward passes (they are
        # collectives): rank 0's clock says when to stop.
        over = t > MIN_TOKENS and time.perf_counter() - t_start > BUDGET_S
        if from_first_rank([int(over)])[0]:
            break
        target_ms.append(time_ms(lambda: target(t), 2, sync))
    tokens = tokens[: len(target_ms)]
    hidden_size = drafter.hidden_size
    rows = [m for m in ROW_GRID if m <= max(max_tokens, 1)]
    head_ms, trunk_ms = [], []
    cfg = drafter.vllm_config
    with torch.inference_mode():
        for m in rows:
            state = torch.zeros((m, hidden_size), dtype=drafter.dtype, device=device)
            token = torch.zeros(m, dtype=torch.long, device=device)
            positions = torch.arange(m, dtype=torch.long, device=device)

            def head() -> None:
                _, o = drafter.model.head_step(state, token, 0)
                drafter._draft_logits(o)

            def trunk() -> None:
                with set_forward_context(None, cfg, num_tokens=m):
                    drafter.model.trunk(state, token, positions)

            head_ms.append(time_ms(head, 2, sync))
            trunk_ms.append(time_ms(trunk, 2, sync))
    return CostCurve(tokens=tokens, target_ms=monotone(target_ms), rows=rows, head_ms=monotone(head_ms),
                     trunk_ms=monotone(trunk_ms), key=key, measure_s=time.perf_counter() - t_start)


def calibrate(runner: Any, drafter: Any) -> CostCurve:
    """The cost curve of this engine: from the cache when one matches, else measured now and
    cached. Logs what it measured and how long that took."""
    key = curve_key(drafter.vllm_config, drafter.options.checkpoint, drafter.options.draft_vocab_size)
    curve = None if os.environ.get(RECALIBRATE_ENV) == "1" else load_cached(key)
    # Under tensor parallelism rank 0 decides (cached or measured) and every rank takes its
    # curve: the adaptive choice is rank 0's on every rank (adaptive.py).
    if from_first_rank([int(curve is not None)])[0]:
        if is_first_rank():
            logger.info("vllm-clover: adaptive tree costs from %s (measured in %.1f s when cached): %s",
                        cache_path(key), curve.measure_s, curve.summary())
        return first_rank_curve(curve)
    curve = measure(runner, drafter, key)
    if is_first_rank():
        path = store(curve)
        logger.info("vllm-clover: adaptive tree calibration took %.1f s (cached in %s): %s",
                    curve.measure_s, path, curve.summary())
    return first_rank_curve(curve)


def first_rank_curve(curve: CostCurve | None) -> CostCurve:
    """Tensor-parallel rank 0's ``curve`` on every rank (``curve`` itself with one rank)."""
    group = tp_group()
    if group is None:
        return curve
    return CostCurve.from_json(group.broadcast_object(curve.to_json() if group.rank_in_group == 0 else None, src=0))


# ============================================================================ the hook
def wrap_compile_or_warm_up(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``Worker.compile_or_warm_up_model`` (GPU and CPU workers): vLLM's warm-up (compilation,
    CUDA graphs), then the Clover drafter's calibration where it runs the adaptive tree, while
    the KV cache exists and before the first request."""
    import functools

    @functools.wraps(orig)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        if getattr(drafter, "is_clover", False):
            drafter.calibrate(runner)
        return out

    return compile_or_warm_up_model
