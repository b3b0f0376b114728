# SPDX-License-Identifier: Apache-2.0
"""The Ascend runner cases' driver (no vLLM needed): each case runs in a child of its own, so no case sees what
another imported (the runner module's first import is what the plugin's post-import patch must see)."""

from __future__ import annotations

import sys

import pytest

from tests.ascend import npu_runner_cases

MODULE = "colorsys"  # a module nothing here imports: dropped before the cases run, imported by each


def imports_a_module_first() -> None:
    if MODULE in sys.modules:
        sys.exit(3)  # another case's import leaked into this one
    __import__(MODULE)


def test_each_case_is_a_child_that_sees_none_of_the_others_imports() -> None:
    sys.modules.pop(MODULE, None)
    assert npu_runner_cases.run_forked(imports_a_module_first) == 0
    assert npu_runner_cases.run_forked(imports_a_module_first) == 0
    assert MODULE not in sys.modules


def test_a_failing_case_gives_its_status_and_the_next_one_runs(capfd: pytest.CaptureFixture[str]) -> None:
    def raises() -> None:
        raise RuntimeError("case broke")

    def exits() -> None:
        sys.exit(4)

    assert npu_runner_cases.run_forked(raises) == 1
    assert "RuntimeError: case broke" in capfd.readouterr().err
    assert npu_runner_cases.run_forked(exits) == 4
    assert npu_runner_cases.run_forked(lambda: None) == 0
