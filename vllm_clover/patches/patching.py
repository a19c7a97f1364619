"""The one way vllm-clover changes an attribute of a vLLM class or module, and the ``Patch`` record.

:func:`wrap` (and :func:`replace`, a wrap that ignores the original) is the only code that
assigns to a vLLM attribute. It

* marks the new attribute with the name of the patch that installed it (attribute ``MARK``;
  :func:`patched_by` reads it back);
* sets ``__wrapped__`` to the original, so ``inspect.signature`` and ``inspect.unwrap`` still
  see vLLM's function (the shape checks rely on it);
* keeps a ``staticmethod`` / ``classmethod`` one;
* is a no-op when the same patch already installed the attribute (a second plugin load);
* refuses, with :class:`PatchConflict`, an attribute that a different patch already replaced,
  so two patches never stack silently on one vLLM function.

The shape-check helpers at the bottom (:func:`params`, :func:`source`,
:func:`file_function_source`) are what the patches' ``check`` functions read vLLM with.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

# Attribute set on every object a patch installed; its value is the patch's name.
MARK = "__vllm_clover_wrapped__"


class PatchConflict(RuntimeError):
    """A patch tried to replace an attribute that another patch already replaced."""


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change vllm-clover makes to vLLM, as listed by ``vllm-clover patches``."""

    name: str
    target: str  # dotted path of the vLLM object touched
    why: str  # what the patch changes and why, in one or two sentences
    remove_when: str
    apply: Callable[[], None]  # installs the patch; safe to call again
    upstream: str = "none known"  # the vLLM issue / PR that would make the patch unnecessary
    # Raises AssertionError if the vLLM target no longer has the shape the patch relies on
    # (run by tests/unit/patches/test_patches.py without applying anything).
    check: Callable[[], None] | None = None
    no_check: str = ""  # why there is no shape check (required when check is None)


def patched_by(obj: Any) -> str | None:
    """The name of the patch that installed ``obj``, or None for vLLM's own objects."""
    mark = getattr(obj, MARK, None)
    return mark if isinstance(mark, str) else None


def _patch_name(patch: Patch | str) -> str:
    return patch if isinstance(patch, str) else patch.name


def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
         patch: Patch | str) -> Callable[..., Any]:
    """Set ``owner.name`` (a class or module attribute) to ``make(original)``, marked as ``patch``'s.

    ``original`` is the plain function (a staticmethod's or classmethod's ``__func__``); the
    result is stored in the same kind of descriptor. Returns the installed function (the one
    already there if ``patch`` installed it before). Raises :class:`PatchConflict` if another
    patch installed the current attribute.
    """
    patch_name = _patch_name(patch)
    raw = inspect.getattr_static(owner, name)
    descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    original = raw.__func__ if descriptor is not None else raw
    holder = patched_by(original)
    if holder == patch_name:
        return original
    if holder is not None:
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise PatchConflict(f"vllm-clover: {where}.{name} is already patched by {holder!r}; "
                            f"patch {patch_name!r} does not stack on another patch")
    new = make(original)
    setattr(new, MARK, patch_name)
    new.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, descriptor(new) if descriptor is not None else new)
    return new


def replace(owner: Any, name: str, new: Callable[..., Any], patch: Patch | str) -> Callable[..., Any]:
    """Set ``owner.name`` to ``new`` (a function of the same signature, used by this patch
    only), with :func:`wrap`'s marking, ``__wrapped__`` and refusal rules."""
    return wrap(owner, name, lambda _original: new, patch)


# ------------------------------------------------------------------ shape-check helpers
def params(obj: object) -> list[str]:
    """Parameter names of ``obj`` (through ``__wrapped__``: vLLM's own signature)."""
    return list(inspect.signature(obj).parameters)


def source(obj: object) -> str:
    """Source text of vLLM's function behind ``obj`` (unwrapping our wrappers)."""
    return inspect.getsource(inspect.unwrap(obj))


def file_function_source(module: str, function: str) -> str:
    """A top-level function's text as in vLLM's file (the module attribute may be ours)."""
    import importlib.util
    from pathlib import Path

    src = Path(importlib.util.find_spec(module).origin).read_text()
    body = src[src.index(f"def {function}("):]
    return body[: body.index("\ndef ", 1)]
