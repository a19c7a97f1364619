"""Start a vLLM OpenAI server as a subprocess on loopback, wait for it, stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> set[int]:
    """All live descendant pids of ``pid`` (from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def post(self, path: str, body: dict, timeout: float = 120) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=timeout)


@contextmanager
def running_server(cmd: list[str], port: int, log: Path, startup_timeout: float = 300,
                   env: dict[str, str] | None = None) -> Iterator[Server]:
    """Run ``cmd`` (which must listen on ``port``), yield once /health answers 200.

    On exit sends SIGINT (what Ctrl-C does) and records in ``server.shutdown`` the exit
    code and whether any child process (EngineCore, workers) outlived the server.
    """
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.time() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if requests.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not ready in {startup_timeout}s:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    finally:
        children = _descendants(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = None
        time.sleep(1)
        leftovers = {p for p in children if _alive(p)}
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        server.shutdown = {"returncode": code, "leftover_children": sorted(leftovers)}
