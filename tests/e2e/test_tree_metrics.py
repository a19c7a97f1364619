"""Tree metrics in a real Clover engine (``LLM``, tree + prompt lookup + datastore, the serve
defaults' shape): vLLM's spec-decode counters and ``per_request_spec_decode_metrics``
("detailed") count each tree step's drafted depth (vllm_clover/engine/metrics.py).

The drafter's own log (CloverWorkerExtension.clover_take_tree_drafts: node tokens and parent
pointers of every tree it drafted) gives, per request, the depth of every tree that was then
verified; the per-request ``per_step_drafted`` must equal those depths step for step, the
per-position counters must count steps by accepted depth, and everything must add up to
the engine counters. /metrics of a real server: tests/e2e/test_load.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CLOVER_DTYPE_OPTIONS, E2E_DTYPE, shutdown_llm
from vllm_clover.drafting.tree import get_tree
from vllm_clover.engine.metrics import accepted_per_depth, drafted_depth

pytestmark = pytest.mark.slow

HEADS = Path(__file__).resolve().parents[2] / "vllm_clover/heads/smollm2-135m-instruct-clover2"
# small_5 (5 nodes) + up to 8 lookup tokens within 14 verify tokens: K = 13.
SPEC = {"method": "clover", "model": str(HEADS), "tree": "small_5", "prompt_lookup_tokens": 8,
        "tree_token_budget": 14, "datastore": "datastore.npz", "draft_vocab_size": 4096,
        **CLOVER_DTYPE_OPTIONS}
K = 5 + 8
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "List the days of the week: Monday, Tuesday,"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def run(default_model_dir: Path) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(default_model_dir), dtype=E2E_DTYPE, enforce_eager=True, kv_cache_memory_bytes=1 << 30,
              max_model_len=1024, disable_log_stats=False, speculative_config=SPEC,
              per_request_spec_decode_metrics="detailed",
              worker_extension_cls="vllm_clover.engine.runner_hooks.CloverWorkerExtension")
    try:
        assert llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens == K
        before = _counters(llm)
        outs, trees = [], {}
        # One request at a time: batch 1 gets the tree (B * (N + 1) <= 14) at every step.
        for prompt in PROMPTS:
            llm.collective_rpc("clover_record_drafts", args=(True,))
            outs += llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
            for req_id, _, tokens, parents in llm.collective_rpc("clover_take_tree_drafts")[0]:
                trees.setdefault(req_id, []).append(drafted_depth(parents, len(tokens)))
        llm.collective_rpc("clover_record_drafts", args=(False,))
        after = _counters(llm)
    finally:
        shutdown_llm(llm)
    delta = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list)
                 else v - before.get(k, 0)) for k, v in after.items()}
    return {"outs": outs, "trees": trees, "counters": delta}


def _counters(llm) -> dict:
    return {m.name: (list(m.values) if hasattr(m, "values") else m.value)
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def test_per_request_drafted_is_the_depth_of_each_verified_tree(run: dict) -> None:
    trees = list(run["trees"].values())
    assert len(trees) == len(PROMPTS)
    for out, depths in zip(run["outs"], trees):
        m = out.outputs[0].spec_decode_metrics.to_dict()
        steps = m["num_spec_steps"]
        # Every step drafted a tree; the last one (after the final token) is never verified.
        assert steps >= 4 and len(depths) in (steps, steps + 1), (steps, depths)
        assert m["per_step_drafted"] == depths[:steps]
        assert all(a <= d for a, d in zip(m["per_step_accepted"], m["per_step_drafted"]))
        assert m["num_draft_tokens"] == sum(depths[:steps]) < K * steps
        assert m["num_accepted_draft_tokens"] == sum(m["per_step_accepted"])
        assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
        assert m["num_spec_tokens"] == K and len(m["acceptance_histogram"]) == K + 1
        print(out.request_id, "depths", m["per_step_drafted"], "accepted", m["per_step_accepted"])
    # The lookup's grafted chains make some trees deeper than the heads' part.
    assert max(max(d) for d in trees) > get_tree("small_5").max_depth


def test_engine_counters_are_per_depth_and_add_up_to_the_requests(run: dict) -> None:
    c = run["counters"]
    per_req = [o.outputs[0].spec_decode_metrics for o in run["outs"]]
    accepted = [a for m in per_req for a in m.per_step_accepted]
    assert c["vllm:spec_decode_num_drafts"] == len(accepted) == sum(m.to_dict()["num_spec_steps"] for m in per_req)
    assert c["vllm:spec_decode_num_accepted_tokens"] == sum(accepted)
    assert c["vllm:spec_decode_num_draft_tokens"] == sum(m.num_draft_tokens for m in per_req)
    assert c["vllm:spec_decode_num_accepted_tokens_per_pos"] == accepted_per_depth(accepted, K)
    print("counters", c)
