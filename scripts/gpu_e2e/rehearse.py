#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""make gpu-e2e-rehearse: the GPU run's first steps rehearsed here, on a CPU, before a GPU spends its minutes on them.

    make gpu-e2e-rehearse        # builds the payload (make gpu-e2e-prep) and the gpu-image environment first

A lent GPU is rare and its session has 15 minutes of device time: an import the payload lacks, a transformers
release that computes the reference differently, or a Triton release that rejects the kernel would cost that run. In
``scripts/venv.py gpu-image`` (Python 3.12, torch 2.11.0's CUDA 13 build, Triton, transformers and the rest at the
versions the GPU machine's image holds: ``image.txt``), run by that environment's python:

1. ``payload``: the payload ``make gpu-e2e-prep`` built, every file by size and SHA-256 (``device_run.check_payload``);
2. ``install``: unpacked exactly as the GPU run unpacks it (``device_run.install``), into a scratch folder;
3. ``driver-stub``: a stand-in ``libcuda.so.1`` (REHEARSAL ONLY: every function fails) exporting the driver functions
   the payload's libraries link, so that they load on a machine without NVIDIA's driver;
4. ``imports``: every module the GPU run's engine path imports, with the payload and the checkout on PYTHONPATH as
   there; the plugin's entry point found once; no module taken from a distribution the image does not hold;
5. ``surface``: ``doctor --platform cuda --surface`` on the payload's vLLM: every target the plugin patches;
6. ``reference``: the run's tiny models built and the transformers reference computed with the image's transformers,
   every MoE layer's router hooked, the ids and logits equal to those of ``--compare-python``'s transformers; vLLM's
   ``ModelConfig`` of each read through the image's transformers as through the other;
7. ``triton``: the capture's Triton kernel against the oracle in the image's Triton, in its interpreter;
8. ``kernel-build``: the CUDA kernel built as the GPU run's ``kernel_build`` job builds it (``gpu_check.py
   --build-only`` in a copy of the checkout) against the image's torch, with this machine's nvcc, and registered.

What stays for the GPU: the sm_90 cut's kernels running (``smoke``), the CUDA tests, CUDA graphs, async scheduling, the
engines.
Exit status 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cases  # noqa: E402
import device_run  # noqa: E402

IMAGE_FILE = HERE / "image.txt"
# What the GPU run imports on its way to an engine's first step: the smoke's kernels, the engine, executor, worker and
# runner, fused MoE and its router, Triton attention, the models, the sampler, n-gram drafts, the offload connector,
# sleep mode's allocator, compilation and CUDA graphs, the schedulers; the plugin and what the cases use of it.
ENGINE_MODULES = (
    "vllm", "vllm._custom_ops", "vllm.platforms.cuda", "vllm.cumem_allocator", "vllm.entrypoints.llm",
    "vllm.engine.arg_utils", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.layers.fused_moe.layer",
    "vllm.model_executor.layers.fused_moe.fused_moe", "vllm.model_executor.layers.fused_moe.router.fused_topk_router",
    "vllm.v1.attention.backends.triton_attn", "vllm.model_executor.models.qwen3_moe",
    "vllm.model_executor.models.mixtral", "vllm.v1.sample.sampler", "vllm.v1.sample.rejection_sampler",
    "vllm.v1.spec_decode.ngram_proposer", "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.device_allocator.cumem", "vllm.compilation.backends", "vllm.compilation.cuda_graph",
    "vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler", "vllm_ascend_routing",
    "vllm_ascend_routing.integration", "vllm_ascend_routing.ops._triton", "vllm_ascend_routing.preflight.offline",
    "vllm_ascend_routing.preflight.scenarios", "vllm_ascend_routing.preflight.weight_reload",
    "vllm_ascend_routing.sleep_mode", "tests.harness.oracle", "tests.harness.scenarios",
    "tests.harness.weight_reload_suite",
)  # fmt: skip
PLUGIN_GROUP, PLUGIN = "vllm.general_plugins", "vllm_ascend_routing"
TRITON_TESTS = ("tests/ops/test_triton_kernel.py", "-k", "interpreter")


class RehearsalError(Exception):
    """A step that did not pass; its message says what to fix before a GPU runs it."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_FILE) -> dict[str, str | None]:
    """``image.txt``: each distribution the image holds, with the version seen there or None."""
    held: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            held[normalize(name)] = version or None
    return held


def outside_image(owners: Mapping[str, str | None], image: Iterable[str]) -> dict[str, list[str]]:
    """Of the top-level modules taken from the environment's own site-packages (module -> the distribution whose
    RECORD lists its file, None if none does), those the image would not have: distribution -> its modules."""
    held = {normalize(name) for name in image}
    missing: dict[str, list[str]] = {}
    for module, owner in sorted(owners.items()):
        if owner is None or normalize(owner) not in held:
            missing.setdefault(owner or f"no distribution (module {module})", []).append(module)
    return missing


def driver_symbols(libraries: Iterable[Path]) -> list[str]:
    """The CUDA driver functions (``cu*``) the libraries leave undefined, from ``nm -D``."""
    symbols: set[str] = set()
    for library in libraries:
        listed = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True)
        if listed.returncode != 0:
            raise RehearsalError(f"nm could not read {library}: {listed.stderr.strip()}")
        symbols.update(word for word in listed.stdout.split() if re.fullmatch(r"cu[A-Z]\w*", word))
    return sorted(symbols)


def stub_source(symbols: Iterable[str]) -> str:
    """C for a stand-in driver: each function returns CUDA_ERROR_NO_DEVICE (100): nothing takes it for a GPU."""
    lines = ["/* REHEARSAL ONLY (scripts/gpu_e2e/rehearse.py): no NVIDIA driver here; every call fails. */"]
    lines += [f"int {name}(void) {{ return 100; }}" for name in sorted({*symbols, "cuInit", "cuDriverGetVersion"})]
    return "\n".join(lines) + "\n"


def build_driver_stub(site: Path, folder: Path) -> str:
    libraries = sorted((site / "vllm").glob("*.so"))
    symbols = driver_symbols(libraries)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "libcuda.c").write_text(stub_source(symbols))
    compiler = os.environ.get("CC", "cc")
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(folder / "libcuda.c")],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise RehearsalError(f"{compiler} could not build the driver stub: {built.stderr.strip()[-1500:]}")
    return f"{len(symbols)} driver functions of {len(libraries)} libraries ({', '.join(p.name for p in libraries)})"


# ---- run inside the child that sees the payload (--probe, --reference) ----


def probe(modules: Iterable[str]) -> dict[str, Any]:
    """Import each module; the plugin's entry points; the top-level modules taken from this environment itself, each
    with the distribution that installed its file (by file: setuptools' vendored packages are setuptools')."""
    import importlib
    import importlib.metadata as metadata
    import sysconfig

    failures = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 (an import may exit or raise anything; each is reported)
            failures[name] = f"{type(error).__name__}: {str(error).strip()[:400]}"
    plugins = [entry.value for entry in metadata.entry_points(group=PLUGIN_GROUP) if entry.name == PLUGIN]
    own = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    installed_by: dict[str, str] = {}
    for distribution in metadata.distributions(path=own):
        for listed in distribution.files or []:
            installed_by[os.path.realpath(str(distribution.locate_file(listed)))] = distribution.metadata["Name"]
    owners: dict[str, str | None] = {}
    for name, module in list(sys.modules.items()):
        file = str(getattr(module, "__file__", None) or "")
        if file.startswith(tuple(own)):
            owners.setdefault(name.split(".")[0], installed_by.get(os.path.realpath(file)))
    return {"failures": failures, "plugins": plugins, "owners": owners}


def reference_digests(root: Path, architectures: Iterable[str]) -> dict[str, Any]:
    """Per model: the layers whose router was hooked, and the reference ids and logits of a fixed prompt."""
    import hashlib

    import transformers
    from vllm.config import ModelConfig

    import tests.harness.model_recipes  # noqa: F401 (the benchmark model's recipe)
    from vllm_ascend_routing.preflight import models
    from vllm_ascend_routing.preflight.reference import RouterReference

    out: dict[str, Any] = {"transformers": transformers.__version__}
    for arch in architectures:
        model = models.build_tiny_moe(arch, root / arch)
        reference = RouterReference(model.path, model.num_hidden_layers, model.num_experts, model.top_k)
        ids, logits = reference.routed_experts_and_logits(list(range(3, 67)))
        # vLLM reads the checkpoint's config through this transformers too (an engine's first step).
        config = ModelConfig(model=str(model.path), dtype="float32", max_model_len=512)
        out[arch] = {
            "moe_layers": list(model.moe_layers),
            "hooked": sorted(reference._logits),
            "ids": hashlib.sha256(ids.tobytes()).hexdigest(),
            "logits": [round(float(value), 3) for value in logits.sum(axis=(0, 2))],
            "vllm_reads": [*config.architectures, config.hf_config.num_hidden_layers],
        }
    return out


def gpu_run_architectures() -> list[str]:
    """Every model the GPU run builds: its cases', the n-gram case's, the benchmark's."""
    return sorted({case.arch for case in cases.CASES.values()} | {"qwen3_moe", cases.bench_workload(False)[0]})


# ---- the steps ----


def child(arguments: list[str], env: Mapping[str, str], python: str = sys.executable) -> dict[str, Any]:
    done = subprocess.run(
        [python, str(Path(__file__)), *arguments], env={**os.environ, **env}, capture_output=True, text=True
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("REHEARSAL_RESULT ")]
    if done.returncode != 0 or not found:
        raise RehearsalError(
            f"{' '.join(arguments[:1])} ended with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return dict(json.loads(found[-1].removeprefix("REHEARSAL_RESULT ")))


def check_imports(env: Mapping[str, str]) -> str:
    result = child(["--probe"], env)
    problems = [f"{name}: {why}" for name, why in result["failures"].items()]
    if result["plugins"] != [f"{PLUGIN}:register"]:
        problems.append(f"entry point {PLUGIN_GROUP}:{PLUGIN} found as {result['plugins']} (want it once)")
    for distribution, modules in outside_image(result["owners"], image_packages()).items():
        problems.append(f"{', '.join(modules)} came from {distribution}, which the GPU machine's image does not hold")
    if problems:
        raise RehearsalError("\n".join(problems))
    return f"{len(ENGINE_MODULES)} modules; {len(result['owners'])} top-level modules from the image's distributions"


def check_surface(env: Mapping[str, str]) -> str:
    command = [sys.executable, "-m", "vllm_ascend_routing", "doctor", "--platform", "cuda", "--surface"]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    verdict = [line for line in done.stdout.splitlines() if "doctor:" in line]
    if done.returncode != 0 or not verdict or "PASS" not in verdict[-1]:
        raise RehearsalError(f"doctor --surface on the payload's vLLM:\n{(done.stdout + done.stderr)[-3000:]}")
    return verdict[-1].split("doctor:", 1)[1].strip()


def check_reference(env: Mapping[str, str], work: Path, compare_python: str | None) -> str:
    archs = gpu_run_architectures()
    # The plugin off: vLLM inspects a model in a child process that loads plugins, and the plugin refuses the platform
    # vLLM finds without a GPU ('').
    mine = child(["--reference", str(work / "models-image"), *archs], {**env, "VLLM_ASCEND_ROUTING": "0"})
    problems = [
        f"{arch}: routers hooked in layers {mine[arch]['hooked']}, MoE layers {mine[arch]['moe_layers']}"
        for arch in archs
        if mine[arch]["hooked"] != mine[arch]["moe_layers"]
    ]
    against = ""
    if compare_python:
        plain = {"PYTHONPATH": str(ROOT), "VLLM_ASCEND_ROUTING": "0"}
        theirs = child(["--reference", str(work / "models-compare"), *archs], plain, compare_python)
        problems += [
            f"{arch}: ids or logits differ from transformers {theirs['transformers']}'s"
            for arch in archs
            if mine[arch] != theirs[arch]
        ]
        against = f", equal to transformers {theirs['transformers']}'s"
    if problems:
        raise RehearsalError("\n".join(problems))
    return f"transformers {mine['transformers']}: {', '.join(archs)}, every MoE layer hooked, read by vLLM{against}"


def check_triton(env: Mapping[str, str]) -> str:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TRITON_TESTS]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or ["no output"])[-1]
    if done.returncode != 0:
        raise RehearsalError(
            f"the Triton kernel in the image's Triton's interpreter:\n{done.stdout[-3000:]}{done.stderr[-800:]}"
        )
    import triton

    return f"Triton {triton.__version__}: {last}"


def check_kernel_build(work: Path) -> str:
    if not shutil.which("nvcc"):
        raise RehearsalError("no nvcc on PATH: the GPU run's kernel build cannot be rehearsed on this machine")
    tree = device_run.native_tree(work / "native")
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(device_run.kernel_build_command(tree), cwd=tree, env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0:
        raise RehearsalError(
            f"gpu_check.py --build-only against the image's torch:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    built = [line.split(": ", 1)[1] for line in lines if line.strip().startswith("ok (") and " via " in line]
    return f"{built[0] if built else 'built'}; {lines[-1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--payload", type=Path, default=ROOT / ".gpu-e2e")
    parser.add_argument("--compare-python", help="a python with another transformers (the vLLM 0.26.0 CPU venv's)")
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a scratch folder, removed)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print("REHEARSAL_RESULT " + json.dumps(probe(ENGINE_MODULES)))
        return 0
    if args.reference:
        print("REHEARSAL_RESULT " + json.dumps(reference_digests(Path(args.reference[0]), args.reference[1:])))
        return 0
    work = args.keep or Path(tempfile.mkdtemp(prefix="gpu-e2e-rehearsal-"))
    payload = args.payload if args.payload.is_absolute() else ROOT / args.payload
    site, stub = work / "site", work / "driver-stub"
    # As the GPU run sets it (device_run.engine_env), plus the stand-in driver.
    env = {**device_run.engine_env(site, ROOT), "LD_LIBRARY_PATH": str(stub), "VLLM_ASCEND_ROUTING_MODELS": str(work)}
    manifest: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], str]]] = [
        ("payload", lambda: device_run.describe_payload(payload, manifest)),
        ("install", lambda: device_run.install(payload, manifest, site)),
        ("driver-stub", lambda: build_driver_stub(site, stub)),
        ("imports", lambda: check_imports(env)),
        ("surface", lambda: check_surface(env)),
        ("reference", lambda: check_reference(env, work, args.compare_python)),
        ("triton", lambda: check_triton(env)),
        ("kernel-build", lambda: check_kernel_build(work)),
    ]
    print(f"gpu-e2e-rehearse: {sys.executable} (Python {sys.version.split()[0]}), work in {work}", flush=True)
    failed = []
    for name, action in steps:
        began = time.monotonic()
        try:
            detail = action()
        except (RehearsalError, device_run.StepError) as error:
            failed.append(name)
            print(f"   {name}: FAILED ({time.monotonic() - began:.0f} s):\n{error}", flush=True)
            if name in ("payload", "install", "driver-stub"):
                break  # every later step needs these
            continue
        print(f"   {name}: ok ({time.monotonic() - began:.0f} s): {detail}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    verdict = f"FAILED: {', '.join(failed)}" if failed else "PASSED"
    stays = "the kernels running, the CUDA tests, CUDA graphs, the engines"
    print(f"gpu-e2e-rehearse: {verdict} (what stays for a GPU: {stays})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
