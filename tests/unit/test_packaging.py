"""What the wheel ships: one top-level package (vllm_clover, plus the dist-alias module and its
.pth), the C++ kernel sources the CPU kernels are JIT-built from, and the shipped heads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import REPO


def test_wheel_has_one_package_with_kernel_sources_and_heads(tmp_path) -> None:
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             "docs", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("vllm_clover-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"vllm_clover", "vllm_clover_dist_alias.py", "vllm_clover_dist_alias.pth"}, top
    assert {"vllm_clover/kernels/csrc/linear_cpu.cpp", "vllm_clover/kernels/csrc/tree_attention_cpu.cpp"} <= set(names)
    assert "vllm_clover/heads/smollm2-135m-instruct-clover2/model.safetensors" in names
