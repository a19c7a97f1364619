"""Faults a Clover server survives, against one `vllm serve` with a tree (small_5 + 8 lookup
tokens + the datastore, the float32 serve defaults' shape; eager, for a quick start) on a
copy of the shipped heads and a KV cache of 6 blocks (768 tokens) for up to 8 running
requests of 160 new tokens, so vLLM must preempt under load. Greedy float32 outputs are compared token for
token with plain vLLM (an offline ``LLM``, same prompts as token ids).

* preemption under load: 12 concurrent requests, preemptions counted, every output identical;
* a streaming client that disconnects mid-tree: the request is aborted, the others are
  identical, nothing stays running or waiting;
* drafts that would run past ``max_tokens`` or ``max_model_len``: exact lengths, identical
  tokens, prompts over the limit refused with a 400;
* the heads directory deleted after start-up: the server keeps serving (heads are loaded at
  start), identically;
* a restart on a corrupted heads directory or a truncated datastore: ``vllm serve`` exits
  with one line naming the file, no traceback, no engine started;
* a restart with the same caches ($VLLM_CLOVER_CACHE: the converted model; the built C++
  kernels; vLLM's cache root) and the same heads path: the same outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from tests.conftest import venv_bin
from tests.e2e.reference import plain_greedy_tokens
from tests.e2e.server import free_port, running_server

pytestmark = pytest.mark.slow

HEADS = Path(__file__).resolve().parents[2] / "vllm_clover/heads/smollm2-135m-instruct-clover2"
MAX_MODEL_LEN = 384
MAX_TOKENS = 160
SPEC = {"method": "clover", "tree": "small_5", "prompt_lookup_tokens": 8, "tree_token_budget": 14,
        "datastore": "datastore.npz", "draft_vocab_size": 4096}
# 6 blocks of 128 tokens: a request is admitted with one and needs a second past 128 tokens
# (prompt + 160 tokens + 13 drafts), so 12 requests at up to 8 running exhaust the cache and
# vLLM preempts running requests (it only queues new ones while blocks are short).
FLAGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 30),
         "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "6", "--max-num-seqs", "8"]
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ", "List the days of the week: Monday,",
         "Write a haiku about the sea.", "Q: What is 12 times 7?\nA:", "import numpy as np\n\n# mean of a list\n",
         "Translate to French: I like apples.", "The three primary colours are",
         "Once upon a time, in a small village,",
         "The printing press was invented by", "SELECT name FROM users WHERE", "Photosynthesis is the process"]
LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. ") * 11


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    out = {t: tok(t).input_ids for t in TEXTS}
    out["LONG"] = tok(LONG).input_ids
    assert MAX_MODEL_LEN - 64 < len(out["LONG"]) < MAX_MODEL_LEN - 8
    return out


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, prompts: dict) -> dict[str, list[int]]:
    """Plain vLLM's greedy tokens (float32); LONG runs into max_model_len."""
    return plain_greedy_tokens(default_model_dir, prompts, {k: MAX_MODEL_LEN - len(v) if k == "LONG" else MAX_TOKENS
                                                            for k, v in prompts.items()}, MAX_MODEL_LEN)


class CloverServer:
    """The module's server on its own heads copy and caches; ``restart`` stops it and
    starts it again with the same flags and environment."""

    def __init__(self, model: Path, heads: Path, env: dict[str, str], logs: Path) -> None:
        self.model, self.heads, self.env, self.logs = model, heads, env, logs
        self._stack = ExitStack()
        self.starts = 0
        self.srv = None

    def command(self, heads: Path, port: int) -> list[str]:
        return [venv_bin("vllm"), "serve", str(self.model), "--port", str(port), "--host", "127.0.0.1", *FLAGS,
                "--speculative-config", json.dumps({**SPEC, "model": str(heads)})]

    def start(self) -> None:
        port = free_port()
        self.starts += 1
        self.log = self.logs / f"serve{self.starts}.log"
        self.srv = self._stack.enter_context(
            running_server(self.command(self.heads, port), port, self.log, startup_timeout=900, env=self.env))

    def restart(self) -> None:
        self._stack.close()
        self._stack = ExitStack()
        self.start()

    def close(self) -> None:
        self._stack.close()

    def complete(self, ids: list[int], **body) -> dict:
        r = requests.post(self.srv.url + "/v1/completions", timeout=300, json={
            "model": str(self.model), "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def tokens(self, ids: list[int], **body) -> list[int]:
        return self.complete(ids, **body)["choices"][0]["token_ids"]

    def gauge(self, name: str) -> float:
        total = 0.0
        for line in requests.get(self.srv.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, reference: dict):
    root = tmp_path_factory.mktemp("faults")
    heads = root / "heads"
    shutil.copytree(HEADS, heads)
    env = {"VLLM_CACHE_ROOT": str(root / "vllm-cache")}
    s = CloverServer(default_model_dir, heads, env, root)
    s.start()
    try:
        yield s
    finally:
        s.close()
    assert s.srv.shutdown["returncode"] == 0, s.srv.log_tail()


def _all_identical(server: CloverServer, prompts: dict, reference: dict, keys: list[str]) -> dict[str, list[int]]:
    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        got = dict(zip(keys, pool.map(lambda k: server.tokens(prompts[k]), keys)))
    mismatches = [k for k in keys if got[k] != reference[k]]
    assert not mismatches, {k: (got[k], reference[k]) for k in mismatches}
    return got


# ============================================================================ under load
def test_preemption_under_load_is_lossless(server: CloverServer, prompts: dict, reference: dict) -> None:
    before = server.gauge("vllm:num_preemptions_total")
    _all_identical(server, prompts, reference, TEXTS)
    preempted = server.gauge("vllm:num_preemptions_total") - before
    print("preemptions", preempted)
    assert preempted > 0, "6 KV blocks did not force a preemption"


def test_client_disconnect_mid_tree_aborts_only_that_request(server: CloverServer, prompts: dict,
                                                             reference: dict) -> None:
    """Four streaming clients read a few chunks (trees verified, drafts in flight) and hang
    up; the requests beside them finish identically and the engine drops the aborted ones."""
    seen: list[int] = []

    def disconnect(key: str) -> None:
        with requests.post(server.srv.url + "/v1/completions", stream=True, timeout=300, json={
                "model": str(server.model), "prompt": prompts[key], "max_tokens": 300, "temperature": 0,
                "stream": True}) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    chunks += 1
                    if chunks == 4:
                        break
            seen.append(chunks)
        # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=disconnect, args=(k,)) for k in TEXTS[:4]]
    for t in threads:
        t.start()
    _all_identical(server, prompts, reference, TEXTS[4:8])
    for t in threads:
        t.join(timeout=300)
    assert seen == [4, 4, 4, 4]
    deadline = time.time() + 60
    while (server.gauge("vllm:num_requests_running") + server.gauge("vllm:num_requests_waiting")
           and time.time() < deadline):
        time.sleep(1)
    assert server.gauge("vllm:num_requests_running") == server.gauge("vllm:num_requests_waiting") == 0
    _all_identical(server, prompts, reference, TEXTS[:2])


# ============================================================================ limits
def test_drafts_never_run_past_max_tokens_or_max_model_len(server: CloverServer, prompts: dict,
                                                           reference: dict) -> None:
    """A tree drafts up to 13 tokens a step; the output still stops at max_tokens exactly, and
    a prompt 10-60 tokens below max_model_len stops at the limit with the reference tokens."""
    ids, ref = prompts[TEXTS[0]], reference[TEXTS[0]]
    for n in (1, 2, 3, 5, 13, 14):
        body = server.complete(ids, max_tokens=n)
        assert body["usage"]["completion_tokens"] == n and body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["token_ids"] == ref[:n]
    # max_tokens past the context left is clamped to it: generation stops at max_model_len;
    # past max_model_len, or a prompt over it, is refused (vLLM's rules, unchanged by the drafts).
    long_ids = prompts["LONG"]
    body = server.complete(long_ids, max_tokens=MAX_MODEL_LEN)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["token_ids"] == reference["LONG"]
    for prompt, n in ((long_ids, MAX_MODEL_LEN + 1), (long_ids * 2, 4)):
        r = requests.post(server.srv.url + "/v1/completions", timeout=60, json={
            "model": str(server.model), "prompt": prompt, "max_tokens": n})
        assert r.status_code == 400 and str(MAX_MODEL_LEN) in r.json()["error"]["message"], r.text
    assert server.tokens(prompts[TEXTS[1]]) == reference[TEXTS[1]]


# ============================================================================ files
def test_heads_removed_after_start_up_keep_serving(server: CloverServer, prompts: dict, reference: dict) -> None:
    shutil.rmtree(server.heads)
    _all_identical(server, prompts, reference, TEXTS[:3])
    assert requests.get(server.srv.url + "/health", timeout=30).status_code == 200


def _serve_fails(server: CloverServer, heads: Path) -> subprocess.Popen:
    return subprocess.Popen(server.command(heads, free_port()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **server.env})


def test_restart_on_corrupted_heads_or_truncated_datastore_fails_with_one_line(
        server: CloverServer, tmp_path: Path, prompts: dict, reference: dict) -> None:
    """Two restarts while the server runs: heads whose weights file was cut in half, and heads
    whose datastore was. Each exits non-zero with one error line naming the file, no
    traceback, no EngineCore; the running server is unaffected."""
    cut_weights, cut_store = tmp_path / "cut-weights", tmp_path / "cut-store"
    for d, name in ((cut_weights, "model.safetensors"), (cut_store, "datastore.npz")):
        shutil.copytree(HEADS, d)
        f = d / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    cases = {"weights": (_serve_fails(server, cut_weights), cut_weights / "model.safetensors", "truncated"),
             "datastore": (_serve_fails(server, cut_store), cut_store / "datastore.npz", "corrupt")}
    _all_identical(server, prompts, reference, TEXTS[3:5])
    for name, (proc, path, word) in cases.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode not in (0, None), (name, out, err)
        assert "Traceback" not in out + err and "EngineCore" not in out + err, (name, err)
        lines = [ln for ln in err.splitlines() if str(path) in ln]
        assert len(lines) == 1 and "error:" in lines[0] and word in lines[0], (name, err)
        print(name, lines[0])


# ============================================================================ restart
def test_restart_with_the_same_caches_gives_the_same_outputs(server: CloverServer, prompts: dict,
                                                             reference: dict) -> None:
    first = _all_identical(server, prompts, reference, TEXTS[:6])
    if not server.heads.exists():  # removed by test_heads_removed_after_start_up_keep_serving
        shutil.copytree(HEADS, server.heads)
    server.restart()
    assert _all_identical(server, prompts, reference, TEXTS[:6]) == first
