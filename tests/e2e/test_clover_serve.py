"""`vllm serve <model> --speculative-model clover:<dir>` over HTTP, one server for the
module: completions and chat, streaming and not, greedy and temperature 0.8; n > 1,
logprobs, echo and prompt logprobs; spec-decode counters on /metrics and per-request
metrics; hostile requests (each a 4xx, the server keeps serving); concurrent streaming
and non-streaming clients with mixed sampling settings; clean shutdown. And start-up
errors: a bad Clover checkpoint ends `vllm serve` with one line, no traceback."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import venv_bin
from tests.e2e.server import free_port, running_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
FLAGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 30),
         "--max-model-len", str(MAX_MODEL_LEN)]
K = 3
MAX_N = 64


@pytest.fixture(scope="module")
def server(default_model_dir: Path, clover_ckpt_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    cmd = [venv_bin("vllm"), "serve", str(default_model_dir), "--port", str(port), "--host", "127.0.0.1",
           *FLAGS, "--speculative-model", f"clover:{clover_ckpt_dir}", "--num-speculative-tokens", str(K),
           "--per-request-spec-decode-metrics", "summary"]
    # vLLM accepts n up to VLLM_MAX_N_SEQUENCES (default 16384): n=10000 is a valid request
    # that keeps a CPU server busy for many minutes (it is aborted when the client goes).
    # Operators cap it with this variable; the hostile-request test relies on that cap.
    env = {"VLLM_MAX_N_SEQUENCES": str(MAX_N)}
    with running_server(cmd, port, tmp_path_factory.mktemp("serve") / "serve.log", env=env) as srv:
        srv.model = str(default_model_dir)
        yield srv
    # Ctrl-C: exit 0 and no EngineCore / worker left behind.
    assert srv.shutdown["returncode"] == 0 and not srv.shutdown["leftover_children"], srv.log_tail()


def _stream(server, path: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """POST with stream=True; returns text per choice index and all parsed chunks."""
    text: dict[int, str] = {}
    chunks = []
    with requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=180) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            chunks.append(chunk)
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                text[choice["index"]] = text.get(choice["index"], "") + piece
    return text, chunks


def _completion(server, **body) -> dict:
    r = server.post("/v1/completions", {"model": server.model, "prompt": "The capital of France is",
                                        "max_tokens": 16, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ============================================================================ basics
def test_completions_and_chat(server) -> None:
    body = _completion(server)
    greedy_text = body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 16
    comp = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    assert _stream(server, "/v1/completions", comp)[0] == {0: greedy_text}  # greedy: same text streamed

    chat = {"model": server.model, "max_tokens": 24, "temperature": 0, "messages": CHAT}
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in content
    assert _stream(server, "/v1/chat/completions", chat)[0] == {0: content}

    for path, body in (("/v1/completions", {**comp, "temperature": 0.8, "max_tokens": 12}),
                       ("/v1/chat/completions", {**chat, "temperature": 0.8, "max_tokens": 12})):
        r = server.post(path, body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
    assert _stream(server, "/v1/completions", {**comp, "temperature": 0.8})[0][0]


# ============================================================================ n, logprobs
def test_n_logprobs_echo_prompt_logprobs(server) -> None:
    body = _completion(server, n=3, temperature=0.8, top_p=0.95, max_tokens=10, logprobs=2, seed=3)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    for c in body["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) > 0
        assert all(v <= 0 for v in lp["token_logprobs"])
        assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])  # top-2 plus the sampled one

    # Greedy logprobs: streaming and non-streaming agree token by token.
    greedy = _completion(server, logprobs=1, max_tokens=12)["choices"][0]
    _, chunks = _stream(server, "/v1/completions", {
        "model": server.model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
        "logprobs": 1})
    streamed = [v for ch in chunks for c in ch["choices"] for v in (c.get("logprobs") or {}).get(
        "token_logprobs", [])]
    assert len(streamed) == len(greedy["logprobs"]["token_logprobs"]) == 12
    assert streamed == pytest.approx(greedy["logprobs"]["token_logprobs"], abs=1e-4)

    # echo + logprobs: the prompt tokens come back with their logprobs (first is None).
    echo = _completion(server, echo=True, logprobs=1, max_tokens=4)["choices"][0]
    assert echo["text"].startswith("The capital of France is")
    assert echo["logprobs"]["token_logprobs"][0] is None
    assert len(echo["logprobs"]["tokens"]) >= 5 + 4
    # vLLM's prompt_logprobs extension.
    plp = _completion(server, prompt_logprobs=2, max_tokens=4)["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) >= 5 and all(1 <= len(e) <= 3 for e in plp[1:])

    # Chat: logprobs with top_logprobs, n=2 streamed.
    r = server.post("/v1/chat/completions", {"model": server.model, "messages": CHAT, "max_tokens": 8,
                                             "temperature": 0, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    texts, _ = _stream(server, "/v1/chat/completions", {"model": server.model, "messages": CHAT,
                                                         "max_tokens": 8, "temperature": 0.8, "n": 2})
    assert sorted(texts) == [0, 1] and all(texts.values())


# ============================================================================ observability
def _spec(body: dict) -> dict:
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    assert spec, body
    assert spec["num_spec_tokens"] == K and len(spec["acceptance_histogram"]) == K + 1
    assert 0 <= spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"] <= K * spec["num_spec_steps"]
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) > 0
    assert 1.0 <= spec["mean_acceptance_length"] <= K + 1
    return spec


def test_per_request_spec_decode_metrics(server) -> None:
    """--per-request-spec-decode-metrics summary: metrics.speculative_decoding on
    completions and chat, streamed on the final usage chunk (include_usage)."""
    _spec(_completion(server, max_tokens=24))
    r = server.post("/v1/chat/completions", {"model": server.model, "messages": CHAT, "max_tokens": 16})
    assert r.status_code == 200, r.text
    _spec(r.json())
    _, chunks = _stream(server, "/v1/completions", {
        "model": server.model, "prompt": "Count: 1, 2, 3,", "max_tokens": 16, "temperature": 0,
        "stream_options": {"include_usage": True}})
    _spec(chunks[-1])
    # n > 1: vLLM leaves them out (one summary per sequence, not attributable to one).
    assert not (_completion(server, n=2, temperature=0.8, max_tokens=4).get("metrics") or {}).get(
        "speculative_decoding")


def _prometheus(server) -> dict[str, float]:
    """The spec-decode counters' ``_total`` samples (``_created`` samples are timestamps)."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode") and "_total{" in line:
            name, value = line.rsplit(" ", 1)
            if "_per_pos" in name:
                pos = name.split('position="')[1].split('"')[0]
                out[f"per_pos[{pos}]"] = float(value)
            else:
                out[name.split("{")[0]] = float(value)
    return out


def test_prometheus_spec_decode_counters(server) -> None:
    _completion(server, max_tokens=32)
    m = _prometheus(server)
    drafts, tokens = m["vllm:spec_decode_num_drafts_total"], m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f"per_pos[{i}]"] for i in range(K)]
    assert f"per_pos[{K}]" not in m
    assert drafts > 0 and drafts <= tokens <= K * drafts
    assert 0 <= accepted <= tokens and sum(per_pos) == accepted
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(K - 1))


# ============================================================================ hostile clients
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 100)
HOSTILE = [
    ("bad JSON", "/v1/completions", b'{"model": "m", "prompt": "hi", '),
    ("not an object", "/v1/completions", b'[1, 2, 3]'),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -5}),
    ("huge n (above VLLM_MAX_N_SEQUENCES)", "/v1/completions",
     {"prompt": "hi", "n": 10000, "temperature": 0.8, "max_tokens": 4}),
    ("n above vLLM's default limit 16384", "/v1/completions",
     {"prompt": "hi", "n": 10 ** 6, "temperature": 0.8, "max_tokens": 4}),
    ("n = 0", "/v1/completions", {"prompt": "hi", "n": 0, "max_tokens": 4}),
    ("n > 1 greedy", "/v1/completions", {"prompt": "hi", "n": 3, "temperature": 0, "max_tokens": 4}),
    ("prompt longer than max_model_len", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}),
    ("max_tokens beyond max_model_len", "/v1/completions", {"prompt": "hi", "max_tokens": 10 * MAX_MODEL_LEN}),
    ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}, "max_tokens": 4}),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}),
    ("temperature wrong type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}),
    ("top_p out of range", "/v1/completions", {"prompt": "hi", "top_p": 1.5, "max_tokens": 4}),
    ("token id out of vocab", "/v1/completions", {"prompt": [10 ** 9], "max_tokens": 4}),
    ("min_p (unsupported with spec decode)", "/v1/completions",
     {"prompt": "hi", "min_p": 0.1, "temperature": 0.8, "max_tokens": 4}),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 10 ** 6, "max_tokens": 4}),
    ("chat messages wrong type", "/v1/chat/completions", {"messages": "hello", "max_tokens": 4}),
    ("chat missing messages", "/v1/chat/completions", {"max_tokens": 4}),
]


def _post_raw(server, path: str, payload) -> requests.Response:
    if isinstance(payload, bytes):
        return requests.post(server.url + path, data=payload, timeout=120,
                             headers={"Content-Type": "application/json"})
    return requests.post(server.url + path, json={"model": server.model, **payload}, timeout=120)


def test_hostile_requests_get_4xx_and_server_keeps_serving(server) -> None:
    """Each hostile request is answered with a 4xx while a normal streaming request runs
    next to them; afterwards the server still answers normally."""
    normal: dict = {}

    def background() -> None:
        # ignore_eos: at T=0.8 the model may sample end-of-text first (an empty, valid answer).
        normal["text"], chunks = _stream(server, "/v1/completions", {
            "model": server.model, "prompt": "Write a short story about a robot.", "max_tokens": 48,
            "temperature": 0.8, "top_p": 0.95, "ignore_eos": True,
            "stream_options": {"include_usage": True}})
        normal["usage"] = next((c["usage"] for c in chunks if c.get("usage")), None)

    thread = threading.Thread(target=background)
    thread.start()
    statuses = {}
    for name, path, payload in HOSTILE:
        r = _post_raw(server, path, payload)
        statuses[name] = (r.status_code, r.text[:200])
    thread.join(timeout=300)
    bad = {n: s for n, s in statuses.items() if not 400 <= s[0] < 500}
    assert not bad, bad
    assert statuses["unknown model"][0] == 404
    assert normal.get("text", {}).get(0), normal
    assert normal["usage"]["completion_tokens"] == 48, normal
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert _completion(server, max_tokens=8)["usage"]["completion_tokens"] == 8


def test_concurrent_mixed_clients(server) -> None:
    check_concurrent_mixed_clients(server)


def check_concurrent_mixed_clients(server) -> None:
    """22 concurrent clients: completions and chat, streaming and not, greedy, T=0.8 with
    top-p, and seeded. Greedy results equal the same request run alone; two identical
    seeded requests in the same batch give identical text (drafts of seeded requests
    come from their own generators)."""
    prompt = "Once upon a time, in a small village,"
    alone = _completion(server, prompt=prompt, max_tokens=24)["choices"][0]["text"]
    chat_alone = server.post("/v1/chat/completions", {
        "model": server.model, "messages": CHAT, "max_tokens": 24, "temperature": 0}).json()[
        "choices"][0]["message"]["content"]
    jobs = []
    for i in range(4):
        for stream in (False, True):
            jobs.append(("greedy", "/v1/completions", stream, {"prompt": prompt, "temperature": 0}))
            jobs.append(("chat-greedy", "/v1/chat/completions", stream,
                         {"messages": CHAT, "temperature": 0}))
    jobs += [("sampled", "/v1/completions", i % 2 == 0, {"prompt": prompt, "temperature": 0.8,
                                                          "top_p": 0.95}) for i in range(4)]
    jobs += [("seeded", "/v1/completions", False, {"prompt": prompt, "temperature": 0.8, "top_p": 0.95,
                                                   "seed": 1234}) for _ in range(2)]
    jobs += [("seeded-stream", "/v1/completions", True, {"prompt": prompt, "temperature": 0.8,
                                                         "top_p": 0.95, "seed": 99}) for _ in range(2)]

    def run(job):
        kind, path, stream, body = job
        body = {"model": server.model, "max_tokens": 24, **body}
        if stream:
            return kind, _stream(server, path, body)[0].get(0, "")
        r = requests.post(server.url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return kind, choice.get("text") if "text" in choice else choice["message"]["content"]

    start = time.time()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    assert len(results) == len(jobs) and time.time() - start < 600
    by_kind: dict[str, list[str]] = {}
    for kind, text in results:
        assert text, kind
        by_kind.setdefault(kind, []).append(text)
    assert set(by_kind["greedy"]) == {alone}
    assert set(by_kind["chat-greedy"]) == {chat_alone}
    assert len(set(by_kind["seeded"])) == 1 and len(set(by_kind["seeded-stream"])) == 1


# ============================================================================ start-up errors
def _serve_fails(model: Path, *flags: str) -> tuple[subprocess.Popen, float]:
    proc = subprocess.Popen([venv_bin("vllm"), "serve", str(model), "--port", str(free_port()), *FLAGS,
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, time.time()


def test_serve_bad_checkpoint_fails_with_one_line(default_model_dir: Path, clover_ckpt_dir: Path,
                                                  tmp_path: Path) -> None:
    """Three spellings, run in parallel: a missing directory via --speculative-model
    (argparse type check, before any model is read), the same via --speculative-config
    JSON, and K larger than the checkpoint's heads (both found by the translation in the
    front end; the serve command prints them as one line). Each exits non-zero, names the
    problem on one stderr line, prints no traceback and never starts an EngineCore."""
    missing = tmp_path / "no-such-clover"
    cases = {
        "flag": (_serve_fails(default_model_dir, "--speculative-model", f"clover:{missing}"),
                 [str(missing), "does not exist", "--speculative-model"]),
        "json": (_serve_fails(default_model_dir, "--speculative-config",
                              json.dumps({"method": "clover", "model": str(missing)})),
                 [str(missing), "does not exist"]),
        "k": (_serve_fails(default_model_dir, "--speculative-model", f"clover:{clover_ckpt_dir}",
                           "--num-speculative-tokens", "99"),
              ["num_speculative_tokens=99", "heads"]),
    }
    for name, ((proc, start), needles) in cases.items():
        out, err = proc.communicate(timeout=300)
        elapsed = time.time() - start
        assert proc.returncode not in (0, None), (name, out, err)
        assert "Traceback" not in out + err, (name, err)
        assert "EngineCore" not in out + err, (name, err)
        lines = [ln for ln in err.splitlines() if all(n in ln for n in needles)]
        assert len(lines) == 1 and "error:" in lines[0], (name, err)
        print(name, f"{elapsed:.0f}s", lines[0])
