# SPDX-License-Identifier: Apache-2.0
"""Run a patch when a module is first imported, or at once if it already is.

vllm-ascend's worker modules must not be imported by ``register()``: it runs in every vLLM process, and
importing ``vllm_ascend.worker.model_runner_v1`` applies vllm-ascend's worker patches in processes that
never run a model. The worker imports them itself; the patch follows right after.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``module_name`` has executed (now, if it already has)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _callbacks.setdefault(module_name, []).append(callback)
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader the other finders return for a watched module."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, fullname: str) -> None:
        self._inner = inner
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for callback in _callbacks.pop(self._fullname, []):
            callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package… for tracebacks and inspect
        return getattr(self._inner, name)
