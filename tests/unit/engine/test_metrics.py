"""Tree metrics (vllm_clover/engine/metrics.py): drafted depth of scheduled tree prefixes,
the per-depth meaning of vLLM's per-position counters, and the per-request correction,
checked against vLLM's own SpecDecodingStats and RequestSpecDecodeMetrics."""

from __future__ import annotations

import pytest
import torch

from vllm_clover.drafting.tree import get_tree, graft_chain, single_tree_buffers
from vllm_clover.engine import metrics
from vllm_clover.engine.tree_verify import TreeRequest, TreeStep


def test_node_depths_of_a_static_tree_match_its_buffers() -> None:
    tree = get_tree("small_5")
    parent = tree.parent.tolist()
    assert metrics.node_depths(parent) == tree.buffers(1).depth[0].tolist()
    assert metrics.node_depths([-1, 0, 1, 2]) == [0, 1, 2, 3]  # a chain: node n at depth n


def test_node_depths_refuse_parents_that_are_not_bfs() -> None:
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        metrics.node_depths([-1, 0, 2])
    with pytest.raises(ValueError, match="root's parent"):
        metrics.node_depths([0, 0])


def test_drafted_depth_of_scheduler_truncated_prefixes() -> None:
    # 3 children of the root, 2 grandchildren under the first, one great-grandchild.
    parent = [-1, 0, 0, 0, 1, 1, 4]
    assert [metrics.drafted_depth(parent, n) for n in range(7)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="7 scheduled drafts for a tree of 6 nodes"):
        metrics.drafted_depth(parent, 7)


def test_a_grafted_lookup_chain_deepens_the_tree() -> None:
    """Prompt-lookup tokens grafted under the root make a tree deeper than its heads' part:
    small_5 (depth 2) plus a 4-token chain from the root reaches depth 4."""
    tree = get_tree("small_5")
    tokens, parent = graft_chain(list(range(100, 100 + tree.num_nodes)), tuple(tree.parent.tolist()),
                                 [7, 8, 9, 10])
    assert len(tokens) == tree.num_nodes + 4
    assert tree.max_depth == 2 and metrics.drafted_depth(parent, len(tokens)) == 4


def test_per_position_counters_count_steps_by_accepted_depth() -> None:
    """vLLM's own SpecDecodingStats, fed what the scheduler sees for tree steps (drafted
    depth, accepted path length), holds at position p the steps that accepted depth p + 1."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    num_positions = 13  # num_speculative_tokens of a 5-node tree with 8 lookup tokens
    steps = [(3, 0), (3, 1), (4, 4), (2, 2), (9, 5), (3, 3)]  # (drafted depth, accepted)
    stats = SpecDecodingStats.new(num_positions)
    for depth, accepted in steps:
        stats.observe_draft(num_draft_tokens=depth, num_accepted_tokens=accepted)
    assert stats.num_accepted_tokens_per_pos == metrics.accepted_per_depth([a for _, a in steps], num_positions)
    assert stats.num_accepted_tokens_per_pos[:6] == [5, 4, 3, 2, 1, 0]
    # Drafted per position = steps whose tree reached that depth; the rate of a chain
    # dashboard (accepted / drafted) is then the drafts-weighted mean of the per-depth rates.
    assert stats.num_draft_tokens_per_pos[:10] == [6, 6, 5, 2, 1, 1, 1, 1, 1, 0]
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    assert stats.num_draft_tokens == sum(stats.num_draft_tokens_per_pos) == 24
    with pytest.raises(ValueError):
        metrics.accepted_per_depth([14], num_positions)


def test_step_depths_read_the_scheduled_tree_of_each_request() -> None:
    full = (-1, 0, 0, 1, 1, 3)
    requests = [TreeRequest(index=2, start=0, root=10, buffers=single_tree_buffers(full), slots=torch.zeros(6)),
                TreeRequest(index=0, start=6, root=4, buffers=single_tree_buffers(full[:3]), slots=torch.zeros(3))]
    step = TreeStep(num_tokens=9, requests=requests)
    assert metrics.step_depths(step, ["a", "b", "c"]) == {"c": 3, "a": 1}


def test_request_metrics_count_the_drafted_depth() -> None:
    """vLLM's RequestSpecDecodeMetrics after a tree step of 13 nodes and depth 4 that accepted
    3 tokens, corrected: 4 drafted, the histogram untouched, to_dict's rates per depth."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    for detailed in (False, True):
        m = RequestSpecDecodeMetrics.new(13)
        m.observe(num_draft_tokens=13, num_accepted=3, detailed=detailed)
        metrics.correct_request_metrics(m, nodes=13, depth=4)
        m.observe(num_draft_tokens=2, num_accepted=2, detailed=detailed)  # a chain step: as vLLM counts it
        d = m.to_dict()
        assert d["num_draft_tokens"] == 6 and d["num_accepted_draft_tokens"] == 5
        assert d["draft_acceptance_rate"] == pytest.approx(5 / 6)
        assert d["mean_acceptance_length"] == pytest.approx(1 + 5 / 2)
        assert d["acceptance_histogram"][2:4] == [1, 1]
        assert d.get("per_step_drafted", []) == ([4, 2] if detailed else [])


def test_depths_ride_on_the_model_runner_output_through_pickle() -> None:
    """The worker's output reaches the EngineCore pickled: the depths travel with it, and
    vLLM's shared empty output is never modified."""
    import pickle

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5, 6]])
    assert metrics.DepthReporter.attach(out, metrics.DEPTHS_ATTR, {"a": 3}) is out
    metrics.DepthReporter.attach(out, metrics.DRAFTED_ATTR, False)
    back = pickle.loads(pickle.dumps(out))
    assert getattr(back, metrics.DEPTHS_ATTR) == {"a": 3} and getattr(back, metrics.DRAFTED_ATTR) is False
    copy = metrics.DepthReporter.attach(EMPTY_MODEL_RUNNER_OUTPUT, metrics.DEPTHS_ATTR, {"a": 1})
    assert copy is not EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, metrics.DEPTHS_ATTR)
    assert metrics.DepthReporter.attach(None, metrics.DEPTHS_ATTR, {"a": 1}) is None


def test_scheduler_records_whether_the_step_drafted() -> None:
    """The scheduler side of the step report records the drafted-nothing mark for the EngineCore's
    post_step (runner_hooks.wrap_post_step); an unmarked output reads as drafted."""
    from vllm.v1.outputs import ModelRunnerOutput

    class Scheduler:
        def update_from_output(self, scheduler_output, model_runner_output):
            return model_runner_output.req_ids

    update = metrics.DepthAccounting.wrap_update_from_output(Scheduler.update_from_output)
    scheduler = Scheduler()
    marked = metrics.DepthReporter.attach(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}),
                                          metrics.DRAFTED_ATTR, False)
    assert update(scheduler, None, marked) == ["a"]
    assert getattr(scheduler, metrics.SCHEDULER_DRAFTED) is False
    update(scheduler, None, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
    assert getattr(scheduler, metrics.SCHEDULER_DRAFTED) is True
