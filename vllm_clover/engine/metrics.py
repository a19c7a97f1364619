"""Clover's speculative-decoding metrics in vLLM's own counters: acceptance by tree depth.

vLLM 0.32 counts speculation in its scheduler (``Scheduler.update_from_output``): per
request and verify step, ``num_draft_tokens`` = the drafts it scheduled and
``num_accepted`` = the tokens it got back minus the bonus. Its counters and per-request
metrics are built for chains, where draft position p is depth p + 1:

* ``vllm:spec_decode_num_accepted_tokens_per_pos{position=p}`` counts steps with more than
  p accepted tokens; a tree's accepted tokens are a root-to-node path handed back as a
  chain (``tree_verify.CloverRejectionSampler``), so position p is already depth p + 1;
* ``num_draft_tokens`` would count a tree's *nodes* (13 for a 5-node tree with 8 lookup
  tokens) while at most its depth can be accepted, so the acceptance rate a chain dashboard
  computes (accepted / drafted, the mean of the per-position rates for a chain) would read
  low for any tree, and the per-position draft counts would run over node indices.

For a request verified as a tree, Clover reports its **drafted depth** (the deepest node
of the scheduled tree) as the step's drafted tokens: in ``vllm:spec_decode_num_draft_tokens``,
the per-position draft counts (position p: the tree had a node at depth p + 1) and the
per-request ``num_draft_tokens`` / ``per_step_drafted`` of ``per_request_spec_decode_metrics``.
Then accepted / drafted is the chain-equivalent rate, per-position acceptance is per depth,
and mean acceptance length (1 + accepted / drafts) is unchanged. Chains are untouched. The
nodes a tree verifies cost target rows, not accepted tokens: ``vllm-clover bench`` reports
them (docs/metrics.md).

How the numbers travel (the scheduler lives in the EngineCore process, the tree in the
worker): :class:`DepthReporter` (``Worker.sample_tokens``) reads the step's tree plan,
which is published before sampling and taken while drafting, and attaches
``{request id: drafted depth}`` to the step's ``ModelRunnerOutput`` (attribute
:data:`DEPTHS_ATTR`; the output is pickled to the EngineCore with its instance dict).
:class:`DepthAccounting` (``Scheduler.update_from_output`` / ``make_spec_decoding_stats``)
uses it for the aggregate stats and corrects each tree request's per-request metrics right
after vLLM observed the step. The rollback of rejected drafts keeps vLLM's node count.
Patch: ``spec-decode-metrics-by-tree-depth`` (vllm_clover/patches/metrics.py).

The same two wrappers carry one more fact of the step: whether its proposer drafted anything
(:data:`DRAFTED_ATTR`, set only when it drafted nothing, e.g. the adaptive choice was no
speculation). The scheduler records it (:data:`SCHEDULER_DRAFTED`) and the EngineCore then skips
its draft fetch (patch ``engine-no-draft-fetch-when-drafting-off``, runner_hooks.wrap_post_step).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

# Attribute of a ModelRunnerOutput that carries {request id: drafted depth} of its tree requests.
DEPTHS_ATTR = "clover_tree_depths"
# Attribute of the Scheduler holding those depths while it processes the step's output.
_SCHEDULER_DEPTHS = "_clover_tree_depths"
# Attribute of a ModelRunnerOutput whose step's proposer drafted nothing (False; absent otherwise),
# and of the Scheduler: the last output's value (True where unmarked: drafts may exist).
DRAFTED_ATTR = "clover_drafted"
SCHEDULER_DRAFTED = "_clover_step_drafted"


# ============================================================================ tree depths
def node_depths(parent: Sequence[int]) -> list[int]:
    """Depth of every node of a tree given by parent pointers in BFS order (root first,
    ``parent[0] = -1``, ``parent[n] < n``): root 0, its children 1, ..."""
    depths: list[int] = []
    for n, p in enumerate(parent):
        if n == 0:
            if p != -1:
                raise ValueError(f"vllm-clover: the root's parent is {p}, expected -1")
            depths.append(0)
        elif not 0 <= p < n:
            raise ValueError(f"vllm-clover: node {n} has parent {p}; parents precede their children")
        else:
            depths.append(depths[p] + 1)
    return depths


def drafted_depth(parent: Sequence[int], num_scheduled: int) -> int:
    """The depth of the tree the target verifies when the scheduler kept the first
    ``num_scheduled`` draft nodes (a BFS prefix is ancestor-closed): the most draft tokens a
    step can accept, what a chain of that length reports as drafted."""
    if not 0 <= num_scheduled < len(parent):
        raise ValueError(f"vllm-clover: {num_scheduled} scheduled drafts for a tree of {len(parent) - 1} nodes")
    return max(node_depths(parent[: num_scheduled + 1]))


def step_depths(step: Any, req_ids: Sequence[str | None]) -> dict[str, int]:
    """``{request id: drafted depth}`` of the tree requests of a ``tree_verify.TreeStep``
    (each request's buffers hold its scheduled nodes only); ``req_ids`` is the persistent
    batch's row order."""
    out: dict[str, int] = {}
    for r in step.requests:
        req_id = req_ids[r.index] if r.index < len(req_ids) else None
        if req_id is not None:
            out[req_id] = int(r.buffers.depth[0, : r.buffers.width].max())
    return out


# ============================================================================ per position
def accepted_per_depth(num_accepted: Sequence[int], num_positions: int) -> list[int]:
    """What vLLM's ``num_accepted_tokens_per_pos`` holds after observing these steps:
    position p (depth p + 1) counts the steps that accepted more than p tokens."""
    counts = [0] * num_positions
    for a in num_accepted:
        if not 0 <= a <= num_positions:
            raise ValueError(f"vllm-clover: {a} accepted tokens with {num_positions} positions")
        for p in range(a):
            counts[p] += 1
    return counts


# ============================================================================ worker side
class DepthReporter:
    """Wraps ``Worker.sample_tokens``: attaches the drafted depths of the step's tree
    requests to the ModelRunnerOutput it returns (nothing for engines without trees)."""

    @staticmethod
    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        import functools

        @functools.wraps(orig)
        def sample_tokens(self: Any, grammar_output: Any) -> Any:
            runner = getattr(self, "model_runner", None)
            drafter = getattr(runner, "drafter", None)
            context = getattr(drafter, "tree_context", None)
            step = None if context is None else context.step  # taken while drafting, inside orig
            depths = step_depths(step, runner.input_batch.req_ids) if step is not None else None
            clover = getattr(drafter, "is_clover", False)
            if clover:
                drafter.drafted = None  # set by this step's drafting call, if one runs
            output = orig(self, grammar_output)
            if depths:
                output = DepthReporter.attach(output, DEPTHS_ATTR, dict(depths))
            if clover and drafter.drafted is False:
                output = DepthReporter.attach(output, DRAFTED_ATTR, False)
            return output

        return sample_tokens

    @staticmethod
    def attach(output: Any, attr: str, value: Any) -> Any:
        """``output`` with ``attr`` set (a copy where it is vLLM's shared empty output)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        if not isinstance(output, ModelRunnerOutput):
            return output
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            from copy import copy

            output = copy(output)
        setattr(output, attr, value)
        return output


# ============================================================================ scheduler side
class DepthAccounting:
    """Wraps the Scheduler's ``update_from_output`` and ``make_spec_decoding_stats`` so that
    a tree request's step counts its drafted depth as its drafted tokens."""

    @staticmethod
    def wrap_update_from_output(orig: Callable[..., Any]) -> Callable[..., Any]:
        import functools

        @functools.wraps(orig)
        def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
            setattr(self, SCHEDULER_DRAFTED, getattr(model_runner_output, DRAFTED_ATTR, True))
            depths = getattr(model_runner_output, DEPTHS_ATTR, None)
            if not depths:
                return orig(self, scheduler_output, model_runner_output)
            # The requests' metrics objects, taken before vLLM frees the finished ones; the
            # outputs it builds hold the same objects and are serialised after this returns.
            watched = {}
            for req_id in depths:
                request = self.requests.get(req_id)
                metrics = getattr(request, "spec_decode_metrics", None)
                if metrics is not None:
                    watched[req_id] = (metrics, sum(metrics.histogram))
            setattr(self, _SCHEDULER_DEPTHS, depths)
            try:
                result = orig(self, scheduler_output, model_runner_output)
            finally:
                setattr(self, _SCHEDULER_DEPTHS, None)
            invalid = scheduler_output.num_invalid_spec_tokens or {}
            for req_id, (metrics, steps_before) in watched.items():
                if sum(metrics.histogram) == steps_before:
                    continue  # vLLM did not observe this request's step (stale output)
                nodes = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())) - invalid.get(req_id, 0)
                correct_request_metrics(metrics, nodes, depths[req_id])
            return result

        return update_from_output

    @staticmethod
    def wrap_make_spec_decoding_stats(orig: Callable[..., Any]) -> Callable[..., Any]:
        import functools

        @functools.wraps(orig)
        def make_spec_decoding_stats(self: Any, spec_decoding_stats: Any, num_draft_tokens: int,
                                     num_accepted_tokens: int, num_invalid_spec_tokens: Any,
                                     request_id: str) -> Any:
            depths = getattr(self, _SCHEDULER_DEPTHS, None)
            if depths and request_id in depths and num_draft_tokens:
                # vLLM subtracts the grammar-invalidated drafts from what it is given.
                num_draft_tokens = depths[request_id] + (num_invalid_spec_tokens or {}).get(request_id, 0)
            return orig(self, spec_decoding_stats, num_draft_tokens=num_draft_tokens,
                        num_accepted_tokens=num_accepted_tokens,
                        num_invalid_spec_tokens=num_invalid_spec_tokens, request_id=request_id)

        return make_spec_decoding_stats


def correct_request_metrics(metrics: Any, nodes: int, depth: int) -> None:
    """A ``RequestSpecDecodeMetrics`` that just observed a step with ``nodes`` drafted tokens,
    changed to have observed ``depth`` (its accepted-count histogram is already right)."""
    metrics.num_draft_tokens += depth - nodes
    if metrics.per_step_drafted and metrics.per_step_drafted[-1] == nodes:
        metrics.per_step_drafted[-1] = depth
