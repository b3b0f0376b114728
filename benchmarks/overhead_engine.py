# SPDX-License-Identifier: Apache-2.0
"""``make bench``'s workload and engines: the benchmark model, one warmed vLLM engine per mode in a process of
its own (``Engine``, running ``overhead.py --worker MODE``), and what each vLLM release can start on this CPU."""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARCH = "qwen3_moe_bench"
KV_CACHE_BYTES = 512 * 1024 * 1024
OVERHEAD = Path(__file__).with_name("overhead.py")  # the command line; ``--worker MODE`` runs ``worker``


def engine_cpu_seconds() -> float:
    """CPU seconds (user + system, every thread) of this process and its children: the whole engine's work,
    whichever process layout the release uses; unlike wall time it does not count time spent waiting for a
    core that something else on the machine holds."""
    import psutil  # type: ignore[import-untyped]  # a vLLM requirement; no stubs in the dev environment

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def install_step_timer(worker: Any) -> None:
    """Times each step of this worker's model runner (called through ``collective_rpc``): the runner's
    ``execute_model`` and ``sample_tokens`` as the engine calls them (the plugin's runner hooks included), and the
    model's forward inside (``_model_forward``: on the CPU the forward is synchronous, so its wall time is its
    compute). Instance attributes wrap the bound methods, whatever class the runner is."""
    runner = worker.model_runner
    steps: list[list[float]] = []  # [scheduled tokens, execute_model s, forward s, sample_tokens s]
    runner._bench_step_times = steps
    execute_model, model_forward, sample_tokens = runner.execute_model, runner._model_forward, runner.sample_tokens

    def timed_execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append([float(scheduler_output.total_num_scheduled_tokens), 0.0, 0.0, 0.0])
        start = time.perf_counter()
        try:
            return execute_model(scheduler_output, *args, **kwargs)
        finally:
            steps[-1][1] = time.perf_counter() - start

    def added_to_step(method: Any, column: int) -> Any:
        """``method``, its time added to the current step's ``column``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if steps:
                    steps[-1][column] += time.perf_counter() - start

        return timed

    timed_forward, timed_sample = added_to_step(model_forward, 2), added_to_step(sample_tokens, 3)
    runner.execute_model, runner._model_forward, runner.sample_tokens = timed_execute, timed_forward, timed_sample


def take_step_times(worker: Any) -> list[list[float]]:
    """The steps timed since the last call (``install_step_timer``), and a fresh start."""
    steps: list[list[float]] = worker.model_runner._bench_step_times
    taken = list(steps)
    steps.clear()
    return taken


def step_split(steps: list[list[float]], tokens: int) -> dict[str, float]:
    """Median microseconds of the steps that scheduled exactly ``tokens`` tokens (the full batch's decode steps):
    the model's forward, and the rest of the step (``execute_model`` + ``sample_tokens`` - forward: the runner's
    and the plugin's host work)."""
    chosen = [s for s in steps if int(s[0]) == tokens]
    if not chosen:
        return {"steps": 0}
    return {
        "steps": len(chosen),
        "forward_us": statistics.median(s[2] for s in chosen) * 1e6,
        "rest_us": statistics.median((s[1] + s[3] - s[2]) for s in chosen) * 1e6,
    }


def worker(mode: str, requests: int, tokens: int, eager: bool = False) -> None:
    """One engine, one mode: warm up, print READY, then time one batch per ``run`` line read from stdin."""
    import importlib.util

    from vllm import LLM, SamplingParams

    # The benchmark model's recipe, as the checkout this engine runs has it (a 'before' engine runs another
    # checkout's: one older than tests/harness/model_recipes.py holds it in its own preflight/models.py).
    if importlib.util.find_spec("tests.harness.model_recipes") is not None:
        import tests.harness.model_recipes  # noqa: F401
    from vllm_ascend_routing.preflight import models, scenarios

    if mode == "unchecked":  # the plugin with its always-on check's per-step work removed (in-process engine)
        from vllm_ascend_routing.sentinel import Sentinel

        def skip(self: Sentinel, *args: Any) -> None:
            return None

        setattr(Sentinel, "clear", skip)  # noqa: B010
        setattr(Sentinel, "after_forward", skip)  # noqa: B010
    model = models.build_tiny_moe(ARCH, scenarios.model_dir() / ARCH)
    llm = LLM(
        model=str(model.path),
        dtype="float32",
        enable_return_routed_experts=(mode in ("plugin", "before", "unchecked", "vllm", "vllm-control")),
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=1024,
        seed=0,
        enforce_eager=eager,
    )
    prompts = [{"prompt_token_ids": p} for p in models.mixed_prompts(requests, seed=3, min_len=16, max_len=256)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    # Warm-up: the whole prompt set, so every prefill and decode batch shape the timed batch meets has
    # been compiled and every cache touched once (a smaller warm-up left the first timed batch slow).
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    config = llm.llm_engine.vllm_config
    llm.collective_rpc(install_step_timer)
    print("OVERHEAD_READY", flush=True)
    for command in sys.stdin:
        if command.strip() != "run":
            break
        start, cpu_start = time.perf_counter(), engine_cpu_seconds()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        cpu_seconds = engine_cpu_seconds() - cpu_start
        steps = [step for rank in llm.collective_rpc(take_step_times) for step in rank]
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        routed = [o.outputs[0].routed_experts for o in outputs]
        result = {
            "mode": mode,
            "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
            "kv_block_size": int(config.cache_config.block_size),
            "seconds": seconds,
            "generated_tokens": generated,
            "tokens_per_s": generated / seconds,
            "cpu_seconds": cpu_seconds,
            "tokens_per_cpu_s": generated / cpu_seconds,
            "routing_bytes_per_token": None if routed[0] is None else int(routed[0][0].nbytes),
            "routing_dtype": None if routed[0] is None else str(routed[0].dtype),
            "decode_step": step_split(steps, requests),
        }
        print("OVERHEAD_RESULT " + json.dumps(result), flush=True)


class Engine:
    """A warmed worker process for one mode; ``run()`` times one batch in it."""

    def __init__(self, mode: str, args: argparse.Namespace, cache_root: str, eager: bool = False) -> None:
        # Insecure serialization: the step timer is a function sent through collective_rpc (multi-process engine).
        env = dict(os.environ, VLLM_CACHE_ROOT=cache_root, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        if not args.multiprocess:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.pop("VLLM_ASCEND_ROUTING", None)
        if mode in ("plugin", "before", "unchecked") or (mode in ("off", "control") and not vllm_alone_runs()):
            env["VLLM_ASCEND_ROUTING"] = "1"
        if mode == "before":  # another checkout's plugin: its folder ahead of the installed package
            baseline = str(Path(args.baseline_checkout).resolve())
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (baseline, env.get("PYTHONPATH"))))
        self.mode = mode
        # stderr (vLLM's logging) goes to a file, shown if the worker fails; closed in close().
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        cmd = [
            sys.executable,
            str(OVERHEAD),
            "--worker",
            mode,
            "--requests",
            str(args.requests),
            "--tokens",
            str(args.tokens),
            *(["--eager"] if eager else []),
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self._expect("OVERHEAD_READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
        self.log.seek(0)
        raise SystemExit(f"{self.mode} engine failed ({self.proc.wait()}):\n{self.log.read()[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return dict(json.loads(self._expect("OVERHEAD_RESULT ")))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


# The A/A controls run their baseline's compiled graph, ``unchecked`` the plugin's (its check runs outside the
# graph): priming one primes the other.
SAME_GRAPH_AS = {"control": "off", "vllm-control": "vllm", "unchecked": "plugin"}


def engine_method(args: argparse.Namespace) -> str:
    """How the engines ran, as the history records it: runs timed another way are not compared with these."""
    layout = "multi-process" if args.multiprocess else "in-process"
    started = "new engine processes every round" if args.fresh_engines else "one warmed engine per mode"
    graphs = "eager (enforce_eager)" if getattr(args, "eager", False) else "compiled graphs loaded from a primed cache"
    return f"{started}, {layout}, {graphs}, batches alternated"


def prime_compile_cache(modes: list[str], args: argparse.Namespace, cache_root: str) -> None:
    """Start and close one engine per compiled graph among ``modes``, so that every timed engine loads its graph
    from the cache, as a restarted server does. Unprimed, the A/A control was the one engine that loaded its graph
    (its twin had just compiled it) and it came out above 1 in all 11 compiled runs: a bias of the method, not noise.
    Priming alone did not remove it (the control is also started last); with ``--fresh-engines`` (every order of
    starts in turn) the A/A medians were 0.990-1.004 (docs/performance.md)."""
    for mode in dict.fromkeys(SAME_GRAPH_AS.get(mode, mode) for mode in modes):
        Engine(mode, args, cache_root).close()


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())


def machine() -> str:
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512"
    return f"{os.cpu_count()} CPUs, {isa}{', AMX' if 'amx_tile' in flags else ''}"


@functools.cache
def vllm_alone_runs() -> bool:
    """vLLM 0.20-0.27 crash in their pure-PyTorch CPU MoE unless the plugin's compat fix is applied; they
    take it without the grouped-GEMM kernels (CPUs without AVX-512) and, for float32, on AMX CPUs."""
    from tests.harness.cpu_moe_choice import CpuMoeKernel, vllm_cpu_moe_kernel

    return vllm_cpu_moe_kernel(ARCH) is not CpuMoeKernel.PURE_TORCH


def refuse_where_vllm_cannot_start() -> None:
    """vLLM 0.27 refuses float32 MoE weights on AMX CPUs (no kernel for them), plugin or not."""
    from tests.harness.cpu_moe_choice import CpuMoeKernel, vllm_cpu_moe_kernel

    if vllm_cpu_moe_kernel(ARCH) is CpuMoeKernel.REFUSED:
        import vllm

        raise SystemExit(
            f"vLLM {vllm.__version__} refuses the float32 benchmark model's CPU MoE on this AMX CPU (its "
            "grouped-GEMM kernel there needs bfloat16 and it will not fall back): use another release"
        )


def vllm_path_starts_on_cpu() -> bool:
    """Whether vLLM's own routed-experts path starts on the CPU build: not in 0.27 (refused for the CPU
    MoE), 0.28-0.29 (monolithic CPU experts refused) or 0.31+ (needs Model Runner V2)."""
    import vllm

    minor = int(vllm.__version__.split(".")[1])
    return minor <= 26 or minor == 30


def vllm_capture_records_on_cpu() -> bool:
    """Whether vLLM's own capture records real ids on the CPU build (router ``capture_fn``): 0.30 only. Up to
    0.26 the CPU MoE bypasses the router (zeros); 0.27-0.29 refuse the flag with their monolithic CPU experts
    (0.28.0 and 0.29.0: docs/performance.md); from 0.31 the path needs Model Runner V2 (not on the CPU)."""
    import vllm

    return vllm_path_starts_on_cpu() and int(vllm.__version__.split(".")[1]) >= 28
