#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""make gpu-e2e: the plugin inside real vLLM 0.26.0 CUDA engines on one NVIDIA GPU, in one run
(docs/development.md, "The GPU end-to-end run").

    make gpu-e2e PYTHON=python3 [GPU_E2E_ONLY=eager_f32,bench] [GPU_E2E_DEADLINE=420]

For the GPU machine (an H100 or H200: sm_90; Python 3.12 with torch 2.11.0+cu130, nvcc, pytest; no network), from the
checkout's root, with the payload ``make gpu-e2e-prep`` built here carried along (``.gpu-e2e``). In order:

1. ``gpu``: a CUDA GPU visible to torch, sm_90, Python 3.12, torch 2.11 (what the payload was built for); without a GPU
   this is where the run FAILS, naming the missing GPU (never a skip, never a pass);
2. ``payload``: the manifest and every file of it, by size and SHA-256;
3. ``install``: vLLM and its wheels unpacked into ``/tmp/gpu-e2e/site`` (kept while the machine stays up), the
   plugin's entry point registered for the checkout's package;
4. ``smoke``: vLLM's own CUDA kernels load and match torch (``smoke.py``);
5. ``models``: the tiny MoE models built on the device (transformers, fixed seeds);
6. the jobs, at once (``jobs.py``): the engine checks (``cases.py``, plan in ``engine_checks.py``) on the Triton
   kernel; the CUDA kernel built as ``make gpu-check`` builds it, in a copy of the checkout (``kernel_build``), then
   the CUDA tests on it (``cuda_tests``: kernel, CUDA-graph placement, the sentinel's device path and stream order)
   and the engine check that runs on the native kernel; the benchmark times its engines once the others are done.

A deadline (``--deadline``, default 420 s from the start) stops what has not finished and still writes what did.
Into ``--out`` (default ``$OUT`` on the device machine, else ``build/gpu-e2e``), four files, what one device run
returns: ``summary.json`` (every step and case, the versions, the card, the commit), ``results.md`` (the table),
``run.log`` (this script's output) and ``engines.log`` (every job's log). Exit status 0 only if everything passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
import engine_checks  # noqa: E402
from jobs import Job, run_jobs  # noqa: E402

WORK = Path("/tmp/gpu-e2e")  # on the GPU machine: kept while it stays up between runs
# vLLM's compile cache, new for every run: every engine compiles and captures its graphs with this checkout's code
# (a graph loaded from an earlier run's cache is not what this run tests; on the CPU build vLLM 0.26.0 even crashes
# on one, its MoE op looking up a layer by an id() baked in by another process). Triton's kernel cache is kept.
RUN_ID = time.strftime("%Y%m%d-%H%M%S")
DEADLINE_S = 420.0
PARALLEL = 6  # engine jobs at a time (the benchmark's job runs three engines)
LOG_TAIL_BYTES = 2 * 2**20  # per job in engines.log: a file that comes back is at most 16 MiB
WANTED = {"arch": (9, 0), "python": (3, 12), "torch": "2.11"}
KERNEL_JOB = "cuda_tests"  # --only's name for the kernel build and the CUDA tests
CUDA_TESTS = ("tests/test_parallel.py", "tests/test_sentinel_streams.py", "tests/test_sentinel.py", "tests/ops")


class StepError(Exception):
    """A step could not run or did not pass: the run stops there, and the message says why."""


class Run:
    """The run's output: printed and kept for ``run.log``; every step's outcome for ``summary.json``."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.steps: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def step(self, name: str, action: Callable[[], str]) -> str:
        began = time.monotonic()
        self.say(f"== {name}")
        try:
            detail = action()
        except StepError as error:
            self.steps.append({"step": name, "status": "failed", "detail": str(error)})
            raise
        seconds = time.monotonic() - began
        self.steps.append({"step": name, "status": "passed", "seconds": round(seconds, 1), "detail": detail})
        self.say(f"   ok ({seconds:.0f} s): {detail}")
        return detail


def gpu() -> str:
    """The GPU every later step needs; anything else is a failure that names what is missing."""
    try:
        import torch
    except ImportError as error:
        raise StepError(
            f"no NVIDIA GPU usable: torch is not importable by {sys.executable} ({error}); make gpu-e2e runs vLLM "
            "engines on one NVIDIA GPU (H100/H200, sm_90) with a CUDA build of torch 2.11; nothing ran"
        ) from None
    if torch.version.cuda is None or not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
        raise StepError(
            f"no NVIDIA GPU visible to torch {torch.__version__} ({build}): make gpu-e2e runs vLLM engines on one "
            "NVIDIA GPU (H100/H200, sm_90); nothing ran (make gpu-e2e-prep builds its payload on any machine)"
        )
    name, capability = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
    if capability != WANTED["arch"]:
        raise StepError(f"{name} is sm_{capability[0]}{capability[1]}: the payload's vLLM kernels are cut to sm_90")
    if sys.version_info[:2] != WANTED["python"] or not torch.__version__.startswith(str(WANTED["torch"])):
        raise StepError(
            f"Python {sys.version.split()[0]} with torch {torch.__version__}: the payload is vLLM 0.26.0 for Python "
            "3.12 and torch 2.11 (the GPU machine's own); run it with that interpreter (make gpu-e2e PYTHON=...)"
        )
    return f"{name} (sm_90), torch {torch.__version__}, Python {sys.version.split()[0]}"


def check_payload(payload: Path) -> dict[str, Any]:
    """The manifest ``prep.py`` wrote, every file it lists present with its size and SHA-256."""
    manifest_path = payload / "manifest.json"
    if not manifest_path.is_file():
        raise StepError(f"no payload at {payload} (no manifest.json): run make gpu-e2e-prep, carry {payload.name}")
    manifest = dict(json.loads(manifest_path.read_text()))
    for name, info in manifest["files"].items():
        path = payload / name
        if not path.is_file() or path.stat().st_size != info["bytes"]:
            raise StepError(f"payload file {name} missing or not {info['bytes']} bytes: rebuild (make gpu-e2e-prep)")
        if hashlib.sha256(path.read_bytes()).hexdigest() != info["sha256"]:
            raise StepError(f"payload file {name} does not match its SHA-256: rebuild (make gpu-e2e-prep)")
    return manifest


def describe_payload(payload: Path, manifest: dict[str, Any]) -> str:
    manifest.update(check_payload(payload))
    return f"{payload.name}: vLLM {manifest['vllm']} for {manifest['arch']}, recipe {manifest['recipe']}"


def package_version() -> str:
    text = (ROOT / "vllm_ascend_routing" / "__init__.py").read_text()
    found = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    return found.group(1) if found else "0.0"


def install(payload: Path, manifest: dict[str, Any], site: Path) -> str:
    """vLLM and its wheels into ``site`` (reused when the same payload is already there), the plugin registered."""
    stamp = site / ".payload-recipe"
    if stamp.is_file() and stamp.read_text() == manifest["recipe"]:
        how = f"reused {site} (recipe {manifest['recipe']})"
    else:
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        with zipfile.ZipFile(payload / f"vllm-{manifest['vllm']}-sm90.zip") as archive:
            archive.extractall(site)
        wheels = sorted(str(path) for path in (payload / "deps").glob("*.whl"))
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--no-cache-dir", "--upgrade", "--target", str(site), *wheels]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise StepError(f"pip install of the payload's wheels failed:\n{(done.stdout + done.stderr)[-3000:]}")
        stamp.write_text(manifest["recipe"])
        how = f"vLLM {manifest['vllm']} and {len(wheels)} wheels into {site}"
    # The plugin's entry point (vllm.general_plugins), for whichever checkout copy is on PYTHONPATH.
    info = site / f"vllm_ascend_routing-{package_version()}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-ascend-routing\nVersion: {package_version()}\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nvllm_ascend_routing = vllm_ascend_routing:register\n"
    )
    return how


def engine_env(site: Path, package_root: Path) -> dict[str, str]:
    """What every engine process needs: the payload and the checkout (copy) on PYTHONPATH, offline, no FlashInfer
    sampler (not carried), the plugin on, functions allowed through collective_rpc (the checks' counters)."""
    return {
        "PYTHONPATH": f"{site}{os.pathsep}{package_root}",
        "VLLM_ASCEND_ROUTING": "1",
        "VLLM_ASCEND_ROUTING_MODELS": str(WORK / "models"),
        "VLLM_CACHE_ROOT": str(WORK / "vllm-cache" / RUN_ID),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def smoke(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, str(HERE / "smoke.py")], env={**os.environ, **env}, capture_output=True, text=True, timeout=180
    )
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise StepError(f"vLLM's CUDA kernels do not load or do not match torch:\n{output[-3000:]}")
    return output.splitlines()[-1]


def native_tree(target: Path) -> Path:
    """A copy of the checkout the CUDA kernel is built into: engines already running import the checkout itself,
    which must not change under them."""
    shutil.rmtree(target, ignore_errors=True)
    ignore = shutil.ignore_patterns(".git", ".gpu-e2e", "build", "__pycache__", "*.so", "dist", "*.egg-info")
    shutil.copytree(ROOT, target, ignore=ignore)
    return target


def kernel_build_command(tree: Path) -> list[str]:
    """The CUDA kernel built in ``tree`` as ``make gpu-check`` builds it, up to its registration (also what
    ``rehearse.py`` runs against the image's torch)."""
    return [sys.executable, str(tree / "scripts" / "gpu_check.py"), "--build-only", "--keep-build"]


def device_jobs(names: list[str], site: Path, log_dir: Path, kernel: bool = True) -> list[Job]:
    """The kernel build and the CUDA tests on it (``kernel``), then the engine checks (Triton's kernel, or the
    build's)."""
    tree = native_tree(WORK / "native")
    plain = {"PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    build = Job(
        "kernel_build",
        kernel_build_command(tree),
        plain,
        timeout_s=300,
        engine=False,
        cwd=str(tree),
    )
    tests_code = (
        "import json, sys; sys.path.insert(0, 'scripts'); import gpu_check; "
        f"verdict = gpu_check.pytest_step('cuda and not triton', {CUDA_TESTS!r}, 'cuda'); "
        "print('GPU_E2E_RESULT ' + json.dumps({'tests': verdict}))"
    )
    tests = Job(
        "cuda_tests",
        [sys.executable, "-c", tests_code],
        plain,
        timeout_s=240,
        after=("kernel_build",),
        needs_ok=True,
        engine=False,
        cwd=str(tree),
    )
    native = (tree, engine_env(site, tree))
    engines = engine_checks.plan(names, False, log_dir, engine_env(site, ROOT), native, "kernel_build")
    jobs = [build, tests, *engines] if kernel else engines
    engine_checks.announce_quiet(log_dir, jobs)
    return jobs


def chosen(only: str) -> tuple[list[str], bool]:
    """``--only``'s engine checks, and whether the kernel build and CUDA tests run: always without ``--only``; with
    it, where it names ``cuda_tests`` or a case on the native kernel."""
    wanted = [name for name in only.split(",") if name]
    names = (
        engine_checks.selected(False, [n for n in wanted if n != KERNEL_JOB] or None) if wanted != [KERNEL_JOB] else []
    )
    native = any(name in cases.CASES and cases.CASES[name].native for name in names)
    return names, not wanted or KERNEL_JOB in wanted or native


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return "unknown (no git here)"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    return done.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def write_outputs(out: Path, run: Run, summary: dict[str, Any], log_dir: Path | None) -> None:
    """Four files: what a device run returns (at most 8 files, 16 MiB each)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "results.md").write_text("\n".join(summary.get("table", [])) + "\n")
    (out / "run.log").write_text("\n".join(run.lines) + "\n")
    if log_dir is not None and log_dir.is_dir():
        with (out / "engines.log").open("w") as merged:
            for path in sorted(log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime):
                data = path.read_bytes()
                cut = f" (first {len(data) - LOG_TAIL_BYTES} bytes cut)" if len(data) > LOG_TAIL_BYTES else ""
                merged.write(f"\n===== {path.name}{cut} =====\n")
                merged.write(data[-LOG_TAIL_BYTES:].decode(errors="replace"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--payload", type=Path, default=ROOT / ".gpu-e2e")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "build" / "gpu-e2e"))
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated, of {', '.join((KERNEL_JOB, *cases.KNOWN_CASES))} "
        f"(default: all but {', '.join(cases.ON_REQUEST)})",
    )
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds from the start for everything")
    parser.add_argument("--parallel", type=int, default=PARALLEL, help="engine jobs at a time")
    args = parser.parse_args(argv)
    payload = args.payload if args.payload.is_absolute() else ROOT / args.payload
    run = Run()
    run.say(f"gpu-e2e: {sys.executable} in {ROOT}, commit {commit()}")
    summary: dict[str, Any] = {"commit": commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": run.steps}
    log_dir = None
    failed = None
    try:
        summary["device"] = run.step("gpu", gpu)
        manifest: dict[str, Any] = {}
        run.step("payload", lambda: describe_payload(payload, manifest))
        summary["payload"] = {key: manifest[key] for key in ("recipe", "vllm", "arch", "built")}
        site = WORK / "site"
        run.step("install", lambda: install(payload, manifest, site))
        env = engine_env(site, ROOT)
        run.step("smoke", lambda: smoke(env))
        names, kernel = chosen(args.only)
        run.step("models", lambda: engine_checks.build_models(names, sys.executable, {**os.environ, **env}))
        log_dir = WORK / "logs"
        shutil.rmtree(log_dir, ignore_errors=True)
        listed = [*(["kernel_build", KERNEL_JOB] if kernel else []), *names]
        run.say(f"== jobs: {', '.join(listed)} (at most {args.parallel} engine jobs at once)")
        jobs = device_jobs(names, site, log_dir, kernel)
        outcomes = run_jobs(jobs, log_dir, run.started + args.deadline, args.parallel, run.say)
        outcomes.pop("quiet", None)
        summary["jobs"] = {name: outcome.as_dict() for name, outcome in outcomes.items()}
        summary["table"] = engine_checks.table({n: o for n, o in outcomes.items() if n in cases.KNOWN_CASES})
        not_passed = [f"{n} {o.status}" for n, o in outcomes.items() if o.status != "passed"]
        failed = f"jobs not passed: {', '.join(not_passed)}" if not_passed else None
    except StepError as error:
        failed = str(error)
    elapsed = time.monotonic() - run.started
    summary["seconds"] = round(elapsed)
    summary["verdict"] = "FAILED: " + failed if failed else "PASSED"
    for line in summary.get("table", []):
        run.say(line)
    run.say(f"gpu-e2e: {summary['verdict']} ({elapsed:.0f} s); output in {args.out}")
    write_outputs(args.out, run, summary, log_dir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
