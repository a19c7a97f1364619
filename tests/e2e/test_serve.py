"""`vllm serve` (the stock console script) and `vllm-clover serve` over HTTP on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.conftest import venv_bin
from tests.e2e.test_clover_serve import check_concurrent_mixed_clients
from vllm_clover.training.train import shipped_heads_dir
from tests.e2e.server import free_port, running_server

pytestmark = pytest.mark.slow

SERVE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(1 << 30),
               "--max-model-len", "2048"]


def _check_answers(server, model: str) -> None:
    chat = server.post("/v1/chat/completions", {
        "model": model, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert chat.status_code == 200, chat.text
    assert "Paris" in chat.json()["choices"][0]["message"]["content"]

    comp = server.post("/v1/completions", {
        "model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert comp.status_code == 200, comp.text
    body = comp.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"].strip()


def test_stock_vllm_serve_answers_and_shuts_down(default_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    cmd = [venv_bin("vllm"), "serve", str(default_model_dir), "--port", str(port),
           "--host", "127.0.0.1", *SERVE_FLAGS]
    with running_server(cmd, port, tmp_path / "serve.log") as server:
        _check_answers(server, str(default_model_dir))
        bad = server.post("/v1/completions", {"model": str(default_model_dir), "prompt": "x",
                                              "max_tokens": -1})
        assert bad.status_code == 400, bad.text  # malformed request: an HTTP error...
        _check_answers(server, str(default_model_dir))  # ...and the server keeps serving
    assert server.shutdown == {"returncode": 0, "leftover_children": []}, server.log_tail()


def test_vllm_clover_serve_default_model(tmp_path: Path) -> None:
    """The README's server command path: default model, CPU defaults, served name."""
    port = free_port()
    cmd = [venv_bin("vllm-clover"), "serve", "--port", str(port), "--enforce-eager",
           "--max-model-len", "2048"]
    with running_server(cmd, port, tmp_path / "serve.log") as server:
        _check_answers(server, "SmolLM2-135M-Instruct")
        log = server.log_tail(200_000)
        assert "--dtype float32" in log and "curl http://127.0.0.1" in log
        server.model = "SmolLM2-135M-Instruct"
        check_concurrent_mixed_clients(server)  # the README server, concurrent mixed clients
        if (shipped_heads_dir() / "config.json").is_file():  # Clover on, with the shipped heads
            # (the server's copy of the heads is the installed package's, not this checkout's)
            assert '"method": "clover"' in log and f"heads/{shipped_heads_dir().name}" in log
            metrics = requests.get(server.url + "/metrics", timeout=30).text
            drafted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
            assert drafted and drafted[0] > 0, drafted
    assert server.shutdown["returncode"] == 0 and not server.shutdown["leftover_children"]
