# SPDX-License-Identifier: Apache-2.0
"""Build logic only; metadata lives in pyproject.toml.

The built package (wheel, or sdist made from a git checkout) carries ``vllm_ascend_routing/_build_info.json``: the
checkout's commit (``versions.commit`` reads it; ``+dirty`` with uncommitted changes). It is written into the build
directory only, never into the checkout.

A native kernel is built only when ``VLLM_ASCEND_ROUTING_TARGET_DEVICE`` names one (``cpu``, ``cuda`` or ``npu``;
read through ``vllm_ascend_routing/envs.py``, loaded by path). Then CMake builds the ``_C`` module against
the installed torch (install with ``--no-build-isolation``); a missing toolchain fails the build with the
fix in the message. Unset (the default), the package is pure Python and the PyTorch reference serves.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent


def _envs():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("_envs", ROOT / "vllm_ascend_routing" / "envs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_home() -> str:
    """CUDA_HOME, else the toolkit that holds the nvcc on PATH (torch's CMake config needs the root)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    for candidate in ("/usr/local/cuda", str(Path(shutil.which("nvcc") or "/").resolve().parent.parent)):
        if (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return candidate
    raise SystemExit("VLLM_ASCEND_ROUTING_TARGET_DEVICE=cuda: set CUDA_HOME to the CUDA toolkit")


BUILD_INFO = Path("vllm_ascend_routing") / "_build_info.json"


def _commit() -> str | None:
    """The checkout's HEAD (``+dirty`` with uncommitted changes to tracked files); ``None`` outside a git checkout
    (a build from an unpacked sdist keeps the sdist's file instead)."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        return None
    head = subprocess.run([git, "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(
        [git, "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _write_build_info(base: Path) -> None:
    found = _commit()
    if found is None and (ROOT / BUILD_INFO).is_file():  # an unpacked sdist: its commit stands
        found = json.loads((ROOT / BUILD_INFO).read_text())["commit"]
    if found is not None:
        (base / BUILD_INFO).parent.mkdir(parents=True, exist_ok=True)
        (base / BUILD_INFO).write_text(json.dumps({"commit": found}) + "\n")


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.dry_run:
            _write_build_info(Path(self.build_lib))


class Sdist(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        _write_build_info(Path(base_dir))


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _cmake() -> str:
    """The cmake installed next to this Python (pip's ``cmake``) if any, else the one on PATH."""
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.exists() else shutil.which("cmake")
    if found is None:
        raise SystemExit("VLLM_ASCEND_ROUTING_TARGET_DEVICE is set but cmake is not installed (pip install cmake)")
    return found


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = _envs().VLLM_ASCEND_ROUTING_TARGET_DEVICE
        cmake = _cmake()
        if target == "cuda" and shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
            raise SystemExit("VLLM_ASCEND_ROUTING_TARGET_DEVICE=cuda needs nvcc (set CUDACXX or add it to PATH)")
        if target == "cuda" and not os.environ.get("CUDACXX"):
            os.environ["CUDACXX"] = str(Path(_cuda_home()) / "bin" / "nvcc")
        output_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One CMake build tree per target and interpreter: a cache configured for another torch is never reused.
        key = hashlib.sha256(sys.executable.encode()).hexdigest()[:8]
        build_dir = Path(self.build_temp).resolve() / f"{target}-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            cmake,
            str(ROOT),
            f"-DVLLM_ASCEND_ROUTING_TARGET_DEVICE={target}",
            f"-DVLLM_ASCEND_ROUTING_OUTPUT_DIR={output_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if target == "cuda":
            # Without a GPU to detect, build for the data-centre GPUs RL rollouts run on unless told otherwise
            # (torch's own TORCH_CUDA_ARCH_LIST, e.g. "8.0 9.0 10.0").
            arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0 9.0")
            archs = ";".join(a.replace(".", "").replace("+PTX", "") for a in arch_list.replace(";", " ").split())
            configure += [f"-DCUDA_TOOLKIT_ROOT_DIR={_cuda_home()}", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
        if os.environ.get("SOC_VERSION"):
            configure.append(f"-DSOC_VERSION={os.environ['SOC_VERSION']}")
        subprocess.run(configure, cwd=build_dir, check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run([cmake, "--build", ".", "-j", jobs], cwd=build_dir, check=True)


target = _envs().VLLM_ASCEND_ROUTING_TARGET_DEVICE
ext_modules = [CMakeExtension("vllm_ascend_routing._C")] if target in ("cpu", "cuda", "npu") else []
setup(ext_modules=ext_modules, cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy, "sdist": Sdist})
