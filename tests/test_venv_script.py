# SPDX-License-Identifier: Apache-2.0
"""scripts/venv.py on a machine without the Python a trainer environment needs: a message saying how to get one,
not a traceback (pyenv itself absent as well)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import scripts


def test_a_missing_python_and_no_pyenv_is_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = scripts.load("scripts/venv.py", "_venv_for_interpreter")
    monkeypatch.setenv("PATH", str(tmp_path))  # no python3.99, no pyenv
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    with pytest.raises(SystemExit) as raised:
        venv.interpreter("3.99")
    message = str(raised.value.code)
    assert "no Python 3.99 found" in message and "pyenv install 3.99" in message
    assert str(tmp_path / "pyenv") in message


def test_a_pyenv_build_is_found_without_pyenv_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = scripts.load("scripts/venv.py", "_venv_for_interpreter")
    build = tmp_path / "pyenv" / "versions" / "3.99.1" / "bin" / "python3.99"
    build.parent.mkdir(parents=True)
    build.write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    assert venv.interpreter("3.99") == str(build)


def test_the_command_line_prints_the_message_not_a_traceback(tmp_path: Path) -> None:
    """The whole script, asked for the Python 3.12 trainer environment on a PATH without python3.12 or pyenv."""
    code = (
        "import sys; sys.argv = ['venv.py']; "
        f"sys.path.insert(0, {str(scripts.ROOT / 'scripts')!r}); import venv as v; v.interpreter('3.99')"
    )
    env = {"PATH": str(tmp_path), "PYENV_ROOT": str(tmp_path / "none"), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "pyenv install 3.99" in done.stderr
