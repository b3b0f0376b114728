# SPDX-License-Identifier: Apache-2.0
"""One patched symbol (``Patch``), and the one way the plugin replaces anything in vLLM or vllm-ascend (``wrap``).

Every module that patches vLLM or vllm-ascend declares its ``Patch`` rows next to the code that applies
them. A row either *replaces* its target (applied through ``replace`` with that row, so the rows ``manifest``
verifies at start-up are the ones actually patched) or says what the code *relies on* there (a class whose
instances get per-layer wrappers, a class the plugin creates): both are verified the same way.

Every replacement, whatever it replaces (a class attribute, an instance attribute of one layer, a module
global, an entry of a module's table), is installed by ``wrap`` and carries one marker, ``ORIGINAL``: what it
replaced. Wrapping a marked value again is a no-op, or with ``rebind`` replaces the wrapper around the same
original (a layer bound twice never stacks two captures). A leaf module: it imports nothing of the package
beyond the release table.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from vllm_ascend_routing.releases import Generation, generations_in, implemented, span_text

ORIGINAL = "_vllm_ascend_routing_original"  # the one marker, on every replacement: what it replaced
REPLACE = "replace"  # Patch.action: the plugin replaces the target (through ``replace``)
RELY = "rely"  # Patch.action: the plugin uses the target as it is, or wraps it per instance (``wrap``)
CAPTURING = tuple(span.generation for span in implemented())  # every generation the plugin serves
VALIDATION = "validation"  # Patch.feature of the validation-mode patches (VLLM_ASCEND_ROUTING_VALIDATE)


@dataclass(frozen=True)
class Patch:
    """One patched symbol. ``target`` is ``"module:Qualified.name"``."""

    target: str
    why: str
    remove_when: str
    # The generations whose releases have the target. Only a generation's own rows (under ``compat/``) name them;
    # every other row gives ``vllm`` (a span of releases, "0.20.0-0.27.1", "0.27.1-") or serves every generation.
    generations: tuple[Generation, ...] = CAPTURING
    params: tuple[str, ...] = ()  # leading parameter names the plugin calls or receives
    platform: str = "any"  # "any", "cpu", "npu"
    # False: absent in some supported releases, and the code applying it skips it there.
    required: bool = True
    # Non-empty: at least one target of this group must exist (e.g. vLLM's capturer binder, a runner method or a
    # module function by release, ``releases.BINDER_METHOD``: one of the two is where the buffer is handed over).
    one_of: str = ""
    releases: str = ""  # narrower than the generations' spans, e.g. "vLLM 0.28.0-0.30.0"
    feature: str = ""  # non-empty: applied (and verified) only while that feature is on, e.g. VALIDATION
    action: str = REPLACE  # REPLACE or RELY
    vllm: str = ""  # the vLLM releases that have the target ("FIRST-LAST", "FIRST-"): its generations, from the table
    needs: str = ""  # an adapter capability the row needs (e.g. "per_request_output"): checked where it has it

    def __post_init__(self) -> None:
        if self.vllm:
            object.__setattr__(self, "generations", generations_in(self.vllm))

    @property
    def package(self) -> str:
        return self.target.split(".", 1)[0]

    @property
    def release_text(self) -> str:
        if self.releases:
            return self.releases
        if self.vllm:
            return f"vLLM {self.vllm}" if not self.vllm.endswith("-") else f"vLLM {self.vllm[:-1]} and later"
        return ", ".join(span_text(generation) for generation in self.generations)


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
    """Set ``patch``'s target to ``make(current)`` through ``wrap`` (once: a replacement is left alone).

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
    if wrap(owner, name, make) is None:
        if patch.required:
            raise LookupError(f"{module_name} has no {qualname}")
        return False
    return True


def wrap(
    owner: Any, name: Any, make: Callable[[Any], Any], *, rebind: bool = False, add: bool = False, around: bool = False
) -> Any:
    """Set ``owner``'s ``name`` to ``make(current)``, marked with ``current``; returns what is installed there.

    ``owner`` is a class (``name`` found through its bases, set on the class itself), a module or an instance
    (an attribute), or a mapping (an entry: a module's globals, a table). Where ``current`` is already a
    replacement: left alone, or with ``rebind``, replaced by ``make(original)``; with ``around``, an instance's
    attribute that is its class's replacement (another patch) is wrapped around. Where there is no ``current``:
    ``None`` is returned and nothing set, unless ``add`` (then ``make(None)`` is added).
    """
    if isinstance(owner, MutableMapping):
        current = owner.get(name)
    elif isinstance(owner, type):
        current = inspect.getattr_static(owner, name, None)
    else:
        current = getattr(owner, name, None)
    if current is None and not add:
        return None
    if is_wrapped(current) and not (around and _from_the_class(owner, name)):
        if not rebind:
            return current
        current = original_of(current)
    replacement = make(current)
    setattr(_function(replacement), ORIGINAL, current)
    if isinstance(owner, MutableMapping):
        owner[name] = replacement
    else:
        setattr(owner, name, replacement)
    return replacement


def _from_the_class(owner: Any, name: Any) -> bool:
    """Whether ``owner`` is an instance whose ``name`` is its class's: a replacement there (e.g. the per-request
    options' ``take_output``) is another patch, which an ``around`` wrapper of the instance goes around; leaving it
    alone would silently drop that wrapper (P/D's prompt rows on 0.31+ were)."""
    if isinstance(owner, (type, MutableMapping, types.ModuleType)):
        return False
    return name not in getattr(owner, "__dict__", {})


def is_wrapped(value: Any) -> bool:
    """Whether ``value`` is a replacement ``wrap`` installed."""
    return value is not None and hasattr(_function(value), ORIGINAL)


def original_of(value: Any) -> Any:
    """What the replacement ``value`` replaced (``value`` itself if it is not one)."""
    return getattr(_function(value), ORIGINAL) if is_wrapped(value) else value


def _function(value: Any) -> Any:
    """The function behind a static or class method (or bound method): where the marker lives."""
    return getattr(value, "__func__", value)
