# SPDX-License-Identifier: Apache-2.0
"""One patched symbol (``Patch``): how the plugin names, finds, checks and replaces it.

Every module that patches vLLM or vllm-ascend declares its ``Patch`` rows next to the code that applies
them and applies them through these target strings (``"module:Qualified.name"``), so the rows that
``manifest`` verifies at start-up are the ones actually patched. A leaf module: it imports nothing of the
package beyond the release table.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_ascend_routing.releases import Generation, span_text

PATCHED = "_vllm_ascend_routing_patched"  # marker on every replacement: patching twice is a no-op
CAPTURING = (Generation.SHM, Generation.RUNNER_OUTPUT, Generation.AUX_OUTPUT)  # every supported generation
VALIDATION = "validation"  # Patch.feature of the validation-mode patches (VLLM_ASCEND_ROUTING_VALIDATE)


@dataclass(frozen=True)
class Patch:
    """One patched symbol. ``target`` is ``"module:Qualified.name"``."""

    target: str
    why: str
    remove_when: str
    generations: tuple[Generation, ...] = CAPTURING
    params: tuple[str, ...] = ()  # leading parameter names the plugin calls or receives
    platform: str = "any"  # "any", "cpu", "npu"
    # False: absent in some supported releases, and the code applying it skips it there.
    required: bool = True
    # Non-empty: at least one target of this group must exist (e.g. vLLM's binder moved from a runner
    # method, 0.22-0.27, to a module function, 0.28-0.30: one of the two is where the buffer is handed over).
    one_of: str = ""
    releases: str = ""  # narrower than the generations' spans, e.g. "vLLM 0.28.0-0.30.0"
    feature: str = ""  # non-empty: applied (and verified) only while that feature is on, e.g. VALIDATION

    @property
    def package(self) -> str:
        return self.target.split(".", 1)[0]

    @property
    def release_text(self) -> str:
        return self.releases or ", ".join(span_text(generation) for generation in self.generations)


def resolve(target: str) -> Any:
    """The object ``"module:Qualified.name"`` names; raises ``LookupError`` saying what is missing."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"module {module_name} cannot be imported ({exc})") from exc
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise LookupError(f"{module_name} has no {qualname}")
        obj = getattr(obj, part)
    return obj


def problem(patch: Patch) -> str | None:
    """What is wrong with ``patch``'s target in the installed release (``None``: fine or optional-absent)."""
    try:
        obj = resolve(patch.target)
    except LookupError as exc:
        return None if not patch.required else str(exc)
    if not patch.params:
        return None
    try:
        names = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return f"{patch.target} has no inspectable signature"
    missing = [name for name in patch.params if name not in names]
    if missing:
        return f"{patch.target}{inspect.signature(obj)} lacks parameter(s) {', '.join(missing)}"
    return None


def replace(patch: Patch, make: Callable[[Any], Any]) -> bool:
    """Set ``patch``'s target to ``make(current)``, once (a marked current value is left alone).

    Returns whether the target exists; an absent optional target is skipped, an absent required one
    raises ``LookupError`` (start-up verification refuses it earlier, with its name).
    """
    module_name, _, qualname = patch.target.partition(":")
    owner_path, _, name = qualname.rpartition(".")
    try:
        owner = resolve(f"{module_name}:{owner_path}") if owner_path else importlib.import_module(module_name)
    except (LookupError, ImportError):
        if patch.required:
            raise
        return False
    current = inspect.getattr_static(owner, name, None) if isinstance(owner, type) else getattr(owner, name, None)
    if current is None:
        if patch.required:
            raise LookupError(f"{module_name} has no {qualname}")
        return False
    if not getattr(current, PATCHED, False) and not getattr(getattr(current, "__func__", None), PATCHED, False):
        setattr(owner, name, mark(make(current)))
    return True


def mark(replacement: Any) -> Any:
    """Mark ``replacement`` as the plugin's (the unwrapped function of a static/class method too)."""
    setattr(getattr(replacement, "__func__", replacement), PATCHED, True)
    return replacement
