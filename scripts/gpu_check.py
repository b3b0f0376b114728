#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""make gpu-check: everything this plugin runs on an NVIDIA GPU, proven on one, in one command.

    make gpu-check PYTHON=python        # or: python scripts/gpu_check.py [--skip-build]

For a machine with one NVIDIA GPU, PyTorch (a CUDA build), nvcc and pytest; no vLLM, no network, no venv
(the plain interpreter that runs it). From the checkout's root:

1. checks the toolchain (a CUDA build of torch, nvcc, numpy, pytest), that a GPU is visible, and runs the Triton
   kernel's CUDA tests (``tests/ops/test_triton_kernel.py``: what serves CUDA without a native build);
2. builds the CUDA kernel into the checkout (``vllm_ascend_routing/_C*.so``) for this GPU's architecture only:
   through setup.py and CMake, as ``make build-cuda`` does, where CMake 3.27+ is at hand, else with one nvcc
   command, and checks the build registers its kernels for CUDA and the CPU (``scripts/check_native.py``'s check),
   then runs the C++ CPU kernel's tests on this build (``tests/ops/test_cpu_kernel.py``, ``-m native_cpu``);
   ``--build-only`` runs the toolchain and these steps alone (no GPU needed: make test-native);
3. runs every CUDA test of the native kernel (``pytest -m cuda``, ``VLLM_ASCEND_ROUTING_TEST_REQUIRE=cuda``: a
   missing GPU is a failure, never a skip): the kernel against the oracle of ``tests/ops/vectors.py`` for every
   shape and id dtype, a CUDA graph of several layers' ``LayerCapture`` calls replayed into one buffer, the always-on
   check's device path (pinned packet, the device's event, no synchronisation under
   ``torch.cuda.set_sync_debug_mode("error")``) with planted zero rows and invalid ids caught on their step,
   and the event-before-copy mutation shown to miss them; DP placement captured once in a CUDA graph and replayed
   with other token splits, a capture with unequal DP counts refused (``tests/test_parallel.py``); the step's
   clear against vLLM's async host copy held back on another stream (``tests/test_sentinel_streams.py``); the
   capture's state (the counter, the check's device index) through a level-2 sleep (``tests/test_sleep_mode.py``);
4. prints the kernel's device time per MoE layer inside a CUDA graph beside a same-place copy of the same ids
   (``benchmarks/kernel_graph.py``), and host-timed calls beside a device-to-device copy of the same bytes.

Exit status 0 only if every step passed; any step that cannot run (no GPU, a CPU-only torch, no nvcc, a test
skipped) is a failure with its reason. The build is removed again unless ``--keep-build``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_ascend_routing"
BUDGET_S = 8 * 60  # the whole check, build included
TESTS = (
    "tests/ops",
    "tests/test_sentinel.py",
    "tests/test_sentinel_streams.py",
    "tests/test_parallel.py",
    "tests/test_sleep_mode.py",
)
TRITON_TESTS = ("tests/ops/test_triton_kernel.py",)
CPU_KERNEL_TESTS = ("tests/ops/test_cpu_kernel.py",)


class GpuCheckError(Exception):
    """A step could not run or did not pass: the message says which and why."""


def toolchain() -> str:
    """What the build needs: torch (a CUDA build), numpy and pytest importable, nvcc."""
    missing = [name for name in ("torch", "numpy", "pytest") if importlib.util.find_spec(name) is None]
    if missing:
        raise GpuCheckError(f"{', '.join(missing)} not importable by {sys.executable}")
    import torch

    if torch.version.cuda is None:
        raise GpuCheckError(f"torch {torch.__version__} is a CPU-only build: gpu-check needs a CUDA build of torch")
    if shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
        raise GpuCheckError("nvcc not on PATH (nor CUDACXX): the CUDA kernel cannot be built")
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}), {nvcc_version()}"


def gpu() -> str:
    """The GPU the rest runs on."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise GpuCheckError(
            f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda}): the Triton and native "
            "kernels' tests, the CUDA graphs, the always-on check's device path and the timings need one NVIDIA GPU "
            "and did not run (--build-only proves the build without one)"
        )
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (sm_{major}{minor}), {torch.cuda.device_count()} visible"


def nvcc_version() -> str:
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc") or "nvcc"
    done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    release = [line for line in done.stdout.splitlines() if "release" in line]
    return f"nvcc {release[-1].split('release')[-1].strip()}" if release else "nvcc (version unknown)"


def arch() -> str:
    """This GPU's architecture ("9.0"), the one the build targets (one architecture: a shorter build); without
    a GPU, 9.0 (--build-only: the build is proven without one)."""
    import torch

    if not torch.cuda.is_available():
        return "9.0"
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


def built_modules() -> list[Path]:
    return sorted(PACKAGE.glob("_C*.so"))


def build(target_arch: str) -> str:
    """The kernel, built in place: setup.py (CMake) where cmake exists, else one nvcc command."""
    for stale in built_modules():
        stale.unlink()
    env = {**os.environ, "VLLM_ASCEND_ROUTING_TARGET_DEVICE": "cuda", "TORCH_CUDA_ARCH_LIST": target_arch}
    cmake = usable_cmake()
    if cmake is not None:
        with tempfile.TemporaryDirectory(prefix="gpu_check_build_") as temp:
            command = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
            command += ["--build-temp", f"{temp}/temp", "--build-lib", f"{temp}/lib"]
            run_logged(command, env, "setup.py build_ext (CMake)")
        how = f"setup.py + {cmake}"
    else:
        run_logged(nvcc_command(target_arch), env, "nvcc")
        how = "one nvcc command (no CMake 3.27+ here)"
    modules = built_modules()
    if not modules:
        raise GpuCheckError("the build finished but wrote no vllm_ascend_routing/_C*.so")
    return f"{modules[0].relative_to(ROOT)} via {how}, for sm_{target_arch.replace('.', '')}"


def usable_cmake() -> str | None:
    """The CMake setup.py would use (next to this Python, else on PATH) if it knows nvcc's C++20 flag (3.27+)."""
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.exists() else shutil.which("cmake")
    if found is None:
        return None
    done = subprocess.run([found, "--version"], capture_output=True, text=True, check=False)
    words = done.stdout.split()
    version = words[2] if len(words) > 2 and words[:2] == ["cmake", "version"] else "0"
    numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return f"cmake {version}" if numbers >= (3, 27) else None


def nvcc_command(target_arch: str) -> list[str]:
    """CMakeLists.txt's CUDA build as one nvcc call: module.cpp, the CPU and CUDA kernels, linked against torch."""
    import torch
    from torch.utils import cpp_extension

    code = target_arch.replace(".", "")
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [*cpp_extension.include_paths(device_type="cuda"), sysconfig.get_paths()["include"]]
    # As CMakeLists.txt: headers a minimal toolkit lacks (cuSPARSE, cuBLAS) from the torch wheel's nvidia packages.
    includes += sorted(str(path) for path in (Path(torch.__file__).parent.parent / "nvidia").glob("*/include"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return [
        os.environ.get("CUDACXX") or shutil.which("nvcc") or "nvcc",
        "-shared",
        "-O3",
        "-std=c++20",
        "-Xcompiler",
        "-fPIC",
        # As CMakeLists.txt: OpenMP compiled in, so the CPU kernel splits large batches over torch's threads (here the
        # host compiler also links libgomp.so.1; torch loaded one of that name already, and the loader reuses it).
        "-Xcompiler",
        "-fopenmp",
        f"-gencode=arch=compute_{code},code=sm_{code}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        '-DVLLM_ASCEND_ROUTING_BACKEND="cuda"',
        f"-I{ROOT / 'csrc'}",
        f"-I{ROOT / 'csrc' / 'cpu'}",
        f"-I{ROOT / 'csrc' / 'cuda'}",
        *(arg for path in includes for arg in ("-isystem", path)),
        str(ROOT / "csrc" / "module.cpp"),
        str(ROOT / "csrc" / "cpu" / "record_topk_ids_rows.cpp"),
        str(ROOT / "csrc" / "cpu" / "record_topk_ids.cpp"),
        str(ROOT / "csrc" / "cpu" / "record_rows_python.cpp"),
        str(ROOT / "csrc" / "cuda" / "record_topk_ids.cu"),
        f"-L{torch_lib}",
        f"-Xlinker=-rpath,{torch_lib}",
        "-lc10",
        "-lc10_cuda",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_cuda",
        "-ltorch_python",
        "-o",
        str(PACKAGE / f"_C{suffix}"),
    ]


def run_logged(command: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        raise GpuCheckError(f"{what} exited {done.returncode}:\n{output}")


def registered() -> str:
    """The checkout's build loads and registers its kernels for CUDA and the CPU (check_native.py, on the checkout)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_native.py"), "cuda"],
        cwd=ROOT,
        env=checkout_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise GpuCheckError(f"the built kernel does not serve the op: {(done.stdout + done.stderr)[-2000:]}")
    return done.stdout.strip()


def checkout_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path, **extra}
    env.pop("VLLM_ASCEND_ROUTING_FORCE_REFERENCE", None)  # the native kernel is what is checked
    return env


def triton_tests() -> str:
    """The Triton kernel's CUDA tests, run while no native kernel is built (it would take the CUDA key)."""
    if built_modules():
        raise GpuCheckError("a native kernel is already built in the checkout: Triton's would not serve CUDA")
    return pytest_step("cuda and triton", TRITON_TESTS, "cuda,triton")


def tests() -> str:
    """Every CUDA test of the native kernel; a skipped or deselected-to-nothing run is a failure, not a pass."""
    return pytest_step("cuda and not triton", TESTS, "cuda")


def cpu_kernel_tests() -> str:
    """The C++ CPU kernel every native build carries (csrc/cpu), as this build compiled it, against the oracle."""
    return pytest_step("native_cpu", CPU_KERNEL_TESTS, "native_cpu", kind="CPU-kernel")


def pytest_step(marker: str, paths: tuple[str, ...], require: str, kind: str = "CUDA") -> str:
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as temp:
        report = Path(temp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, "-rs"]
        command += [f"--junitxml={report}", *paths]
        env = checkout_env(VLLM_ASCEND_ROUTING_TEST_REQUIRE=require)
        done = subprocess.run(command, cwd=ROOT, env=env, check=False)
        counts = junit_counts(report) if report.exists() else {}
    return test_verdict(done.returncode, counts, f"pytest -m '{marker}' {' '.join(paths)}", kind)


def test_verdict(returncode: int, counts: dict[str, int], what: str = "pytest -m cuda", kind: str = "CUDA") -> str:
    """Passed only if pytest passed and ran at least one test and skipped none."""
    if returncode != 0:
        raise GpuCheckError(f"{what} exited {returncode} ({counts or 'no report'})")
    if counts.get("skipped") or not counts.get("tests"):
        raise GpuCheckError(f"{what}: the tests did not all run: {counts}")
    return f"{counts['tests']} {kind} tests passed, none skipped"


def junit_counts(report: Path) -> dict[str, int]:
    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def benchmark_module(name: str):  # type: ignore[no-untyped-def]
    """``benchmarks/NAME.py`` (not a package), loaded from the checkout."""
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bandwidth() -> str:
    """The kernel's cost per MoE layer on this GPU: its device time inside a CUDA graph (as vLLM replays decode
    steps) against a same-place copy of the same ids (benchmarks/kernel_graph.py), then host-timed calls (launch
    and dispatch included, as in eager prefill) against a device-to-device copy of the same bytes."""
    sys.path.insert(0, str(ROOT))  # the checkout's package, with the kernel just built
    from vllm_ascend_routing.ops import kernel_backend

    lines = [f"kernel backend: {kernel_backend()}"]
    if not kernel_backend().startswith("native-cuda"):
        raise GpuCheckError(f"the bandwidth would be the reference's, not the kernel's: backend {kernel_backend()}")
    graph = benchmark_module("kernel_graph")
    for tokens in (64, 4096, 65536):
        lines.append(graph.report(tokens, graph.measure(tokens, 8, 61, 256, 100), 61, 8))
    host_timed = benchmark_module("kernel")
    for tokens in (4096, 65536):
        op_bw, copy_bw, op_s, copy_s = host_timed.measure("cuda", tokens, 8, 61, 200)
        lines.append(
            f"host-timed N={tokens} K=8 L=61: record_topk_ids {op_s * 1e6:.1f} us per call, a device-to-device "
            f"copy of the same bytes {copy_s * 1e6:.1f} us ({op_bw / copy_bw:.2f} of the copy's rate)"
        )
    return "\n    ".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--keep-build", action="store_true", help="leave vllm_ascend_routing/_C*.so in place")
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="stop after the build registers (no GPU needed): make test-native's proof that this build path works",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    print(f"gpu-check: {sys.executable} in {ROOT}", flush=True)
    steps: list[tuple[str, Callable[[], str]]] = [("toolchain", toolchain)]
    if not args.build_only:
        steps += [("gpu", gpu), ("triton", triton_tests)]
    steps += [("build", lambda: build(arch())), ("registered", registered), ("cpu kernel", cpu_kernel_tests)]
    if not args.build_only:
        steps += [("tests", tests), ("bandwidth", bandwidth)]
    failed = None
    try:
        for name, step in steps:
            began = time.monotonic()
            print(f"== {name}", flush=True)
            try:
                detail = step()
            except GpuCheckError as error:
                failed = f"{name}: {error}"
                break
            print(f"   ok ({time.monotonic() - began:.0f} s): {detail}", flush=True)
    finally:
        if not args.keep_build:
            for module in built_modules():
                module.unlink()
    elapsed = time.monotonic() - started
    if failed is None and elapsed > BUDGET_S:
        failed = f"took {elapsed:.0f} s, over the {BUDGET_S} s budget"
    scope = " (build only: no GPU step ran)" if args.build_only else ""
    print(f"gpu-check: {'FAILED: ' + failed if failed else 'PASSED' + scope} ({elapsed:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
