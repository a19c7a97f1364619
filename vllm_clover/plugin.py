"""The ``vllm.general_plugins`` entry point: ``clover = vllm_clover.plugin:register``.

vLLM calls ``register()`` in every process it starts (front end / ``LLM``, EngineCore,
each worker, the model-registry inspection subprocess), so it must be idempotent, cheap, and
must not initialise any device. It checks the vLLM release against ``PINNED_VLLM_VERSION``
(``vllm_clover/__init__.py``, the one place the pin is written; setup.py reads it too) and
applies ``vllm_clover.patches.CATALOGUE``, which lists everything it changes.
"""

from __future__ import annotations

import logging

from vllm_clover import PINNED_VLLM_VERSION

logger = logging.getLogger("vllm_clover")

_registered = False


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the release the plugin's patches were checked against."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(found: str | None = None) -> None:
    """Fail loudly unless vLLM is exactly the pinned release (local suffixes like +cpu ok)."""
    found = installed_vllm_version() if found is None else found
    release = found.split("+", 1)[0]
    if release != PINNED_VLLM_VERSION:
        raise VllmVersionError(
            f"vllm-clover {__import__('vllm_clover').__version__} supports vLLM "
            f"=={PINNED_VLLM_VERSION} only, found vLLM {found}. Install the pinned release "
            f"(pip install 'vllm-clover[cpu]' or '[gpu]'), or remove vllm-clover from this "
            f"environment (or leave it out of VLLM_PLUGINS) to run vLLM without it."
        )


def is_registered() -> bool:
    """True once ``register()`` has run in this process (used by tests across processes)."""
    return _registered


def register() -> None:
    """Entry point called by vLLM's ``load_general_plugins()``; idempotent."""
    global _registered
    if _registered:
        return
    check_vllm_version()
    from vllm_clover import patches
    patches.apply_all()  # the CPU environment first: before vLLM spawns any process
    _registered = True
    logger.debug("vllm-clover registered (vLLM %s)", installed_vllm_version())
