"""The benchmark harness's pure parts: method parsing, configs, aggregation, prompt files."""

from __future__ import annotations

import json
import time

import pytest

from vllm_clover.benchmarks import bench


def test_parse_method_forms() -> None:
    assert bench.parse_method("vanilla") == bench.MethodSpec("vanilla", "vanilla", None, None)
    assert bench.parse_method("ngram@3") == bench.MethodSpec("ngram@3", "ngram", None, 3)
    assert bench.parse_method("clover:/h/x@5") == bench.MethodSpec("clover:/h/x@5", "clover", "/h/x", 5)
    spec = bench.parse_method("clover:/h/x@4?draft_vocab_size=4096&draft_sampling=greedy")
    assert spec.options == (("draft_vocab_size", 4096), ("draft_sampling", "greedy"))
    assert bench.speculative_config(spec, 2) == {"method": "clover", "model": "/h/x", "num_speculative_tokens": 4,
                                                 "draft_vocab_size": 4096, "draft_sampling": "greedy"}
    spec = bench.parse_method("clover:/h?tree=chain2&datastore_min_confidence=0.25&datastore=ds.npz")
    assert spec.options == (("tree", "chain2"), ("datastore_min_confidence", 0.25), ("datastore", "ds.npz"))


def test_parse_method_environment() -> None:
    spec = bench.parse_method("vanilla!VLLM_CLOVER_CPU_LINEAR=0;OMP_X=a=b")
    assert spec.name == "vanilla" and spec.env == (("VLLM_CLOVER_CPU_LINEAR", "0"), ("OMP_X", "a=b"))
    spec = bench.parse_method("clover:/h?tree=small_4!VLLM_CLOVER_CPU_LINEAR=0")
    assert spec.options == (("tree", "small_4"),) and spec.env == (("VLLM_CLOVER_CPU_LINEAR", "0"),)
    assert bench.parse_method("clover:/h@2").env == ()


def test_aggregate_compares_like_environments() -> None:
    """A method run with ``!VAR=VALUE`` is divided by the vanilla run under the same variables."""
    labels = ["vanilla", "vanilla!K=0", "ngram@2", "ngram@2!K=0", "ngram@2!K=1"]
    methods = [bench.parse_method(m) for m in labels]
    tps = {"vanilla": 10.0, "vanilla!K=0": 8.0, "ngram@2": 20.0, "ngram@2!K=0": 12.0, "ngram@2!K=1": 30.0}
    runs = [{"method": m, "batch_size": 1, "tokens_per_s": t, "mean_acceptance_length": 1.0,
             "acceptance_per_position": []} for m, t in tps.items()]
    res = {r["method"]: r for r in bench.aggregate(runs, methods, 4)}
    assert res["ngram@2"]["speedup_vs_vanilla"] == pytest.approx(2.0)
    assert res["ngram@2!K=0"]["speedup_vs_vanilla"] == pytest.approx(1.5)  # vs vanilla!K=0
    assert res["vanilla!K=0"]["speedup_vs_vanilla"] == pytest.approx(1.0)
    assert res["ngram@2!K=1"]["speedup_vs_vanilla"] == pytest.approx(3.0)  # no vanilla!K=1: plain vanilla
    assert res["ngram@2!K=0"]["env"] == {"K": "0"} and res["ngram@2"]["env"] == {}


@pytest.mark.parametrize("bad, msg", [("foo", "unknown method"), ("medusa", "needs a checkpoint"),
                                      ("vanilla!X", "expected VAR=VALUE"), ("vanilla!1X=2", "expected VAR=VALUE"),
                                      ("ngram:/x", "takes no checkpoint"), ("ngram@x", "bad speculative"),
                                      ("clover:/h?draft_vocab_size", "expected KEY=VALUE"),
                                      ("vanilla?x=1", "takes no options")])
def test_parse_method_errors(bad: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        bench.parse_method(bad)


def test_bare_clover_is_the_served_default() -> None:
    """``clover`` alone: the shipped heads with this machine's serve options for the dtype
    (what ``vllm-clover serve`` passes), ``?KEY=VALUE`` on top; a path keeps only its own."""
    from vllm_clover.serve_defaults import shipped_serve_options
    from vllm_clover.training.train import shipped_heads_dir

    spec = bench.resolve_method(bench.parse_method("clover"), "float32")
    assert spec.path == str(shipped_heads_dir())
    assert dict(spec.options) == shipped_serve_options("float32")
    cfg = bench.speculative_config(spec, 4)
    assert cfg == {"method": "clover", "model": str(shipped_heads_dir()),
                   **({} if "tree" in cfg else {"num_speculative_tokens": 4}), **shipped_serve_options("float32")}
    changed = bench.resolve_method(bench.parse_method("clover?tree=small_5&tree_token_budget=14"), "float32")
    assert dict(changed.options) == {**shipped_serve_options("float32"), "tree": "small_5", "tree_token_budget": 14}
    own = bench.parse_method("clover:/h?tree=small_4")
    assert bench.resolve_method(own, "float32") == own


def test_speculative_configs() -> None:
    assert bench.speculative_config(bench.parse_method("vanilla"), 4) is None
    assert bench.speculative_config(bench.parse_method("ngram"), 4)["num_speculative_tokens"] == 4
    cfg = bench.speculative_config(bench.parse_method("clover:/h@2"), 4)
    assert cfg == {"method": "clover", "model": "/h", "num_speculative_tokens": 2}


def test_aggregate_means_and_speedup() -> None:
    methods = [bench.parse_method("vanilla"), bench.parse_method("ngram@2")]
    runs = [
        {"method": "vanilla", "batch_size": 1, "tokens_per_s": 10.0, "mean_acceptance_length": 1.0,
         "acceptance_per_position": []},
        {"method": "vanilla", "batch_size": 1, "tokens_per_s": 14.0, "mean_acceptance_length": 1.0,
         "acceptance_per_position": []},
        {"method": "ngram@2", "batch_size": 1, "tokens_per_s": 24.0, "mean_acceptance_length": 2.0,
         "acceptance_per_position": [0.6, 0.4], "draft_cost_vs_target_step": 0.1},
        {"method": "ngram@2", "batch_size": 1, "tokens_per_s": 18.0, "mean_acceptance_length": 1.8,
         "acceptance_per_position": [0.5, 0.3], "draft_cost_vs_target_step": 0.2},
    ]
    res = {r["method"]: r for r in bench.aggregate(runs, methods, 4)}
    assert res["vanilla"]["tokens_per_s"] == 12.0 and res["vanilla"]["speedup_vs_vanilla"] == 1.0
    assert res["ngram@2"]["speedup_vs_vanilla"] == pytest.approx(21.0 / 12.0)
    assert res["ngram@2"]["speedup_vs_vanilla_runs"] == pytest.approx([24.0 / 10.0, 18.0 / 14.0])
    assert res["ngram@2"]["acceptance_per_position"] == pytest.approx([0.55, 0.35])
    assert res["ngram@2"]["mean_acceptance_length"] == pytest.approx(1.9)
    assert res["ngram@2"]["num_speculative_tokens"] == 2
    assert res["ngram@2"]["draft_cost_vs_target_step"] == pytest.approx(0.15)
    assert res["vanilla"]["draft_cost_vs_target_step"] is None
    for key in ("method", "batch_size", "tokens_per_s", "mean_acceptance_length",
                "acceptance_per_position", "speedup_vs_vanilla"):
        assert key in res["ngram@2"]


def test_tokens_per_decode_step_counts_every_step() -> None:
    """2 requests, 22 tokens, 8 accepted drafts: 20 decode tokens in 12 request-steps
    (whatever the drafter did in the steps without drafts); no decode step -> 1. Counted
    steps win; else drafts bound the steps from below: 15 drafting request-steps cannot
    have made 20 tokens in 12 steps (3 accepted drafts were dropped past max_tokens)."""
    assert bench.tokens_per_decode_step(22, 2, 8) == pytest.approx(20 / 12)
    assert bench.tokens_per_decode_step(22, 2, 8, drafts=5) == pytest.approx(20 / 12)
    assert bench.tokens_per_decode_step(22, 2, 8, drafts=15) == pytest.approx(20 / 15)
    assert bench.tokens_per_decode_step(22, 2, 8, drafts=5, decode_steps=16) == pytest.approx(20 / 16)
    assert bench.tokens_per_decode_step(20, 2, 0) == 1.0
    assert bench.tokens_per_decode_step(2, 2, 0) == 1.0


def test_prompt_file_validation(tmp_path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text(json.dumps({"turns": ["hi"]}) + "\n" + json.dumps({"prompt": "raw"}) + "\n")
    records, _ = bench.load_prompts(str(good), 2)
    assert records == [{"turns": ["hi"]}, {"prompt": "raw"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bench.load_prompts(str(bad), 1)
    with pytest.raises(ValueError, match="2 prompts, 5 requested"):
        bench.load_prompts(str(good), 5)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bench.load_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_builtin_prompt_sets() -> None:
    records, _ = bench.load_prompts("mtbench", 80)
    assert len(records) == 80 and all(r["turns"] for r in records)


def test_cli_dispatches_bench_and_fails_fast_on_bad_method(capsys) -> None:
    from vllm_clover import cli
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--methods", "vanilla,warp"])
    assert "unknown method 'warp'" in str(exc.value)


@pytest.mark.parametrize("batch_sizes", [[1], [1, 8]])
def test_plot_writes_throughput_and_acceptance_charts(tmp_path, batch_sizes) -> None:
    results = [dict(method=m, batch_size=b, tokens_per_s=10.0 + i + b, mean_acceptance_length=1.5,
                    acceptance_per_position=[0.4, 0.1] if m != "vanilla" else [],
                    speedup_vs_vanilla=1.0 + i / 10)
               for i, m in enumerate(["vanilla", "clover:/x/heads/h@2?draft_vocab_size=4096"])
               for b in batch_sizes]
    conditions = dict(model_name="m", dtype="float32", prompt_set="mtbench", num_prompts=2,
                      max_tokens=8, temperature=0.0, cpus=2)
    paths = bench.plot(results, tmp_path, conditions)
    assert [p.name for p in paths] == ["throughput.png", "acceptance.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)
    assert bench._label("clover:/x/heads/h@2?k=1&tree=small_4") == "clover:h@2\nk=1, tree=small_4"
    assert bench._label("vanilla") == "vanilla"
    long = bench._label("clover:h?draft_vocab_size=4096&tree=chain2&prompt_lookup_tokens=5&datastore=datastore.npz")
    assert long.startswith("clover:h\n") and max(len(line) for line in long.splitlines()) <= 40


def test_profile_timer_counts_calls_and_time() -> None:
    """vllm_clover.benchmarks.profile_step's timers add wall time and calls per key, pass results and
    exceptions through, and keep the wrapped function's name."""
    import collections
    import types

    from vllm_clover.benchmarks.profile_step import add_timer

    def work(x):
        if x < 0:
            raise ValueError("negative")
        time.sleep(0.01)
        return 2 * x

    owner = types.SimpleNamespace(work=work)
    totals, calls = collections.defaultdict(float), collections.Counter()
    add_timer(totals, calls, owner, "work", "w")
    assert owner.work(3) == 6 and owner.work.__name__ == "work"
    with pytest.raises(ValueError, match="negative"):
        owner.work(-1)
    assert calls["w"] == 2 and totals["w"] >= 0.01


def test_profile_op_profiler_records_operators_only_when_asked() -> None:
    """``--top-ops 0`` profiles nothing; ``--top-ops N`` records the operators run inside."""
    import torch

    from vllm_clover.benchmarks.profile_step import _op_profiler

    with _op_profiler(0) as off:
        torch.ones(4) @ torch.ones(4)
    assert off is None
    profiler = _op_profiler(5)
    with profiler:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    assert "aten::mm" in {e.key for e in profiler.key_averages()}
