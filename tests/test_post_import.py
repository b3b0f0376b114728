# SPDX-License-Identifier: Apache-2.0
"""Patches that wait for a module's first import (vllm-ascend's worker modules)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from vllm_ascend_routing._post_import import when_imported


def test_callback_runs_after_the_module_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "late_module_for_hook.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    when_imported("late_module_for_hook", lambda module: seen.append(module.VALUE))
    assert seen == []  # not imported yet: nothing runs
    import late_module_for_hook  # noqa: F401

    assert seen == [1]  # ran once, with the executed module
    del sys.modules["late_module_for_hook"]


def test_callback_runs_at_once_for_an_imported_module() -> None:
    seen: list[ModuleType] = []
    when_imported("json", seen.append)
    assert seen == [sys.modules["json"]]
