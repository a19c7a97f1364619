"""The adaptive tree (``tree: "adaptive"``): each step's shape from measured costs and observed acceptance.

Per step the proposer asks :class:`AdaptiveTree` for a :class:`Shape`: the heads' tree (the
``n`` most promising nodes among the heads' top-k candidates, :data:`RANKS` per depth), the
lookup tokens ``L`` grafted beside it, or no speculation at all. The choice maximises expected
accepted tokens per second of the whole batch:

    rate(n, L) = E[tokens of the step] / (target(T) + draft(n) + overhead)

* ``E[tokens]`` comes from :class:`AcceptanceStats`: per depth d and rank k the probability
  q[d][k] that the heads' rank-k child of an accepted depth-d node is the target's token
  (siblings are exclusive), so a node's chance to be accepted is the product of q along its
  path and P(heads reach depth t) = H_t is the sum over the tree's depth-t nodes; and per
  lookup source (prompt lookup, n-gram datastore) and depth t the probability Lc[t] that the
  lookup chain reaches depth t where the heads do not. A request whose lookup chain has l
  tokens then expects ``1 + sum_t H_t + sum_{t <= min(L, l)} (1 - H_t) Lc[t]`` tokens (the
  accepted path is the target's own tokens, so it lies in the heads' tree or on the chain).
* ``T = sum over requests of 1 + n + min(L, l)`` verify tokens, priced by the start-up
  calibration (vllm_clover/engine/calibration.py); ``draft(n)`` = the trunk over the
  accepted rows + one head step per depth over the nodes it expands, from the same
  calibration, scaled by the ratio of the proposer's measured drafting time to that
  prediction (:class:`StepClock`); ``overhead(T)`` = what a step costs beyond both, learnt per
  batch size from the measured time between drafting calls: a part plain steps pay too
  (sampling, the engine's bookkeeping) plus a part per verify row beyond one per request
  (attention over the context, tree attention, rejection). A plain step now and then at each
  batch size (:meth:`AdaptiveTree.probe_plain`) keeps the first part measured.
* Plain decoding (no drafts, the trunk skipped) makes ``B / (target(B) + overhead(B))``;
  speculation must beat it by :data:`SWITCH_MARGIN`. As the batch grows every verified row
  costs more and its expected gain stays the same, so trees shrink, then chains, then off.

With the option ``adaptive_chain`` the candidates are the heads' top-1 chain only
(:data:`CHAIN_RANKS`) and no lookup tokens: each step drafts a chain of 0..K tokens that vLLM's
own rejection sampler verifies, so the same choice runs where tree verification cannot (CUDA
graphs, any dtype; the GPU serve default).

Nothing in it is CPU-specific: a flat (GPU-like) cost curve makes large trees pay, a steep
(CPU-like) one small trees; tests/unit/engine/test_adaptive.py checks both on synthetic curves.
Estimates start from the checkpoint's held-out evaluation (``eval_*.json`` beside the heads,
:func:`heads_prior`) or :data:`DEFAULT_HEAD_ACCEPTANCE`, and follow the served traffic as
exponentially decayed counts. The choice changes only what is drafted, never how it is
verified, so outputs stay the target's (tests/e2e/test_adaptive.py forces changes per step).
"""

from __future__ import annotations

import functools
import heapq
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from vllm_clover.drafting.tree import StaticTree
from vllm_clover.engine.calibration import CostCurve
from vllm_clover.engine.vocab_parallel import from_first_rank, is_first_rank, tp_group

logger = logging.getLogger(__name__)

# Children considered per depth (depth 1 first): the candidates the adaptive tree picks from.
RANKS = (4, 3, 2, 2, 2, 1, 1, 1)
# The chain's candidates (option ``adaptive_chain``): the top-1 child at every depth, so each
# choice is a chain of 0..K heads tokens that vLLM's own sampler verifies.
CHAIN_RANKS = (1,)
# Prior acceptance where the checkpoint has no held-out evaluation: head d's top-1 given the
# path to it was accepted (the shipped heads' evaluation gives 0.42-0.52, eval_selfdistill*.json).
DEFAULT_HEAD_ACCEPTANCE = 0.45
# Prior for a lower-ranked child: rank k+1 is accepted this fraction as often as rank k. Only the
# top-1 chain is in a held-out evaluation; the online counts replace this within a few dozen steps.
SIBLING_RATIO = 0.35
# Prior P(the lookup chain reaches depth t | the heads do not), as (depth 1, each further depth
# given the previous): a prompt-lookup match continues the text it copies; the datastore's
# table guesses common continuations. Replaced by the online counts like the heads' prior.
LOOKUP_PRIOR = {"prompt": (0.5, 0.7), "datastore": (0.2, 0.5)}
# Observations the prior counts for, and the decay of every count per step (memory ~ 1/(1-decay)).
PRIOR_WEIGHT = 24.0
DECAY = 0.995
# Speculation must beat plain decoding's expected rate by this fraction (hysteresis against
# switching on where the gain is within the model's error).
SWITCH_MARGIN = 0.03
# The node order (best first) is recomputed from the estimates every this many steps.
REORDER_EVERY = 16
# After a drafting step, a gap between drafting calls past this (ms, and past 4x the step's
# prediction) is an idle engine, not the step's overhead.
IDLE_MS = 1500.0
# A step without drafts at each batch size at least this many drafting calls apart measures
# what plain decoding costs there (AdaptiveTree.probe_plain).
PLAIN_PROBE_EVERY = 128
# Drafting steps measured at a batch size before their realised rate may veto speculation there,
# and the drafting calls a veto lasts before speculation there is tried (and measured) again.
MIN_DRAFTING_SAMPLES = 4
VETO_CALLS = 512


# ============================================================================ the prior
def heads_prior(checkpoint: str | Path, num_heads: int, draft_vocab_size: int = 0) -> list[float]:
    """q[d][0] for d < num_heads from the checkpoint's held-out evaluation: the chain
    acceptance rates per position (``chain[-1].acceptance_rate_per_position``, P(the first d+1
    drafts accepted)) of the ``eval_*.json`` made with this draft vocabulary (else any), as
    conditionals; :data:`DEFAULT_HEAD_ACCEPTANCE` where none is readable."""
    evals = sorted(Path(checkpoint).glob("eval_*.json"))
    chosen = None
    for path in evals:
        try:
            data = json.loads(path.read_text())
            rates = data["chain"][-1]["acceptance_rate_per_position"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue
        dv = (data.get("args") or {}).get("draft_vocab_size") or 0
        if chosen is None or dv == draft_vocab_size:
            chosen = rates
    q = [DEFAULT_HEAD_ACCEPTANCE] * num_heads
    if chosen:
        prev = 1.0
        for d, r in enumerate(chosen[:num_heads]):
            q[d] = float(min(0.95, max(0.02, r / prev))) if prev > 0 else DEFAULT_HEAD_ACCEPTANCE
            prev = r
    return q


# ============================================================================ statistics
class AcceptanceStats:
    """Exponentially decayed hit / trial counts of the heads' nodes and the lookup slots.

    heads [D, K]: trials = times the rank-k child of an accepted depth-d heads node was
    drafted, hits = times it was the target's token. lookup[source] [Lmax]: trials = steps
    whose chain had >= t tokens and whose heads did not reach depth t, hits = the chain did.
    """

    def __init__(self, head_prior: Sequence[float], max_lookup: int, weight: float = PRIOR_WEIGHT,
                 decay: float = DECAY) -> None:
        depth = len(head_prior)
        width = max(RANKS[:depth]) if depth else 1
        self.decay = decay
        prior = np.array([[p * SIBLING_RATIO ** k for k in range(width)] for p in head_prior]).reshape(depth, width)
        self.head_trials = np.full((depth, width), weight)
        self.head_hits = prior * weight
        self.lookup_trials: dict[str, np.ndarray] = {}
        self.lookup_hits: dict[str, np.ndarray] = {}
        for source, (first, further) in LOOKUP_PRIOR.items():
            rates = first * further ** np.arange(max(max_lookup, 1))
            self.lookup_trials[source] = np.full(max(max_lookup, 1), weight)
            self.lookup_hits[source] = rates * weight

    def step(self) -> None:
        """One step passed: every count decays."""
        self.head_trials *= self.decay
        self.head_hits *= self.decay
        for source in self.lookup_trials:
            self.lookup_trials[source] *= self.decay
            self.lookup_hits[source] *= self.decay

    def head_rates(self) -> np.ndarray:
        """q [D, K]: non-increasing in rank, each row summing to at most 1."""
        q = self.head_hits / np.maximum(self.head_trials, 1e-9)
        q = np.minimum.accumulate(np.clip(q, 0.0, 1.0), axis=1)
        total = q.sum(axis=1, keepdims=True)
        return np.where(total > 1.0, q / np.maximum(total, 1e-9), q)

    def lookup_rates(self, source: str) -> np.ndarray:
        """Lc [Lmax] for one source (index t-1 for depth t), non-increasing."""
        rate = self.lookup_hits[source] / np.maximum(self.lookup_trials[source], 1e-9)
        return np.minimum.accumulate(np.clip(rate, 0.0, 1.0))

    def observe(self, children: list[list[int]], heads_tokens: Sequence[int], chain: Sequence[int],
                source: str, accepted: Sequence[int], heads_valid: bool = True) -> None:
        """One request's verified step. ``children``: the heads tree's child lists by node
        (node 0 = root, siblings in rank order); ``heads_tokens`` [N]: its node tokens (node n
        = heads_tokens[n-1]); ``chain``: the lookup tokens grafted from the root; ``accepted``:
        the draft tokens the target accepted, in order; ``heads_valid``: False where the
        drafter's trunk missed steps of this request (its heads then guess from stale state)."""
        a_h, node = 0, 0
        while True:
            kids = [c for c in children[node] if c <= len(heads_tokens)] if node < len(children) else []
            if not kids or a_h >= self.head_trials.shape[0]:
                break
            want = accepted[a_h] if a_h < len(accepted) else None
            hit = next((r for r, c in enumerate(kids) if heads_tokens[c - 1] == want), None)
            if heads_valid:
                m = min(len(kids), self.head_trials.shape[1])
                self.head_trials[a_h, :m] += 1.0
                if hit is not None and hit < m:
                    self.head_hits[a_h, hit] += 1.0
            if hit is None:
                break
            node = kids[hit]
            a_h += 1
        if not chain or source not in self.lookup_trials:
            return
        a_l = 0
        while a_l < min(len(chain), len(accepted)) and chain[a_l] == accepted[a_l]:
            a_l += 1
        top = min(len(chain), self.lookup_trials[source].shape[0])
        for t in range(a_h + 1, top + 1):
            self.lookup_trials[source][t - 1] += 1.0
            if a_l >= t:
                self.lookup_hits[source][t - 1] += 1.0


# ============================================================================ the node order
@dataclass(frozen=True)
class NodeOrder:
    """The heads' candidate nodes, best first (a prefix is always a valid tree)."""

    paths: tuple[tuple[int, ...], ...]   # rank paths
    values: np.ndarray                   # [N] P(node accepted)
    depth_mass: np.ndarray               # [N+1, D]: H_t (column t-1) of the first n nodes
    expanded: np.ndarray                 # [N+1, D]: nodes of depth d expanded by the first n


def node_order(q: np.ndarray, max_nodes: int, ranks: Sequence[int] = RANKS) -> NodeOrder:
    """Best-first search over the top-k candidates (``ranks`` per depth, :data:`RANKS`; all 1:
    the top-1 chain) by path probability, a
    child's value never exceeding its parent's, so every prefix of the order is
    ancestor-closed and, q being non-increasing in rank, rank-contiguous."""
    depth = q.shape[0]
    counter = 0
    heap: list[tuple[float, int, tuple[int, ...]]] = []
    for k in range(min(ranks[0], q.shape[1])):
        heapq.heappush(heap, (-float(q[0, k]), counter, (k,)))
        counter += 1
    paths, values = [], []
    while heap and len(paths) < max_nodes:
        neg, _, path = heapq.heappop(heap)
        paths.append(path)
        values.append(-neg)
        d = len(path)
        if d < depth:
            for k in range(min(ranks[d] if d < len(ranks) else 1, q.shape[1])):
                heapq.heappush(heap, (neg * float(q[d, k]), counter, path + (k,)))
                counter += 1
    n = len(paths)
    mass = np.zeros((n + 1, max(depth, 1)))
    expanded = np.zeros((n + 1, max(depth, 1)))
    has_children: set[tuple[int, ...]] = set()
    for i, (path, value) in enumerate(zip(paths, values)):
        mass[i + 1] = mass[i]
        mass[i + 1, len(path) - 1] += value
        expanded[i + 1] = expanded[i]
        parent = path[:-1]
        if parent not in has_children:
            has_children.add(parent)
            expanded[i + 1, len(parent)] += 1
    return NodeOrder(paths=tuple(paths), values=np.array(values), depth_mass=mass, expanded=expanded)


@functools.lru_cache(maxsize=512)
def tree_of(paths: tuple[tuple[int, ...], ...]) -> StaticTree:
    """The StaticTree of a node-order prefix (cached: the same prefixes recur every step)."""
    return StaticTree(paths, name=f"adaptive{len(paths)}")


# ============================================================================ the clock
class StepClock:
    """What the calibration does not price, learnt from the proposer's own clock, and the ratio of
    measured to predicted drafting time.

    A decode step costs ``target(T) + draft + overhead``. The overhead has a part every step pays
    at a batch size B (sampling, scheduling, the engine's bookkeeping: ``plain_ms[B]``, learnt from
    steps without drafts) and a part each verify row beyond one per request adds (attention over
    the context, tree attention, KV compaction, rejection: ``row_ms[B]``, learnt from drafting
    steps against ``plain_ms``). Both matter: charging plain decoding a drafting step's overhead
    makes speculation look better the more rows it takes (docs/results/*-adaptive-quiet.md).

    It also keeps the realised rate, tokens produced per ms of whole steps, per batch size for
    plain and for drafting steps (``realised``): what the model predicts, measured. Where drafting
    has realised less than plain decoding, :meth:`AdaptiveTree.vetoed` turns speculation off at
    that batch size, whatever the model predicts (docs/adaptive.md, "Measured, not only predicted")."""

    ALPHA = 0.1

    def __init__(self) -> None:
        self.plain_ms: dict[int, float] = {}
        self.row_ms: dict[int, float] = {}
        self.draft_ratio = 1.0
        # (batch, drafting) -> (running mean of tokens per ms, samples behind it)
        self.realised: dict[tuple[int, bool], tuple[float, int]] = {}
        self._last: tuple[float, float, bool] | None = None  # (start time s, draft ms, drafting)

    @staticmethod
    def _nearest(table: dict[int, float], batch: int) -> float | None:
        if not table:
            return None
        return table[min(table, key=lambda b: (abs(np.log(b / batch)), b))]

    def overhead(self, batch: int, rows: Any = None) -> Any:
        """The learnt overhead (ms) of a step of ``batch`` requests verifying ``rows`` tokens in
        all (a number or an array; default ``batch``: plain decoding), from the nearest batch
        size measured (0 where nothing is)."""
        plain = self._nearest(self.plain_ms, batch) or 0.0
        if rows is None:
            return plain
        per_row = self._nearest(self.row_ms, batch) or 0.0
        return plain + per_row * np.maximum(np.asarray(rows, dtype=float) - batch, 0.0)

    def tick(self, now: float, batch: int, tokens: int, step_target_ms: float | None,
             produced: int = 0) -> None:
        """A drafting call starts at ``now`` (s) after a step of ``batch`` requests and ``tokens``
        verify tokens whose target pass the curve prices at ``step_target_ms`` (None: the step had
        prefill rows or is otherwise not a decode step; not learnt from), which produced
        ``produced`` tokens (0: not counted in the realised rate)."""
        if self._last is not None and step_target_ms is not None:
            start, draft_ms, drafting = self._last
            cycle_ms = (now - start) * 1e3
            sample = cycle_ms - draft_ms - step_target_ms
            # An idle engine (no request between two steps) is no step's overhead. A drafting
            # step far slower than its prediction is still a step (rows the model prices wrongly
            # must be learnt): for those only a gap past IDLE_MS counts as idle.
            bound = 4 * (step_target_ms + draft_ms) + 20
            if -step_target_ms < sample < (max(bound, IDLE_MS) if drafting else bound):
                sample = max(sample, 0.0)
                if produced > 0 and cycle_ms > 0:
                    key = (batch, drafting)
                    old, n = self.realised.get(key, (None, 0))
                    self.realised[key] = (self._mean(old, produced / cycle_ms), n + 1)
                if not drafting:
                    self._learn(self.plain_ms, batch, sample)
                elif tokens > batch and batch in self.plain_ms:
                    self._learn(self.row_ms, batch, max(sample - self.plain_ms[batch], 0.0) / (tokens - batch))
        self._last = None

    def realised_gain(self, batch: int) -> float | None:
        """Realised rate of drafting steps over plain steps at exactly ``batch`` (None until plain
        decoding has one sample there and drafting :data:`MIN_DRAFTING_SAMPLES`)."""
        plain, drafting = self.realised.get((batch, False)), self.realised.get((batch, True))
        if plain is None or drafting is None or drafting[1] < MIN_DRAFTING_SAMPLES:
            return None
        return drafting[0] / plain[0]

    def forget_drafting(self, batch: int) -> None:
        """Drop the realised drafting rate at ``batch`` (it is measured again when drafting resumes)."""
        self.realised.pop((batch, True), None)

    def _learn(self, table: dict, batch: Any, sample: float) -> None:
        table[batch] = self._mean(table.get(batch), sample)

    def _mean(self, old: float | None, sample: float) -> float:
        """The running mean after ``sample`` (the sample itself when there is none yet)."""
        return sample if old is None else old + self.ALPHA * (sample - old)

    def drafted(self, start: float, draft_ms: float, predicted_ms: float | None) -> None:
        """The drafting call that began at ``start`` took ``draft_ms``; ``predicted_ms``: what
        the model predicted for it (None: speculation was off)."""
        self._last = (start, draft_ms, predicted_ms is not None)
        if predicted_ms:
            ratio = min(5.0, max(0.5, draft_ms / predicted_ms))
            self.draft_ratio += self.ALPHA * (ratio - self.draft_ratio)


# ============================================================================ the choice
@dataclass(frozen=True)
class Shape:
    """One step's choice: ``tree`` the heads' nodes (None: none), ``lookup`` the lookup
    tokens per request at most; ``on`` False = no drafts and no trunk. ``rate`` and
    ``plain_rate``: the expected tokens per ms of the choice and of plain decoding."""

    tree: StaticTree | None
    lookup: int
    on: bool
    rate: float = 0.0
    plain_rate: float = 0.0
    predicted_draft_ms: float = 0.0


OFF = Shape(tree=None, lookup=0, on=False)


def encode_shape(shape: Shape, max_nodes: int) -> list[int]:
    """``shape`` as 3 + 2 * ``max_nodes`` ints: on, lookup, node count, then per node (BFS
    order) its parent's index in that order (-1: the root) and its rank; the rest -1."""
    paths = shape.tree.paths if shape.on and shape.tree is not None else ()
    if len(paths) > max_nodes:
        raise ValueError(f"a tree of {len(paths)} nodes does not fit {max_nodes}")
    index = {p: i for i, p in enumerate(paths)}
    out = [int(shape.on), shape.lookup, len(paths)]
    for p in paths:
        out += [index[p[:-1]] if len(p) > 1 else -1, p[-1]]
    return out + [-1] * (2 * (max_nodes - len(paths)))


def decode_shape(values: Sequence[int]) -> Shape:
    """The :class:`Shape` of :func:`encode_shape`'s ints (without its rates)."""
    on, lookup, n = (int(v) for v in values[:3])
    if not on:
        return OFF
    paths: list[tuple[int, ...]] = []
    for i in range(n):
        parent, rank = int(values[3 + 2 * i]), int(values[4 + 2 * i])
        paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
    return Shape(tree=tree_of(tuple(paths)) if paths else None, lookup=lookup, on=True)


@dataclass
class AdaptiveTree:
    """The per-step chooser of one engine (owned by its CloverProposer)."""

    curve: CostCurve
    stats: AcceptanceStats
    max_nodes: int
    max_lookup: int
    # Candidates per depth (CHAIN_RANKS: the top-1 chain only, ``adaptive_chain``).
    ranks: tuple[int, ...] = RANKS
    order: NodeOrder | None = None
    clock: StepClock = field(default_factory=StepClock)
    # Test hook (CloverWorkerExtension.clover_adaptive_force): (nodes, lookup) per step, cycled.
    forced: list[tuple[int, int]] = field(default_factory=list)
    steps: int = 0
    on: bool = False
    # Steps per (batch size, heads nodes, lookup tokens) chosen, (batch, 0, 0) = no speculation.
    chosen: dict[tuple[int, int, int], int] = field(default_factory=dict)
    # Per batch size, the call count at its last plain step taken to measure plain decoding.
    plain_probe: dict[int, int] = field(default_factory=dict)
    # Per batch size where drafting realised less than plain decoding, the call count of the veto.
    veto: dict[int, int] = field(default_factory=dict)
    calls: int = 0
    _logged: set = field(default_factory=set)

    def refresh(self) -> NodeOrder:
        """The node order, recomputed every :data:`REORDER_EVERY` steps."""
        if self.order is None or self.steps % REORDER_EVERY == 0:
            self.order = node_order(self.stats.head_rates(), self.max_nodes, self.ranks)
        return self.order

    def draft_ms(self, batch: int, accepted: np.ndarray) -> np.ndarray:
        """Predicted drafting time [N+1] for the first n nodes of the order (n = 0: lookup
        only): the trunk over the ``accepted`` [N+1] rows per request + one head step per depth
        over the nodes every request expands, times the learnt ratio."""
        order = self.order
        heads = self.curve.head(batch * order.expanded).sum(axis=1)  # [N+1]
        return self.clock.draft_ratio * (self.curve.trunk(batch * accepted) + heads)

    def choose(self, batch: int, chain_lens: Sequence[int], sources: Sequence[str]) -> Shape:
        """This step's shape for ``batch`` requests whose lookup chains have ``chain_lens``
        tokens (capped at ``max_lookup``), each from ``sources`` ("prompt" / "datastore")."""
        self.steps += 1
        order = self.refresh()
        heads_gain = order.depth_mass.sum(axis=1)  # [N+1]: expected accepted heads tokens
        if self.forced:
            n, lookup = self.forced[(self.steps - 1) % len(self.forced)]
            n, lookup = min(n, len(order.paths)), min(lookup, self.max_lookup)
            if n == 0 and lookup == 0:
                return OFF
            return Shape(tree=tree_of(order.paths[:n]) if n else None, lookup=lookup,
                         on=True, predicted_draft_ms=float(self.draft_ms(batch, 1.0 + heads_gain)[n]))
        n, lookup, best, plain, draft = self._best(batch, chain_lens, sources, heads_gain)
        self.on = best > plain * (1.0 + SWITCH_MARGIN)
        if not self.on:
            shape = Shape(tree=None, lookup=0, on=False, rate=best, plain_rate=plain)
        else:
            shape = Shape(tree=tree_of(order.paths[:n]) if n else None, lookup=lookup, on=True,
                          rate=best, plain_rate=plain, predicted_draft_ms=draft)
        self._log(batch, shape)
        return shape

    def probe_plain(self, batch: int) -> bool:
        """Whether this step should go without drafts to measure plain decoding at ``batch``
        (StepClock.plain_ms): the first time a batch size runs, then every
        :data:`PLAIN_PROBE_EVERY` calls, so that the comparison with plain decoding rests on a
        measured cost. Costs one step's extra tokens that often."""
        self.calls += 1
        if self.forced:
            return False
        last = self.plain_probe.get(batch)
        if last is not None and self.calls - last < PLAIN_PROBE_EVERY:
            return False
        self.plain_probe[batch] = self.calls
        self.count(batch, 0, 0)
        return True

    def vetoed(self, batch: int) -> bool:
        """Whether drafting steps at ``batch`` have realised fewer tokens per ms than plain steps
        there (StepClock.realised_gain < 1): then no speculation at ``batch``, however good the
        model's prediction, for :data:`VETO_CALLS` calls; after that the realised drafting rate
        is forgotten and measured again if the model chooses to draft."""
        if self.forced:
            return False
        gain = self.clock.realised_gain(batch)
        if gain is None or gain >= 1.0:
            self.veto.pop(batch, None)
            return False
        since = self.veto.setdefault(batch, self.calls)
        if self.calls - since >= VETO_CALLS:
            self.clock.forget_drafting(batch)
            del self.veto[batch]
            return False
        return True

    def count(self, batch: int, nodes: int, lookup: int) -> None:
        """One more step of (``nodes`` heads nodes, ``lookup`` tokens) at ``batch`` (0, 0: no drafts)."""
        self.chosen[(batch, nodes, lookup)] = self.chosen.get((batch, nodes, lookup), 0) + 1

    def could_pay(self, batch: int) -> bool:
        """Whether speculation could beat plain decoding at ``batch`` even if every request
        had a full prompt-lookup chain (if not, the chains need not be looked up)."""
        if self.forced:
            return True
        order = self.refresh()
        _, _, best, plain, _ = self._best(batch, [self.max_lookup] * batch, ["prompt"] * batch,
                                          order.depth_mass.sum(axis=1))
        return best > plain * (1.0 + SWITCH_MARGIN)

    def _best(self, batch: int, chain_lens: Sequence[int], sources: Sequence[str],
              heads_gain: np.ndarray) -> tuple[int, int, float, float, float]:
        """(nodes, lookup, rate, plain rate, predicted draft ms) of the best shape."""
        order = self.order
        lmax = self.max_lookup
        t = np.arange(1, lmax + 1)
        lens = np.minimum(np.asarray(chain_lens, dtype=np.int64), lmax)
        # m[t-1]: sum over requests with a chain of >= t tokens of their source's Lc[t];
        # a[t-1]: how many such requests (each spends one more row at lookup >= t).
        m, a = np.zeros(lmax), np.zeros(lmax)
        for source in set(sources) if lmax else ():
            mask = np.asarray([s == source for s in sources])
            have = (lens[mask][:, None] >= t[None, :]).sum(axis=0)
            m += have * self.stats.lookup_rates(source)[:lmax]
            a += have
        depth = order.depth_mass.shape[1]
        h = np.zeros((order.depth_mass.shape[0], max(lmax, depth)))
        h[:, :depth] = order.depth_mass
        miss = 1.0 - h[:, :lmax]  # [N+1, Lmax]: P(heads miss depth t)
        lookup_gain = np.concatenate([np.zeros((miss.shape[0], 1)), np.cumsum(miss * m, axis=1)], axis=1)
        tokens = batch * (1.0 + heads_gain)[:, None] + lookup_gain  # [N+1, Lmax+1]
        rows = batch * (1.0 + np.arange(len(heads_gain)))[:, None] + np.concatenate([[0.0], np.cumsum(a)])[None, :]
        draft = self.draft_ms(batch, tokens.mean(axis=1) / batch)  # [N+1]
        rate = tokens / (self.curve.target(rows) + draft[:, None] + self.clock.overhead(batch, rows))
        rate[0, 0] = -np.inf  # nothing drafted is plain decoding, priced below
        # Past the calibrated tokens the cost is a guess: shapes there are never chosen.
        rate[rows > max(self.curve.tokens[-1], batch)] = -np.inf
        plain = batch / (self.curve.target(batch) + self.clock.overhead(batch))
        n, lookup = np.unravel_index(int(np.argmax(rate)), rate.shape)
        return int(n), int(lookup), float(rate[n, lookup]), float(plain), float(draft[n])

    def _log(self, batch: int, shape: Shape) -> None:
        """Count the choice; log it once per (batch size, choice)."""
        label = (batch, shape.on, shape.tree.num_nodes if shape.tree is not None else 0, shape.lookup)
        self.count(batch, label[2], shape.lookup)
        if label in self._logged or len(self._logged) > 256:
            return
        self._logged.add(label)
        what = (f"{label[2]} heads nodes + {shape.lookup} lookup tokens" if shape.on else "no speculation")
        logger.info("vllm-clover: adaptive tree at batch %d: %s (expected %.3f tokens/ms against %.3f plain)",
                    batch, what, shape.rate, shape.plain_rate)


@functools.lru_cache(maxsize=512)
def children_lists(tree: StaticTree) -> list[list[int]]:
    """Child node indices of every node of ``tree`` (rank order), node 0 = root (cached per
    tree object; treat as read-only)."""
    return [[int(c) for c in row if c >= 0] for row in tree.children.tolist()]


# ============================================================================ in the proposer
@dataclass
class Pending:
    """What one request drafted in a step, kept until the step is verified."""

    drafts: list[int]           # the drafts handed to vLLM, in order
    children: list[list[int]]   # the heads tree's child lists (node 0 = root)
    heads_tokens: list[int]     # its node tokens
    chain: list[int]            # the lookup tokens grafted from the root
    source: str                 # "prompt" or "datastore"


class AdaptiveDrafting:
    """The proposer's side of the adaptive tree: clocks each drafting call, feeds every
    verified request step to :class:`AcceptanceStats`, looks up each request's retrieval
    chain before the choice, and remembers what each request drafted.

    ``retrieve(committed, k) -> (tokens, source)``: the proposer's prompt lookup, then its
    datastore."""

    def __init__(self, tree: AdaptiveTree) -> None:
        self.tree = tree
        self.pending: dict[str, Pending] = {}
        self.stale: set[str] = set()  # requests whose trunk skipped steps (speculation was off)
        self.chains: list[tuple[list[int], str]] = []  # this step's, by batch row
        self.shape: Shape = OFF
        self.parallel = tp_group() is not None  # several tensor-parallel ranks
        self.lead = is_first_rank()  # the rank that chooses (every rank with one)

    def begin(self, now: float, req_ids: Sequence[str], scheduler_output: Any,
              sampled_token_ids: Sequence[Sequence[int]]) -> None:
        """A drafting call starts: clock the step just run, learn from its verified drafts."""
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        batch = len(req_ids)
        decode_only = scheduler_output.total_num_scheduled_tokens == batch + sum(len(v) for v in spec.values())
        target = self.tree.curve.target(scheduler_output.total_num_scheduled_tokens) if decode_only else None
        produced = sum(len(t) for t in sampled_token_ids) if decode_only else 0
        self.tree.clock.tick(now, batch, scheduler_output.total_num_scheduled_tokens, target, produced)
        self.tree.stats.step()
        for i, req_id in enumerate(req_ids):
            p = self.pending.pop(req_id, None)
            if p is None or i >= len(sampled_token_ids) or not sampled_token_ids[i]:
                continue
            if list(spec.get(req_id, ())) != p.drafts:
                continue  # the scheduler cut the drafts (budget, max tokens): not what was priced
            self.tree.stats.observe(p.children, p.heads_tokens, p.chain, p.source,
                                    list(sampled_token_ids[i][:-1]), heads_valid=req_id not in self.stale)
        live = set(req_ids)
        self.pending = {r: p for r, p in self.pending.items() if r in live}
        self.stale &= live

    def plan(self, req_ids: Sequence[str], committed: Any, chain_ok: Sequence[bool], retrieve: Any) -> Shape:
        """This step's shape. ``committed(i)``: request i's committed tokens (numpy);
        ``chain_ok[i]``: request i may take a tree and lookup tokens.

        Under tensor parallelism tensor-parallel rank 0 chooses and every rank drafts its
        choice: the choice reads rank 0's clock, and each rank must draft and verify the same
        tree (vocab_parallel.from_first_rank)."""
        batch = len(req_ids)
        tree = self.tree
        self.chains = []
        lead = self.lead
        shape = OFF
        if lead and tree.probe_plain(batch):
            pass  # OFF: a plain step, measured (StepClock.plain_ms)
        elif lead and (tree.vetoed(batch) or not tree.could_pay(batch)):
            tree.on = False
            tree.count(batch, 0, 0)
        elif lead:
            self._look_up(batch, committed, chain_ok, retrieve)
            shape = tree.choose(batch, [len(c) for c, _ in self.chains], [s for _, s in self.chains])
        if self.parallel:
            shape = decode_shape(from_first_rank(encode_shape(shape, tree.max_nodes)))
            if not lead and shape.on:
                self._look_up(batch, committed, chain_ok, retrieve)
        self.shape = shape
        if not shape.on:
            self.stale.update(req_ids)
        return shape

    def _look_up(self, batch: int, committed: Any, chain_ok: Sequence[bool], retrieve: Any) -> None:
        """Every request's retrieval chain of this step (``chains``)."""
        for i in range(batch):
            if chain_ok[i] and self.tree.max_lookup:
                tokens, source = retrieve(committed(i), self.tree.max_lookup)
                self.chains.append((list(tokens), source))
            else:
                self.chains.append(([], "prompt"))

    def chain(self, i: int, k: int) -> list[int]:
        """Request i's lookup tokens of this step, at most ``k``."""
        return self.chains[i][0][:k] if i < len(self.chains) else []

    def remember(self, req_id: str, i: int, drafts: list[int], tree: StaticTree | None, heads_tokens: Sequence[int],
                 lookup: int) -> None:
        """Request ``req_id`` (batch row ``i``) drafted ``drafts``: ``tree`` / ``heads_tokens`` the
        heads' part, plus ``lookup`` tokens of its chain."""
        kids = children_lists(tree) if tree is not None and tree.num_nodes else [[]]
        source = self.chains[i][1] if i < len(self.chains) else "prompt"
        self.pending[req_id] = Pending(drafts=list(drafts), children=kids, heads_tokens=list(heads_tokens),
                                       chain=self.chain(i, lookup), source=source)

    def end(self, start: float, seconds: float) -> None:
        """The drafting call that began at ``start`` took ``seconds``."""
        shape = self.shape
        self.tree.clock.drafted(start, seconds * 1e3, shape.predicted_draft_ms if shape.on else None)
