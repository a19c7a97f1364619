"""Metrics patch: vLLM's speculative-decoding counters and per-request metrics count a tree
request's drafted depth, not its nodes. The wrapper bodies live in vllm_clover/engine/metrics.py."""

from __future__ import annotations

from vllm_clover.patches.patching import Patch, params, source, wrap


def install_tree_depth_metrics() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_clover.engine.metrics import DepthAccounting, DepthReporter

    wrap(Worker, "sample_tokens", DepthReporter.wrap, TREE_DEPTH_METRICS)
    wrap(Scheduler, "update_from_output", DepthAccounting.wrap_update_from_output, TREE_DEPTH_METRICS)
    wrap(Scheduler, "make_spec_decoding_stats", DepthAccounting.wrap_make_spec_decoding_stats,
         TREE_DEPTH_METRICS)


def check_tree_depth_metrics() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.spec_decode.metrics import SpecDecodingStats
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    # The CPU worker inherits sample_tokens, which returns the runner's output object.
    assert issubclass(CPUWorker, Worker) and "sample_tokens" not in CPUWorker.__dict__
    assert params(Worker.sample_tokens) == ["self", "grammar_output"]
    assert "self.model_runner.sample_tokens(grammar_output)" in source(Worker.sample_tokens)
    # ModelRunnerOutput keeps an instance dict (pickled with the extra attribute).
    assert not hasattr(ModelRunnerOutput, "__slots__") or "__dict__" in ModelRunnerOutput.__slots__
    assert params(Scheduler.update_from_output) == ["self", "scheduler_output", "model_runner_output"]
    assert params(Scheduler.make_spec_decoding_stats) == [
        "self", "spec_decoding_stats", "num_draft_tokens", "num_accepted_tokens",
        "num_invalid_spec_tokens", "request_id"]
    update = source(Scheduler.update_from_output)
    # Drafted = scheduled drafts, accepted = sampled - bonus; stats first, then the request's metrics.
    assert "num_draft_tokens = len(scheduled_spec_token_ids)" in update
    assert update.index("self.make_spec_decoding_stats(") < update.index("request.spec_decode_metrics.observe(")
    assert "num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)" in source(
        Scheduler.make_spec_decoding_stats)
    observe = source(SpecDecodingStats.observe_draft)
    assert "self.num_accepted_tokens_per_pos[i] += 1" in observe and "self.num_draft_tokens_per_pos[i] += 1" in observe
    assert {"histogram", "num_draft_tokens", "per_step_drafted"} <= set(RequestSpecDecodeMetrics.__dataclass_fields__)
    assert "self.num_draft_tokens += num_draft_tokens" in source(RequestSpecDecodeMetrics.observe)


TREE_DEPTH_METRICS = Patch(
    name="spec-decode-metrics-by-tree-depth",
    target=("vllm.v1.core.sched.scheduler.Scheduler.update_from_output, .make_spec_decoding_stats "
            "(+ vllm.v1.worker.gpu_worker.Worker.sample_tokens)"),
    why=("vLLM's spec-decode counters and per-request metrics take a step's scheduled drafts as its "
         "drafted tokens, a tree's node count; for requests verified as a tree they count its drafted "
         "depth instead, so acceptance rate and per-position counters read as for a chain "
         "(docs/metrics.md). The worker attaches the depths to the step's output, and whether it drafted "
         "at all (read by patch engine-no-draft-fetch-when-drafting-off)."),
    upstream=("vllm-project/vllm#18327 (tree attention for speculative decoding: trees will need "
              "per-depth metrics upstream too)"),
    remove_when="vLLM verifies trees itself and reports their metrics by depth",
    apply=install_tree_depth_metrics,
    check=check_tree_depth_metrics,
)
