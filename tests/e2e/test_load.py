"""A bounded loopback load-and-abuse test of one Clover server (`vllm serve` with a tree:
small_5 + 8 lookup tokens + the datastore, per-request spec-decode metrics on).

One mixed run at 12 concurrent clients: greedy completions sent as token ids (compared token
for token with plain vLLM in float32), seeded sampled chats, streaming completions and chats,
streaming clients that hang up mid-stream, and hostile requests (malformed JSON, wrong types,
huge and negative values, unknown fields, empty messages, bytes that are not UTF-8, an unknown
model). It prints its figures and passes when: no 5xx, no request hangs, every hostile
request that vLLM must refuse gets a 4xx (the rest are served correctly), no greedy mismatch,
and afterwards the server is healthy, serves identically, holds no request, and its /metrics
count trees by depth (docs/metrics.md)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import requests

from tests.conftest import venv_bin
from tests.e2e.reference import plain_greedy_tokens
from tests.e2e.server import free_port, running_server

pytestmark = pytest.mark.slow

HEADS = Path(__file__).resolve().parents[2] / "vllm_clover/heads/smollm2-135m-instruct-clover2"
SPEC = {"method": "clover", "model": str(HEADS), "tree": "small_5", "prompt_lookup_tokens": 8,
        "tree_token_budget": 14, "datastore": "datastore.npz", "draft_vocab_size": 4096}
K = 5 + 8
MAX_MODEL_LEN = 512
CONCURRENCY = 12
MAX_TOKENS = 48
REQUEST_TIMEOUT = 600  # seconds; a request still open after it counts as a hang
GREEDY = ["The capital of France is", "def fibonacci(n):\n    ", "List the days of the week: Monday,",
          "Write a haiku about the sea.", "Q: What is 12 times 7?\nA:", "import numpy as np\n\n# mean of a list\n",
          "Translate to French: I like apples.", "The three primary colours are",
          "Once upon a time, in a small village,", "The printing press was invented by",
          "SELECT name FROM users WHERE", "Photosynthesis is the process", "The largest planet is",
          "Roses are red, violets are", "for i in range(10):\n", "Dear hiring manager,"]
QUESTIONS = ["What is the capital of Italy?", "Name three fruits.", "Explain gravity in one sentence.",
             "Write a short poem about rain.", "What is 2 + 2?", "Give me a tip for learning Python."]


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return {t: tok(t).input_ids for t in GREEDY}


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, prompts: dict) -> dict[str, list[int]]:
    return plain_greedy_tokens(default_model_dir, prompts, dict.fromkeys(prompts, MAX_TOKENS), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, reference: dict):
    port = free_port()
    cmd = [venv_bin("vllm"), "serve", str(default_model_dir), "--port", str(port), "--host", "127.0.0.1",
           "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 30),
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--speculative-config", json.dumps(SPEC),
           "--per-request-spec-decode-metrics", "summary"]
    # The hostile n=10000 request is capped by the operator's limit (a 4xx), not served.
    env = {"VLLM_MAX_N_SEQUENCES": "64"}
    with running_server(cmd, port, tmp_path_factory.mktemp("load") / "serve.log", startup_timeout=900,
                        env=env) as srv:
        srv.model = str(default_model_dir)
        yield srv
    assert srv.shutdown["returncode"] == 0, srv.log_tail()


def hostile_requests(model: str) -> list[tuple[str, str, bytes, str]]:
    """(name, path, raw body, expectation): "4xx" = must be refused with a 4xx (vLLM 0.32 refuses
    max_tokens over max_model_len and empty prompts); "ok" = valid for vLLM (200), checked for
    its length rule by the caller."""
    c, ch = "/v1/completions", "/v1/chat/completions"

    def j(body: dict) -> bytes:
        return json.dumps(body).encode()

    base = {"model": model, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    return [
        ("malformed json", c, b'{"model": "x", "prompt": "a"', "4xx"),
        ("not an object", c, b'[1, 2, 3]', "4xx"),
        ("empty body", c, b"", "4xx"),
        ("non-utf8 body", c, b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe\xfa"}', "4xx"),
        ("non-utf8 chat", ch, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', "4xx"),
        ("prompt wrong type", c, j({**base, "prompt": {"a": 1}}), "4xx"),
        ("max_tokens string", c, j({**base, "max_tokens": "many"}), "4xx"),
        ("max_tokens negative", c, j({**base, "max_tokens": -5}), "4xx"),
        ("max_tokens zero", c, j({**base, "max_tokens": 0}), "4xx"),
        ("temperature negative", c, j({**base, "temperature": -1.0}), "4xx"),
        ("temperature string", c, j({**base, "temperature": "hot"}), "4xx"),
        ("top_p above one", c, j({**base, "top_p": 1.5}), "4xx"),
        ("top_k negative", c, j({**base, "top_k": -7}), "4xx"),
        ("n zero", c, j({**base, "n": 0}), "4xx"),
        ("n huge", c, j({**base, "n": 10000}), "4xx"),
        ("logprobs huge", c, j({**base, "logprobs": 100000}), "4xx"),
        ("seed string", c, j({**base, "seed": "abc"}), "4xx"),
        ("stop wrong type", c, j({**base, "stop": 42}), "4xx"),
        ("token id out of vocabulary", c, j({**base, "prompt": [10 ** 9]}), "4xx"),
        ("negative token id", c, j({**base, "prompt": [-3, 5]}), "4xx"),
        ("prompt over max_model_len", c, j({**base, "prompt": [42] * (MAX_MODEL_LEN + 10)}), "4xx"),
        ("unknown model", c, j({**base, "model": "no-such-model"}), "4xx"),
        ("messages empty", ch, j({**chat, "messages": []}), "4xx"),
        ("messages not a list", ch, j({**chat, "messages": "hi"}), "4xx"),
        ("message without role", ch, j({**chat, "messages": [{"content": "hi"}]}), "4xx"),
        # The chat template renders any role: a valid request for vLLM.
        ("unknown role", ch, j({**chat, "messages": [{"role": "wizard", "content": "hi"}]}), "ok"),
        ("chat max_tokens negative", ch, j({**chat, "max_tokens": -1}), "4xx"),
        ("chat response_format bogus", ch, j({**chat, "response_format": {"type": "bogus"}}), "4xx"),
        ("max_tokens huge", c, j({**base, "max_tokens": 10 ** 12}), "4xx"),
        ("max_tokens huge chat", ch, j({**chat, "max_tokens": 2 ** 31}), "4xx"),
        ("max_tokens over max_model_len", c, j({**base, "max_tokens": MAX_MODEL_LEN + 1}), "4xx"),
        ("empty prompt", c, j({**base, "prompt": ""}), "4xx"),
        # Valid for vLLM: max_tokens within max_model_len but past the context left is clamped.
        ("max_tokens past the context left", c,
         j({**base, "prompt": [42] * (MAX_MODEL_LEN - 20), "max_tokens": MAX_MODEL_LEN, "temperature": 0}), "ok"),
        ("unknown fields", c, j({**base, "frobnicate": True, "x_extra": [1, 2]}), "ok"),
    ]


def _classify(status: int) -> str:
    return "2xx" if 200 <= status < 300 else "4xx" if 400 <= status < 500 else "5xx" if status >= 500 else "other"


def test_load_and_abuse(server, prompts: dict, reference: dict) -> None:
    url, model = server.url, server.model
    rng = random.Random(0)
    jobs: list[tuple[str, object]] = [("greedy", k) for k in GREEDY]
    jobs += [("chat-seeded", i) for i in range(12)] + [("stream", i) for i in range(10)]
    jobs += [("chat-stream", i) for i in range(8)] + [("cancel", i) for i in range(10)]
    jobs += [("hostile", h) for h in hostile_requests(model)]
    rng.shuffle(jobs)
    figures = {"requests": len(jobs), "concurrency": CONCURRENCY, "2xx": 0, "4xx": 0, "5xx": 0,
               "failures": 0, "mismatches": 0, "cancelled": 0, "hangs": 0}
    problems: list[str] = []
    spec_metrics: list[dict] = []

    def stream(path: str, body: dict, stop_after: int | None = None) -> tuple[int, str, int]:
        text, chunks = "", 0
        with requests.post(url + path, json={**body, "stream": True}, stream=True, timeout=REQUEST_TIMEOUT) as r:
            if r.status_code != 200:
                return r.status_code, r.text, 0
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text += choice[0].get("text") or (choice[0].get("delta") or {}).get("content") or ""
                if stop_after is not None and chunks >= stop_after:
                    break  # hang up mid-stream: vLLM aborts the request
        return 200, text, chunks

    def run(job: tuple[str, object]) -> tuple[str, str, int]:
        kind, arg = job
        question = QUESTIONS[arg % len(QUESTIONS)] if isinstance(arg, int) else ""
        if kind == "greedy":
            r = requests.post(url + "/v1/completions", timeout=REQUEST_TIMEOUT, json={
                "model": model, "prompt": prompts[arg], "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True})
            if r.status_code == 200:
                body = r.json()
                spec_metrics.append((body.get("metrics") or {}).get("speculative_decoding"))
                if body["choices"][0]["token_ids"] != reference[arg]:
                    return kind, f"mismatch {arg!r}", r.status_code
            return kind, "" if r.status_code == 200 else r.text[:200], r.status_code
        if kind == "chat-seeded":
            r = requests.post(url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT, json={
                "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32,
                "temperature": 0.8, "top_p": 0.95, "seed": int(arg)})
            ok = r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            return kind, "" if ok else r.text[:200], r.status_code
        if kind in ("stream", "cancel"):
            status, text, chunks = stream("/v1/completions", {
                "model": model, "prompt": GREEDY[int(arg) % len(GREEDY)], "max_tokens": 200 if kind == "cancel" else 32,
                "temperature": 0.7, "seed": int(arg)}, stop_after=3 if kind == "cancel" else None)
            return kind, "" if status == 200 and (text or kind == "cancel") else f"{status} {text[:200]}", status
        if kind == "chat-stream":
            status, text, _ = stream("/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24,
                "temperature": 0})
            return kind, "" if status == 200 and text else f"{status} {text[:200]}", status
        name, path, raw, expect = arg
        r = requests.post(url + path, data=raw, headers={"Content-Type": "application/json"}, timeout=REQUEST_TIMEOUT)
        if expect == "4xx":
            problem = "" if 400 <= r.status_code < 500 else f"expected a 4xx: {r.text[:200]}"
            return f"hostile:{name}", problem, r.status_code
        if r.status_code != 200:
            return f"hostile:{name}", f"expected 200: {r.text[:200]}", r.status_code
        usage = r.json()["usage"]
        ok = usage["prompt_tokens"] + usage["completion_tokens"] <= MAX_MODEL_LEN
        return f"hostile:{name}", "" if ok else f"ran past max_model_len: {usage}", r.status_code

    start = time.time()
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        done, pending = wait(futures, timeout=REQUEST_TIMEOUT * 3)
        figures["hangs"] = len(pending)
        for f in done:
            try:
                kind, problem, status = f.result()
            except requests.RequestException as exc:  # a timeout is a hang
                figures["hangs"] += 1
                problems.append(f"request error {type(exc).__name__}: {exc}")
                continue
            figures[_classify(status)] = figures.get(_classify(status), 0) + 1
            figures["cancelled"] += kind == "cancel"
            if problem:
                figures["failures"] += 1
                figures["mismatches"] += problem.startswith("mismatch")
                problems.append(f"{kind} -> {status}: {problem}")
    figures["wall_s"] = round(time.time() - start, 1)
    print("load figures:", json.dumps(figures))
    for problem in problems:
        print("load problem:", problem)
    assert not figures["hangs"] and not figures["5xx"] and not problems, (figures, problems)
    hostile = sum(1 for kind, _ in jobs if kind == "hostile")
    assert figures["4xx"] == sum(1 for k, h in jobs if k == "hostile" and h[3] == "4xx") and hostile >= 30

    # Afterwards: healthy, nothing held, still identical, and per-request metrics per depth.
    assert requests.get(url + "/health", timeout=30).status_code == 200
    deadline = time.time() + 60
    while (_gauge(url, "vllm:num_requests_running") + _gauge(url, "vllm:num_requests_waiting")
           and time.time() < deadline):
        time.sleep(1)
    assert _gauge(url, "vllm:num_requests_running") == _gauge(url, "vllm:num_requests_waiting") == 0
    for key in GREEDY[:3]:
        r = requests.post(url + "/v1/completions", timeout=REQUEST_TIMEOUT, json={
            "model": model, "prompt": prompts[key], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == reference[key]
    for m in spec_metrics:
        assert m is not None and m["num_spec_tokens"] == K
        assert m["num_accepted_draft_tokens"] <= m["num_draft_tokens"] < K * m["num_spec_steps"], m


def _gauge(url: str, name: str) -> float:
    return sum(v for n, _, v in _samples(url) if n == name)


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample on /metrics (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=30).text
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_metrics_endpoint_counts_trees_by_depth(server) -> None:
    """/metrics after the load: drafted tokens per step are tree depths (fewer than the
    13 scheduled nodes), position p counts steps that accepted depth p + 1, so the positions
    sum to the accepted tokens and never grow with depth."""
    samples = _samples(server.url)

    def total(name: str) -> float:
        return sum(v for n, _, v in samples if n == name)

    drafts = total("vllm:spec_decode_num_drafts_total")
    drafted = total("vllm:spec_decode_num_draft_tokens_total")
    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = {int(lab["position"]): v for n, lab, v in samples
               if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    print("metrics: drafts", drafts, "drafted", drafted, "accepted", accepted, "per position", per_pos)
    assert sorted(per_pos) == list(range(K))
    assert drafts > 0 and 0 < accepted <= drafted < K * drafts
    assert sum(per_pos.values()) == accepted and per_pos[0] <= drafts
    assert all(per_pos[p] >= per_pos[p + 1] for p in range(K - 1)), per_pos
