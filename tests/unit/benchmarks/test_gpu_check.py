"""vllm_clover/benchmarks/gpu_check.sh on a machine without a GPU: stage 1 runs the gpu_path
tests in Triton's interpreter (GPU_CHECK_INTERPRET=1) and passes; stage 2 says why it cannot
run (the CPU build of vLLM) and the script exits 0; without the variable it refuses clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

SCRIPT = REPO / "vllm_clover/benchmarks/gpu_check.sh"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs on it (stage 1 and 2)")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(PYTHON=sys.executable, OUT=str(tmp_path), **env)
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full, timeout=1200)


def test_stage1_in_the_interpreter_and_stage2_skipped(tmp_path: Path) -> None:
    done = _run(tmp_path, GPU_CHECK_INTERPRET="1")
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "stage 1 passed on CPU" in text and "Triton interpreter" in text
    assert "stage 2 skipped: vLLM" in text and "not a CUDA build" in text
    log = (tmp_path / "gpu_check_stage1.log").read_text()
    summary = log.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 60, summary  # the kernels, the FlashAttention-layout path and the trunk inputs
    assert not (tmp_path / "gpu_check_stage2.json").exists()


def test_without_a_gpu_or_the_interpreter_it_refuses(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 3
    assert "no CUDA GPU visible" in done.stderr and "GPU_CHECK_INTERPRET=1" in done.stderr
