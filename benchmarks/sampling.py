# SPDX-License-Identifier: Apache-2.0
"""Where an engine's time goes: py-spy samples of a running engine, and the share spent in plugin code.

The wall-clock ratio of ``overhead.py`` is limited by the machine's noise (how far single rounds swing:
docs/performance.md); sampling the plugin engine during a timed batch measures the plugin's own cost directly.

A sample counts as the plugin's when its innermost ``vllm_ascend_routing`` frame does its own work: the
frames below it (if any) are libraries it calls (NumPy, torch ops), not vLLM. The mixin's ``execute_model``
and the backends' ``select_experts`` wrappers delegate to vLLM, so time under them is vLLM's, not ours.

Two denominators: every sample of the engine's processes (on 0.20.x most of the engine process's samples
are it spinning while the worker computes), and the model-step samples: those under the runner mixin's
``execute_model`` / ``sample_tokens`` (every step passes through them), which is the work that throughput
measures and the fairer base for the capture's per-step cost.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN_PACKAGE = "vllm_ascend_routing"
VLLM_PACKAGE = "vllm"


def _frame_package(frame: str) -> str | None:
    """Top-level package (plugin, vLLM or other) of a py-spy raw frame ``function (path/file.py:line)``.

    py-spy shortens a path relative to its sys.path entry (``vllm/v1/...``) or leaves it absolute
    (``.../site-packages/torch/...``, or an editable install's checkout); the venvs themselves live under a
    ``vllm_ascend_routing`` cache folder, so only the component where the import path starts counts.
    """
    if not frame.endswith(")") or " (" not in frame:
        return None
    path = frame.rsplit(" (", 1)[1][:-1].rsplit(":", 1)[0]
    parts = Path(path).parts[:-1]
    if not parts:
        return None
    installed = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
    if installed:
        top = parts[installed[-1] + 1] if installed[-1] + 1 < len(parts) else None
    elif not Path(path).is_absolute():
        top = parts[0]
    else:  # an editable checkout: the innermost folder named like one of the packages
        top = next((part for part in reversed(parts) if part in (PLUGIN_PACKAGE, VLLM_PACKAGE)), None)
    return top if top in (PLUGIN_PACKAGE, VLLM_PACKAGE) else "other"


STEP_HOOKS = ("RoutingCaptureRunnerMixin.execute_model", "RoutingCaptureRunnerMixin.sample_tokens")


def _is_step_hook(frame: str) -> bool:
    """The runner mixin's per-step entry points, which every model step of the plugin engine passes."""
    return frame.split(" (", 1)[0] in STEP_HOOKS and _frame_package(frame) == PLUGIN_PACKAGE


def _without_line(frame: str) -> str:
    """``f (a/b.py:12)`` -> ``f (a/b.py)``: one entry per function, not per sampled line."""
    head, _, line = frame[:-1].rpartition(":")
    return f"{head})" if line.isdigit() else frame


@dataclass
class PluginShare:
    """Samples of one profiled batch, and those spent in plugin code (by innermost plugin function)."""

    samples: int = 0
    plugin_samples: int = 0
    step_samples: int = 0
    plugin_step_samples: int = 0
    by_function: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def share(self) -> float:
        return self.plugin_samples / self.samples if self.samples else 0.0

    @property
    def step_share(self) -> float:
        return self.plugin_step_samples / self.step_samples if self.step_samples else 0.0

    def top(self, count: int = 5) -> list[tuple[str, float]]:
        return [(name, n / self.samples) for name, n in self.by_function.most_common(count)]


def plugin_share(raw_lines: Iterable[str]) -> PluginShare:
    """Attribute py-spy ``--format raw`` lines (``frame;frame;... count``, outermost first) to the plugin."""
    result = PluginShare()
    for line in raw_lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        packages = [_frame_package(frame) for frame in frames]
        result.samples += count
        in_step = any(_is_step_hook(frame) for frame in frames)
        result.step_samples += count if in_step else 0
        innermost = max((i for i, p in enumerate(packages) if p == PLUGIN_PACKAGE), default=None)
        if innermost is None or VLLM_PACKAGE in packages[innermost + 1 :]:
            continue
        result.plugin_samples += count
        result.plugin_step_samples += count if in_step else 0
        result.by_function[_without_line(frames[innermost])] += count
    return result


def py_spy() -> str:
    """The py-spy executable: next to this interpreter (installed in the venv) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit(
            f"--profile needs py-spy: {sys.executable} -m pip install py-spy "
            "(or `make bench PROFILE=1`, which installs it)"
        )
    return found


@contextmanager
def sampled(pid: int, out: Path, rate: int = 100) -> Iterator[None]:
    """Sample process ``pid`` and its children into ``out`` (py-spy raw format) while the block runs."""
    recorder = subprocess.Popen(
        [
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--nonblocking",
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2.0)  # py-spy attaches to every process of the tree before the batch starts
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)
        _, errors = recorder.communicate(timeout=120)
    if not out.exists() or os.path.getsize(out) == 0:
        raise SystemExit(f"py-spy recorded nothing (exit {recorder.returncode}): {errors.strip()[-2000:]}")
