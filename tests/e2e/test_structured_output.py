"""Structured output with Clover: a JSON schema, a regex, a choice and a grammar, through
``LLM.generate`` and the OpenAI HTTP API (``response_format``, ``structured_outputs``, streaming),
checked against plain vLLM under the same constraint (float32 greedy: token-identical) and
against the constraint itself.

How Clover serves these requests (docs/structured-output-and-lora.md): a structured-output
request drafts a chain (the top-1 spine of its tree; ``tree_verify.chain_only_reason``), which
vLLM's scheduler cuts to its grammar-valid prefix (``StructuredOutputManager.validate_tokens``)
and whose every verified row gets the grammar's bitmask for the state after the drafts before
it; unconstrained requests in the same steps keep their trees. Engines, one after the other:
plain vLLM (the reference, for every case below), Clover with this CPU's fixed served preset
(a static tree + prompt lookup + datastore, vllm_clover/serve_defaults.py, without the batch-size
cut-off so that the mixed batch drafts), Clover with a chain (K = 3), and ``vllm-clover serve``
with its defaults over HTTP.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import E2E_LLM_KWARGS, REPO, shutdown_llm, venv_bin
from tests.e2e.server import free_port, running_server

pytestmark = pytest.mark.slow

# Short requests, a handful at a time: a small KV cache keeps each engine's memory low.
LLM_KWARGS = {**E2E_LLM_KWARGS, "kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024}
# The server imports this checkout (as the in-process engines do), not an older installed copy.
SERVE_ENV = {"PYTHONPATH": str(REPO)}
SERVE_FLAGS = ["--enforce-eager", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)]

MAX_TOKENS = 48
PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 24},
                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}
CITY_REGEX = r"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12}){0,2}\."
CHOICES = ["yes", "no", "maybe"]
# GBNF (xgrammar): one equation "a op b = c" with numbers of 1 to 3 digits.
EQUATION_GRAMMAR = """
root ::= num " " op " " num " = " num
op ::= "+" | "-" | "*"
num ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]
"""
EQUATION_REGEX = r"\d{1,3} [+*-] \d{1,3} = \d{1,3}"

# kind -> (prompt, StructuredOutputsParams fields)
CASES = {
    "json": ("Describe a person as JSON with a name and an age:\n", {"json": PERSON_SCHEMA}),
    "regex": ("Q: What is the capital of France?\nA: ", {"regex": CITY_REGEX}),
    "choice": ("Is the sky blue? Answer yes, no or maybe: ", {"choice": CHOICES}),
    "grammar": ("Write one arithmetic equation: ", {"grammar": EQUATION_GRAMMAR}),
}
FREE = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
CHAT = [{"role": "user", "content": "Invent a person. Reply with a JSON object with a name and an age."}]


def check_valid(kind: str, text: str) -> None:
    """``text`` satisfies the constraint of case ``kind``."""
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"name", "age"}, value
        assert isinstance(value["name"], str) and len(value["name"]) <= 24, value
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150, value
    elif kind == "regex":
        assert re.fullmatch(CITY_REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(EQUATION_REGEX, text), text


def _params(kind: str | None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    extra = {} if kind is None else {"structured_outputs": StructuredOutputsParams(**CASES[kind][1])}
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **extra)


def _mixed_batch() -> list[tuple[str | None, str]]:
    """(kind or None for unconstrained, prompt): every kind between unconstrained requests."""
    batch: list[tuple[str | None, str]] = []
    for i, (kind, (prompt, _)) in enumerate(CASES.items()):
        batch += [(None, FREE[i % len(FREE)]), (kind, prompt)]
    return batch + [(None, FREE[-1])]


def _spec_metrics(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def _run_llm(model: str, spec: dict | None) -> dict:
    """The LLM.generate cases on one engine: every kind alone (batch 1), the mixed batch, and
    the chat JSON case; for Clover also the spec-decode counters and the tree draft log."""
    from vllm import LLM

    extension = {"worker_extension_cls": "vllm_clover.engine.runner_hooks.CloverWorkerExtension"} if spec else {}
    llm = LLM(model=model, speculative_config=spec, disable_log_stats=False, max_num_seqs=16,
              **LLM_KWARGS, **extension)
    try:
        out: dict = {"alone": {}}
        for kind, (prompt, _) in CASES.items():
            before = _spec_metrics(llm) if spec else {}
            o = llm.generate([prompt], _params(kind), use_tqdm=False)[0].outputs[0]
            out["alone"][kind] = (list(o.token_ids), o.text, o.finish_reason)
            if spec:
                after = _spec_metrics(llm)
                out.setdefault("alone_counts", {})[kind] = {
                    k: after.get(k, 0) - before.get(k, 0) for k in after}
        batch = _mixed_batch()
        if spec:
            llm.collective_rpc("clover_record_drafts", args=(True,))
        outs = llm.generate([p for _, p in batch], [_params(k) for k, _ in batch], use_tqdm=False)
        out["mixed"] = [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        if spec:
            out["tree_records"] = llm.collective_rpc("clover_take_tree_drafts")[0]
            llm.collective_rpc("clover_record_drafts", args=(False,))
        if not spec:  # references for the HTTP cases
            from vllm import SamplingParams
            from vllm.sampling_params import StructuredOutputsParams

            chat = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                 structured_outputs=StructuredOutputsParams(json=PERSON_SCHEMA)),
                            use_tqdm=False)[0].outputs[0]
            free_chat = llm.chat(CHAT, _params(None), use_tqdm=False)[0].outputs[0]
            out["chat_json"], out["chat_free"] = chat.text, free_chat.text
        return out
    finally:
        shutdown_llm(llm)


def clover_spec(ckpt: Path, mode: str) -> dict:
    """``mode`` "served": this CPU's served tree options (vllm_clover/serve_defaults.py) without
    the batch-size cut-off and with room for trees in a batch of up to 16 short requests;
    "chain": a chain of 3 (tests/e2e/test_lora.py uses "served" too)."""
    from vllm_clover.model.draft_vocab import DRAFT_VOCAB_FILE
    from vllm_clover.serve_defaults import SERVE_DEFAULTS, platform_case, shipped_serve_options

    if mode == "chain":
        return {"method": "clover", "model": str(ckpt), "num_speculative_tokens": 3}
    # This CPU's fixed preset where the table has one (a static tree the proposer drafts at every
    # step, so the checks below always see trees), else the served options.
    options = dict(SERVE_DEFAULTS[platform_case()].get("fixed") or shipped_serve_options())
    options.pop("disable_by_batch_size", None)
    options.pop("num_speculative_tokens", None)
    if not (ckpt / DRAFT_VOCAB_FILE).is_file():
        options.pop("draft_vocab_size", None)
    if "datastore" in options and not (ckpt / options["datastore"]).is_file():
        options.pop("datastore")
    if options.get("tree") not in (None, "adaptive"):
        options["tree_token_budget"] = 96
    return {"method": "clover", "model": str(ckpt), **options}


@pytest.fixture(scope="module")
def runs(default_model_dir: Path, clover_ckpt_dir: Path) -> dict:
    model = str(default_model_dir)
    served = clover_spec(clover_ckpt_dir, "served")
    return {"plain": _run_llm(model, None), "tree": _run_llm(model, served),
            "chain": _run_llm(model, clover_spec(clover_ckpt_dir, "chain")), "served_spec": served}


# ============================================================================ LLM.generate
@pytest.mark.parametrize("mode", ["tree", "chain"])
@pytest.mark.parametrize("kind", list(CASES))
def test_each_kind_alone_valid_and_identical(runs: dict, mode: str, kind: str) -> None:
    ref = runs["plain"]["alone"][kind]
    got = runs[mode]["alone"][kind]
    assert got == ref
    assert got[2] == "stop", got  # finished inside the constraint, not cut by max_tokens
    check_valid(kind, got[1])


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_constrained_requests_draft_and_accept(runs: dict, mode: str) -> None:
    """Constrained requests alone drafted and had drafts accepted: the grammar cut drafts to
    valid prefixes and masked every verified row, it did not turn speculation off. (A request
    whose drafts the grammar cuts to nothing counts no draft for that step: the two-token
    regex and one-token choice answers may draft nothing; the JSON object must.)"""
    counts = runs[mode]["alone_counts"]
    drafted = {k: c.get("vllm:spec_decode_num_drafts", 0) for k, c in counts.items()}
    accepted = sum(c.get("vllm:spec_decode_num_accepted_tokens", 0) for c in counts.values())
    assert drafted["json"] > 0, drafted
    assert accepted > 0, counts


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_mixed_batch_valid_and_identical(runs: dict, mode: str) -> None:
    batch = _mixed_batch()
    assert runs[mode]["mixed"] == runs["plain"]["mixed"]
    for (kind, _), (_, text, reason) in zip(batch, runs[mode]["mixed"]):
        if kind is not None:
            assert reason == "stop"
            check_valid(kind, text)


def test_mixed_batch_trees_beside_constrained_chains(runs: dict) -> None:
    """With the served options the unconstrained requests of the mixed batch drafted trees in
    the same steps as the constrained ones, which drafted chains (no tree of theirs logged)."""
    records = runs["tree"]["tree_records"]
    if "tree" not in runs["served_spec"]:
        pytest.skip("this CPU's served options draft chains")
    assert records, "no tree was drafted in the mixed batch"
    free = sum(kind is None for kind, _ in _mixed_batch())
    assert len({req_id for req_id, *_ in records}) <= free


# ============================================================================ HTTP
def _stream_text(server, path: str, body: dict) -> str:
    text = ""
    with requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _post_text(server, path: str, body: dict) -> tuple[str, str]:
    r = requests.post(server.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"], choice["finish_reason"]


@pytest.fixture(scope="module")
def http(runs: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``vllm-clover serve`` with its defaults (the served tree, lookup and datastore on this
    CPU): every kind over /v1/completions, streamed and not; the JSON schema as
    ``response_format`` over /v1/chat/completions, streamed and not; and a constrained and an
    unconstrained chat request at the same time."""
    port = free_port()
    cmd = [venv_bin("vllm-clover"), "serve", "--port", str(port), *SERVE_FLAGS]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    with running_server(cmd, port, tmp_path_factory.mktemp("serve") / "serve.log", env=SERVE_ENV) as server:
        base = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0}
        out: dict = {"log": ""}
        for kind, (prompt, constraint) in CASES.items():
            body = {**base, "prompt": prompt, "structured_outputs": constraint}
            out[kind] = _post_text(server, "/v1/completions", body)
            out[kind + "-stream"] = _stream_text(server, "/v1/completions", body)
        chat = {**base, "messages": CHAT, "response_format": fmt}
        out["chat"] = _post_text(server, "/v1/chat/completions", chat)
        out["chat-stream"] = _stream_text(server, "/v1/chat/completions", chat)
        with ThreadPoolExecutor(2) as pool:
            pair = [pool.submit(_post_text, server, "/v1/chat/completions", body)
                    for body in (chat, {**base, "messages": CHAT})]
            out["concurrent"] = [f.result() for f in pair]
        out["log"] = server.log_tail(400_000)
    out["shutdown"] = server.shutdown
    return out


def test_http_served_with_clover(http: dict) -> None:
    assert '"method": "clover"' in http["log"], "vllm-clover serve ran without Clover"
    assert http["shutdown"] == {"returncode": 0, "leftover_children": []}


@pytest.mark.parametrize("kind", list(CASES))
def test_http_completions_each_kind(runs: dict, http: dict, kind: str) -> None:
    ref = runs["plain"]["alone"][kind][1]
    text, reason = http[kind]
    assert (text, reason) == (ref, "stop")
    assert http[kind + "-stream"] == ref
    check_valid(kind, text)


def test_http_chat_response_format_json_schema(runs: dict, http: dict) -> None:
    ref = runs["plain"]["chat_json"]
    assert http["chat"] == (ref, "stop")
    assert http["chat-stream"] == ref
    check_valid("json", ref)
    constrained, free = http["concurrent"]
    assert constrained == (ref, "stop")
    assert free[0] == runs["plain"]["chat_free"]
