"""The adaptive tree's choice on synthetic cost curves (CPU-like: every verified row costs
compute; GPU-like: flat for a hundred rows), its statistics and its node order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_clover.engine.adaptive import (CHAIN_RANKS, AcceptanceStats, AdaptiveTree, StepClock, children_lists, heads_prior,
                                         node_order, tree_of)
from vllm_clover.engine.calibration import CostCurve, TOKEN_GRID, ROW_GRID

HEADS = "vllm_clover/heads/smollm2-135m-instruct-clover2"


def cpu_curve() -> CostCurve:
    """25 ms for one token, 0.8 ms per further token (a 2-core CPU in float32)."""
    tokens = list(TOKEN_GRID)
    return CostCurve(tokens=tokens, target_ms=[25.0 + 0.8 * (t - 1) for t in tokens], rows=list(ROW_GRID),
                     head_ms=[0.6 + 0.02 * m for m in ROW_GRID], trunk_ms=[1.0 + 0.05 * m for m in ROW_GRID])


def gpu_curve() -> CostCurve:
    """5 ms flat up to 128 tokens (memory-bound), then compute-bound."""
    tokens = list(TOKEN_GRID) + [256, 512]
    return CostCurve(tokens=tokens, target_ms=[5.0 if t <= 128 else 5.0 * t / 128 for t in tokens],
                     rows=list(ROW_GRID), head_ms=[0.2] * len(ROW_GRID), trunk_ms=[0.3] * len(ROW_GRID))


def chooser(curve: CostCurve, max_nodes: int = 16, max_lookup: int = 8) -> AdaptiveTree:
    stats = AcceptanceStats([0.5, 0.45, 0.45, 0.45, 0.45], max_lookup)
    return AdaptiveTree(curve=curve, stats=stats, max_nodes=max_nodes, max_lookup=max_lookup)


def chain_chooser(curve: CostCurve, k: int = 5) -> AdaptiveTree:
    """The ``adaptive_chain`` chooser: the heads' top-1 chain of up to k tokens, no lookup."""
    stats = AcceptanceStats([0.5, 0.45, 0.45, 0.45, 0.45], 0)
    return AdaptiveTree(curve=curve, stats=stats, max_nodes=k, max_lookup=0, ranks=CHAIN_RANKS)


def rows_of(shape, batch: int, chain: int) -> int:
    n = shape.tree.num_nodes if shape.tree is not None else 0
    return batch * (1 + n + min(shape.lookup, chain)) if shape.on else batch


def test_more_rows_where_rows_are_cheap():
    """At batch 1 the flat curve takes a larger tree than the CPU-like one, and both speculate."""
    cpu = chooser(cpu_curve()).choose(1, [8], ["datastore"])
    gpu = chooser(gpu_curve()).choose(1, [8], ["datastore"])
    assert cpu.on and gpu.on
    assert rows_of(gpu, 1, 8) > rows_of(cpu, 1, 8)
    assert gpu.tree.num_nodes >= 12 and gpu.lookup == 8  # rows are free on the flat curve


def test_cpu_like_shrinks_to_zero_speculation():
    """On the CPU-like curve the rows per request fall as the batch grows, and at batch 32 a
    row costs more than its expected gain: no speculation."""
    tree = chooser(cpu_curve())
    per_request = []
    for b in (1, 2, 4, 8, 16, 32):
        shape = tree.choose(b, [8] * b, ["datastore"] * b)
        per_request.append(rows_of(shape, b, 8) / b)
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] > 2
    assert per_request[-1] == 1  # off
    assert not tree.choose(32, [8] * 32, ["datastore"] * 32).on


def test_zero_speculation_when_a_row_costs_more_than_its_gain():
    """Rows that cost as much as a whole step never pay, even at batch 1."""
    tokens = list(TOKEN_GRID)
    steep = CostCurve(tokens=tokens, target_ms=[25.0 * t for t in tokens], rows=list(ROW_GRID),
                      head_ms=[0.6] * len(ROW_GRID), trunk_ms=[1.0] * len(ROW_GRID))
    assert not chooser(steep).choose(1, [8], ["prompt"]).on


def test_gpu_like_speculates_at_large_batch():
    """The flat curve keeps speculating at batch 32 (32 x rows stays under its knee)."""
    shape = chooser(gpu_curve()).choose(32, [4] * 32, ["datastore"] * 32)
    assert shape.on and rows_of(shape, 32, 4) <= 128 + 32


def test_lookup_follows_the_chains():
    """Long prompt-lookup chains get lookup tokens; no chains get none."""
    tree = chooser(cpu_curve())
    with_chains = tree.choose(1, [8], ["prompt"])
    without = tree.choose(1, [0], ["prompt"])
    assert with_chains.lookup > 0
    assert rows_of(without, 1, 0) < rows_of(with_chains, 1, 8)


def test_overhead_makes_speculation_pay_more():
    """A large per-step overhead (learnt by the clock) favours speculation at a larger batch."""
    base = chooser(cpu_curve())
    heavy = chooser(cpu_curve())
    heavy.clock.plain_ms[32] = 60.0
    assert not base.choose(32, [8] * 32, ["datastore"] * 32).on
    assert heavy.choose(32, [8] * 32, ["datastore"] * 32).on


def test_a_cost_per_verify_row_turns_speculation_off():
    """What each extra verify row costs beyond the calibration (attention over the context,
    tree attention) is learnt from drafting steps against plain ones, and stops speculation
    at a batch where the calibration alone says it pays."""
    tree = chooser(cpu_curve())
    b = 8
    assert tree.choose(b, [8] * b, ["datastore"] * b).on
    clock = tree.clock
    # A plain step: 25.0 + 0.8 * 7 ms of target, 14 ms of overhead.
    target = float(tree.curve.target(b))
    clock.drafted(0.0, 0.1, None)
    clock.tick((0.1 + target + 14.0) / 1e3, b, b, target)
    # A drafting step over 48 rows: 2 ms per extra row on top of the 14 ms.
    rows = 48
    target = float(tree.curve.target(rows))
    clock.drafted(1.0, 3.0, 3.0)
    clock.tick(1.0 + (3.0 + target + 14.0 + 2.0 * (rows - b)) / 1e3, b, rows, target)
    assert clock.plain_ms[b] == pytest.approx(14.0)
    assert clock.row_ms[b] == pytest.approx(2.0)
    assert clock.overhead(b, rows) == pytest.approx(14.0 + 80.0)
    assert not tree.choose(b, [8] * b, ["datastore"] * b).on
    assert tree.choose(1, [8], ["datastore"]).on  # batch 1 still pays (learnt at batch 8 only)


def test_plain_steps_probe_each_batch_size_now_and_then():
    from vllm_clover.engine.adaptive import PLAIN_PROBE_EVERY

    tree = chooser(cpu_curve())
    probes = [tree.probe_plain(4) for _ in range(2 * PLAIN_PROBE_EVERY)]
    assert probes[0] and sum(probes) == 2
    assert tree.probe_plain(2)  # a new batch size: measured at once
    tree.forced = [(3, 0)]
    assert not any(tree.probe_plain(16) for _ in range(3))  # forced shapes are never replaced


def test_node_order_prefixes_are_trees():
    """Every prefix of the best-first order is a valid StaticTree, and values never rise."""
    q = AcceptanceStats([0.5, 0.4, 0.45, 0.45, 0.5], 4).head_rates()
    order = node_order(q, 20)
    assert list(order.values) == sorted(order.values, reverse=True)
    for n in range(1, len(order.paths) + 1):
        tree = tree_of(order.paths[:n])
        assert tree.num_nodes == n
    assert order.paths[0] == (0,)
    assert np.isclose(order.depth_mass[1, 0], q[0, 0])


def test_stats_learn_from_observations():
    """Heads: a rank-1 child that is right every other step raises q[0][1] from its prior;
    lookup: a chain that is right where the heads miss raises Lc."""
    stats = AcceptanceStats([0.5, 0.4], 4)
    tree = tree_of(((0,), (1,), (0, 0)))
    kids = children_lists(tree)
    before_q, before_l = stats.head_rates()[0, 1], stats.lookup_rates("prompt")
    for i in range(400):
        stats.step()
        # heads tokens: node 1 = 10 (rank 0), node 2 = 11 (rank 1), node 3 = 12 (under node 1)
        if i % 2:
            stats.observe(kids, [10, 11, 12], [11, 7, 7], "prompt", [11, 7, 7])  # rank 1, then the chain
        else:
            stats.observe(kids, [10, 11, 12], [10, 12, 5], "prompt", [10, 12])  # the heads' spine
    q = stats.head_rates()
    assert q[0, 1] == pytest.approx(0.5, abs=0.05) and before_q < 0.3
    assert q[0, 0] == pytest.approx(0.5, abs=0.05)
    assert q[1, 0] > 0.75  # node 3 was right whenever node 1 was (the prior fades)
    # depth 1 is always reached by the heads; at depth 3 the chain is right on the odd steps
    # (the heads stop at 1) and wrong on the even ones (the heads stop at 2)
    lc = stats.lookup_rates("prompt")
    assert lc[0] == pytest.approx(before_l[0])
    assert lc[2] == pytest.approx(0.5, abs=0.05)


def test_heads_prior_from_the_shipped_evaluation():
    """The shipped heads' held-out chain rates become conditionals (head 0 near 0.42)."""
    q = heads_prior(HEADS, 5, 4096)
    rates = json.load(open(f"{HEADS}/eval_selfdistill_dv4096.json"))["chain"][-1]["acceptance_rate_per_position"]
    assert q[0] == pytest.approx(rates[0])
    assert q[1] == pytest.approx(rates[1] / rates[0])
    assert heads_prior("/nonexistent", 3) == [0.45, 0.45, 0.45]


def test_clock_learns_overhead_and_ignores_idle_gaps():
    clock = StepClock()
    clock.drafted(0.0, 0.5, None)
    clock.tick(0.040, 1, 1, 31.5)  # 40 ms plain cycle: 0.5 draft + 31.5 target -> 8 ms overhead
    assert clock.overhead(1) == pytest.approx(8.0)
    clock.drafted(1.0, 0.5, None)
    clock.tick(11.0, 1, 1, 31.5)  # 10 s: the engine was idle
    assert clock.overhead(1) == pytest.approx(8.0)
    assert clock.overhead(4) == pytest.approx(8.0)  # nearest batch size known
    assert clock.overhead(4, 12) == pytest.approx(8.0)  # no row cost learnt yet


def test_forced_choices_cycle():
    tree = chooser(cpu_curve())
    tree.forced = [(0, 0), (3, 2), (1, 0)]
    shapes = [tree.choose(2, [4, 4], ["prompt", "prompt"]) for _ in range(3)]
    assert not shapes[0].on
    assert shapes[1].tree.num_nodes == 3 and shapes[1].lookup == 2
    assert shapes[2].tree.num_nodes == 1 and shapes[2].lookup == 0


def test_shapes_past_the_calibrated_tokens_are_never_chosen():
    """The curve says nothing past its last point: at batch 32 a curve measured to 64 tokens
    allows at most one extra row per request, and a flat last segment does not make rows free."""
    tokens = [1, 8, 16, 32, 48, 64]
    flat_end = CostCurve(tokens=tokens, target_ms=[20.0, 20.0, 26.0, 36.0, 56.0, 56.0], rows=list(ROW_GRID),
                         head_ms=[0.1] * len(ROW_GRID), trunk_ms=[0.5] * len(ROW_GRID))
    assert flat_end.target(128) > 56.0 + 0.5 * (128 - 64)  # the upper half's slope, not the last 0
    tree = chooser(flat_end)
    tree.clock.plain_ms[32] = 60.0  # a large overhead: speculation would pay if rows were free
    shape = tree.choose(32, [8] * 32, ["datastore"] * 32)
    assert rows_of(shape, 32, 8) <= 64


def test_a_slow_drafting_step_is_learnt_not_taken_for_idle():
    clock = StepClock()
    clock.drafted(0.0, 0.1, None)
    clock.tick(0.050, 8, 8, 30.0)  # plain: 50 - 0.1 - 30 = 19.9 ms overhead
    clock.drafted(1.0, 2.0, 2.0)
    clock.tick(1.0 + 0.900, 8, 108, 60.0)  # a drafting step 15x its prediction
    assert clock.row_ms[8] == pytest.approx((900 - 2.0 - 60.0 - 19.9) / 100)


def test_adaptive_chain_chooses_chains_only():
    """With CHAIN_RANKS every candidate is the top-1 chain: each choice is a chain (n nodes, n
    deep) and no lookup tokens; the flat curve still drafts a chain at batch 32, under its knee,
    the CPU-like one shortens it as the batch grows and drafts nothing at batch 32."""
    gpu, cpu = chain_chooser(gpu_curve()), chain_chooser(cpu_curve())
    for tree in (gpu, cpu):
        assert tree.refresh().paths == tuple((0,) * d for d in range(1, 6))
    flat = gpu.choose(32, [0] * 32, ["prompt"] * 32)
    assert flat.on and flat.lookup == 0 and flat.tree.num_nodes == flat.tree.max_depth >= 2
    assert rows_of(flat, 32, 0) <= 128
    depths = []
    for b in (1, 2, 4, 8, 16, 32):
        shape = cpu.choose(b, [0] * b, ["prompt"] * b)
        assert shape.lookup == 0
        depths.append(shape.tree.max_depth if shape.on else 0)
        if shape.on:
            assert shape.tree.num_nodes == shape.tree.max_depth
    assert depths == sorted(depths, reverse=True) and depths[0] >= 2 and depths[-1] == 0


def test_adaptive_chain_forced_lookup_is_no_drafts():
    """A forced shape with lookup tokens only is no speculation for the chain (it has no lookup)."""
    tree = chain_chooser(cpu_curve())
    tree.forced = [(0, 5), (3, 2)]
    assert not tree.choose(1, [0], ["prompt"]).on
    shape = tree.choose(1, [0], ["prompt"])
    assert shape.on and shape.lookup == 0 and shape.tree.num_nodes == 3


def _steps(clock: StepClock, start: float, n: int, cycle_ms: float, produced: int, drafting: bool) -> float:
    """n decode steps of batch 8, each ``cycle_ms`` long and producing ``produced`` tokens."""
    t = start
    for _ in range(n):
        clock.drafted(t, 1.0, 1.0 if drafting else None)
        t += cycle_ms / 1e3
        clock.tick(t, 8, 16 if drafting else 8, 20.0, produced)
    return t


def test_realised_rates_veto_drafting_that_loses():
    """Drafting steps that realise fewer tokens per ms than plain ones veto speculation at that
    batch size (after MIN_DRAFTING_SAMPLES of them), whatever the model predicts; the veto
    lapses after VETO_CALLS calls and the drafting rate is measured again. Drafting that wins
    is never vetoed; forced shapes ignore the veto."""
    from vllm_clover.engine.adaptive import MIN_DRAFTING_SAMPLES, VETO_CALLS

    tree = chooser(cpu_curve())
    clock = tree.clock
    t = _steps(clock, 0.0, 2, 30.0, 8, drafting=False)         # plain: 8 tokens / 30 ms
    t = _steps(clock, t, MIN_DRAFTING_SAMPLES - 1, 45.0, 10, drafting=True)
    assert clock.realised_gain(8) is None and not tree.vetoed(8)  # too few drafting samples
    t = _steps(clock, t, 1, 45.0, 10, drafting=True)           # drafting: 10 tokens / 45 ms
    assert clock.realised_gain(8) == pytest.approx((10 / 45) / (8 / 30))
    assert tree.vetoed(8) and not tree.vetoed(4)
    tree.forced = [(2, 0)]
    assert not tree.vetoed(8)
    tree.forced = []
    tree.calls += VETO_CALLS
    assert not tree.vetoed(8) and clock.realised_gain(8) is None  # lapsed: measured again
    _steps(clock, t, MIN_DRAFTING_SAMPLES, 30.0, 14, drafting=True)
    assert clock.realised_gain(8) > 1 and not tree.vetoed(8)
