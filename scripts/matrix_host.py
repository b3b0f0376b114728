# SPDX-License-Identifier: Apache-2.0
"""Facts about where ``make matrix`` runs, recorded with its rows: this checkout's commit and whether it has
local changes, the plugin's version, the machine (cores, CPU, AVX-512, memory, system), and paths as shown."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from matrix_rows import JSON_PATH, MARKDOWN_PATH, ROOT


def home(path: Path | str) -> str:
    """``path`` with the home directory written ``~`` (the rows are committed)."""
    text, user_home = str(path), str(Path.home())
    return "~" + text[len(user_home) :] if text.startswith(user_home + os.sep) else text


def git_commit() -> tuple[str, bool]:
    """This checkout's commit and whether tracked files other than the matrix's outputs differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    outputs = [str(path.relative_to(ROOT)) for path in (JSON_PATH, MARKDOWN_PATH)]
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{path}" for path in outputs))
    return git("rev-parse", "HEAD") or "unknown", bool(changed)


def plugin_version() -> str:
    """The package's ``__version__`` (pyproject.toml takes it from there: its version is dynamic)."""
    source = (ROOT / "vllm_ascend_routing" / "__init__.py").read_text()
    found = re.search(r'^__version__\s*=\s*"([^"]+)"', source, re.MULTILINE)
    return found.group(1) if found else "unknown"


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kib = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.MULTILINE)
    return {
        "cores": os.cpu_count(),
        "cpu": model.group(1).strip() if model else platform.processor() or "unknown",
        "avx512": bool(flags and "avx512f" in flags.group(1).split()),
        "memory_gib": round(int(mem_kib.group(1)) / 2**20, 1) if mem_kib else None,
        "system": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
    }
