"""`vllm serve <model> --speculative-model clover:<dir>` over HTTP: completions and chat,
streaming and not, greedy and temperature 0.8, spec-decode counters on /metrics; and a
bad checkpoint fails in the front end with one readable line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests

from tests.conftest import venv_bin
from tests.server import free_port, running_server

pytestmark = pytest.mark.slow

FLAGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 30),
         "--max-model-len", "2048"]


def _stream(server, path: str, body: dict) -> str:
    text = []
    with requests.post(server.url + path, json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def test_serve_with_speculative_model_clover(default_model_dir: Path, clover_ckpt_dir: Path,
                                            tmp_path: Path) -> None:
    model = str(default_model_dir)
    port = free_port()
    cmd = [venv_bin("vllm"), "serve", model, "--port", str(port), "--host", "127.0.0.1", *FLAGS,
           "--speculative-model", f"clover:{clover_ckpt_dir}", "--num-speculative-tokens", "3"]
    with running_server(cmd, port, tmp_path / "serve.log") as server:
        comp = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        r = server.post("/v1/completions", comp)
        assert r.status_code == 200, r.text
        greedy_text = r.json()["choices"][0]["text"]
        assert r.json()["usage"]["completion_tokens"] == 16
        assert _stream(server, "/v1/completions", comp) == greedy_text  # greedy: same text streamed

        chat = {"model": model, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        r = server.post("/v1/chat/completions", chat)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        assert _stream(server, "/v1/chat/completions", chat) == r.json()["choices"][0]["message"]["content"]

        for path, body in (("/v1/completions", {**comp, "temperature": 0.8, "max_tokens": 12}),
                           ("/v1/chat/completions", {**chat, "temperature": 0.8, "max_tokens": 12})):
            r = server.post(path, body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] > 0
        assert _stream(server, "/v1/completions", {**comp, "temperature": 0.8})

        metrics = requests.get(server.url + "/metrics", timeout=30).text
        drafts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and drafts[0] > 0, [ln for ln in metrics.splitlines() if "spec_decode" in ln]
    assert server.shutdown["returncode"] == 0 and not server.shutdown["leftover_children"], \
        server.log_tail()


def test_serve_bad_checkpoint_fails_before_engine_starts(default_model_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-clover"
    proc = subprocess.run(
        [venv_bin("vllm"), "serve", str(default_model_dir), "--port", str(free_port()), *FLAGS,
         "--speculative-model", f"clover:{missing}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()][-1]
    assert "CloverCheckpointError" in last and str(missing) in last and "does not exist" in last, last
    assert "EngineCore" not in proc.stdout + proc.stderr
