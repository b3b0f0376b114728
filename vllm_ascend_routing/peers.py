# SPDX-License-Identifier: Apache-2.0
"""Every worker of an engine runs the plugin, or the engine does not start.

Routing is recorded in the workers; a worker without the plugin leaves vLLM's own capture in place, which
returns all-zero rows wherever routing bypasses vLLM's router or the MoE forward is compiled, and nothing
downstream can tell. Workers are often processes the engine's own environment does not reach: Ray actors
(vLLM's Ray executors copy the driver's variables, RayExecutorV2 with ``setdefault`` so a value on the Ray
node wins, and never the names on vLLM's non-carry-over list), other nodes, other launches. So the engine
core asks each worker, through vLLM's own executor RPC (``collective_rpc``), what it runs, right after the
workers loaded the model and before the KV cache is allocated, and refuses to start on any disagreement,
naming the worker and how the variable failed to reach it.

The other direction (workers on, engine core off: the variable reached only the workers, e.g. set on every
Ray node but not in the driver) leaves no process to ask the workers. The workers notice it themselves when
their KV cache is initialised without the engine's question having arrived: where the rows travel through
vLLM's own transport (0.22+) they are still exact and the worker logs what is not checked; where the
front-end must read the plugin's store (0.20.x) the worker refuses, since the front-end would read zeros.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_ascend_routing import envs, patching, runner_state
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.patching import Patch

logger = get_logger(__name__)

ENGINE_KV_CACHE_INIT = Patch(
    "vllm.v1.engine.core:EngineCore._initialize_kv_caches",
    "start-up check: every worker has the plugin on and bound its MoE layers (asked through collective_rpc)",
    "never",
    params=("self", "vllm_config"),
)
PATCHES = (ENGINE_KV_CACHE_INIT,)
NEEDS: tuple[str, ...] = ()  # every generation

MASTER_SWITCH = "VLLM_ASCEND_ROUTING"
# Variables every process of an engine must agree on: the master switch, the generation, validation mode.
AGREED = ("VLLM_ASCEND_ROUTING", "VLLM_ASCEND_ROUTING_VLLM_API", "VLLM_ASCEND_ROUTING_VALIDATE")
_PLUGIN_NAME = "vllm_ascend_routing"  # the entry point's name, as VLLM_PLUGINS lists it

_checked_by_engine = False  # this worker process was asked by its engine core (set by worker_state)
_noted_unchecked = False


class WorkerMismatchError(UnsupportedVllmError):
    """A worker of this engine does not run the plugin as the engine does: it would return wrong rows."""


@dataclass(frozen=True)
class WorkerState:
    """What one worker process runs, as it reports it."""

    rank: int | None
    host: str
    pid: int
    ray_node: str | None
    version: str
    active: bool  # register() installed the plugin in that process
    raw_switch: str | None  # VLLM_ASCEND_ROUTING as found in its environment (None: unset)
    settings: dict[str, str]  # AGREED, parsed (an unreadable value as "invalid: ...")
    vllm_plugins: str | None  # VLLM_PLUGINS there: vLLM loads only the plugins it names, when set
    bound_layers: int | None  # MoE layers its runner bound; None: no capture prepared there

    def label(self) -> str:
        where = f"pid {self.pid} on host {self.host}" + (f", Ray node {self.ray_node}" if self.ray_node else "")
        return f"worker rank {self.rank if self.rank is not None else '?'} ({where})"


def settings() -> dict[str, str]:
    """This process's reading of the variables every process of an engine must agree on."""
    values = {}
    for name in AGREED:
        try:
            values[name] = str(getattr(envs, name))
        except ValueError as exc:
            values[name] = f"invalid: {exc}"
    return values


def worker_state(worker: Any = None) -> dict[str, Any]:
    """Runs in each worker (sent by the engine core through ``collective_rpc``): what it runs.

    Importable wherever the package is installed, plugin on or off; it changes nothing but the note that
    the engine asked."""
    global _checked_by_engine
    package = sys.modules["vllm_ascend_routing"]  # loaded with this module (importing it here would loop)

    _checked_by_engine = True
    runner = getattr(worker, "model_runner", None)
    prepared = runner_state.prepared_capture(runner) if runner is not None else None
    rank = getattr(worker, "rank", None)
    return {
        "rank": rank if isinstance(rank, int) else None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ray_node": _ray_node(),
        "version": package.__version__,
        "active": bool(getattr(package, "_registered", False)),
        "raw_switch": os.environ.get(MASTER_SWITCH),
        "settings": settings(),
        "vllm_plugins": os.environ.get("VLLM_PLUGINS"),
        "bound_layers": None if prepared is None else prepared.num_bound_layers,
    }


def _ray_node() -> str | None:
    ray = sys.modules.get("ray")
    # A folder named ray on the path imports as a namespace package without Ray's API: no Ray node here.
    is_initialized = getattr(ray, "is_initialized", None)
    if ray is None or not callable(is_initialized) or not is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 (a Ray without a runtime context: no node to name)
        return None


# ---- engine core ----


def install(ctx: InstallContext) -> None:
    """The engine asks its workers before its KV cache exists (idempotent)."""
    install_check(ctx.adapter.routed_experts_requested)


def install_check(routed_experts_requested: Callable[[Any], bool]) -> None:
    """Make the engine core check its workers before it allocates the KV cache, for engines that request
    routed experts (``routed_experts_requested(vllm_config)``, the generation's reading; idempotent)."""
    patching.replace(ENGINE_KV_CACHE_INIT, lambda original: _checking_workers(original, routed_experts_requested))


def _checking_workers(initialize_kv_caches: Any, routed_experts_requested: Callable[[Any], bool]) -> Any:
    @functools.wraps(initialize_kv_caches)
    def checked(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        if routed_experts_requested(vllm_config):
            verify_workers(self.model_executor)
        return initialize_kv_caches(self, vllm_config, *args, **kwargs)

    return checked


def verify_workers(executor: Any) -> list[WorkerState]:
    """Ask every worker of ``executor`` what it runs; raise ``WorkerMismatchError`` on any disagreement."""
    started = time.perf_counter()
    try:
        replies = executor.collective_rpc(worker_state)
    except Exception as exc:
        raise WorkerMismatchError(
            "vllm-ascend-routing: the engine could not ask its workers whether they run the plugin "
            f"({type(exc).__name__}: {exc}). Install vllm-ascend-routing (the same version) on every node "
            "that runs a worker, or unset VLLM_ASCEND_ROUTING."
        ) from exc
    workers = [WorkerState(**reply) for reply in replies]
    problems = [problem for worker in workers if (problem := mismatch(worker, settings(), _own_version()))]
    elapsed_ms = (time.perf_counter() - started) * 1000
    if problems:
        raise WorkerMismatchError(
            f"vllm-ascend-routing: {len(problems)} of {len(workers)} worker(s) of this engine do not run the "
            "plugin as the engine does, so their routed experts would be wrong (all zero where vLLM's own "
            "capture sees nothing):\n  - " + "\n  - ".join(problems)
        )
    layers = sorted({worker.bound_layers for worker in workers if worker.bound_layers is not None})
    logger.info(
        "vllm-ascend-routing: all %d worker(s) run the plugin (%s MoE layers bound each; %s); checked in %.1f ms",
        len(workers),
        "/".join(map(str, layers)),
        ", ".join(f"{name}={value}" for name, value in settings().items() if name != MASTER_SWITCH),
        elapsed_ms,
    )
    return workers


def _own_version() -> str:
    return str(sys.modules["vllm_ascend_routing"].__version__)


def mismatch(worker: WorkerState, expected: dict[str, str], version: str) -> str | None:
    """Why ``worker`` does not run the plugin as this engine does (``None``: it does)."""
    who = worker.label()
    if not worker.active:
        return f"{who}: the plugin is off there: {_why_off(worker)}"
    if worker.version != version:
        return (
            f"{who} runs vllm-ascend-routing {worker.version}, the engine {version}: install the same version on "
            "every node"
        )
    differing = [
        f"{name}={worker.settings.get(name)!r} there, {value!r} here"
        for name, value in expected.items()
        if worker.settings.get(name) != value
    ]
    if differing:
        return (
            f"{who}: {'; '.join(differing)}: set the same value in every process of the engine (driver "
            "environment, Ray runtime_env env_vars, or the Ray nodes' environment)"
        )
    if not worker.bound_layers:
        return (
            f"{who}: the plugin is on but bound no MoE layer there (its model runner's load_model hook did not "
            "run: a runner class this release of the plugin does not hook)"
        )
    return None


def _why_off(worker: WorkerState) -> str:
    raw = worker.raw_switch
    if raw is None:
        non_carry_over, where = ray_non_carry_over()
        if MASTER_SWITCH in non_carry_over:
            return (
                f"{MASTER_SWITCH} is unset in its environment because it is on vLLM's list of variables not "
                f"carried to Ray workers ({where}, non-carry-over list): remove it from that list, or pass it "
                "in Ray's runtime_env env_vars, or set it on every Ray node"
            )
        return (
            f"{MASTER_SWITCH} is unset in its environment (vLLM did not carry it from the engine to that "
            "worker): set it in the environment of every node that runs a worker, or pass it in Ray's "
            "runtime_env env_vars"
        )
    if raw.strip().lower() in ("", "0", "false", "no", "off"):
        return (
            f"{MASTER_SWITCH}={raw!r} in its environment, set where it runs: under Ray, a value on the Ray node "
            "wins over the driver's (vLLM applies the driver's variables only where the node has none): "
            f"restart that node without {MASTER_SWITCH} (or with =1), or pass {MASTER_SWITCH}=1 in Ray's "
            "runtime_env env_vars"
        )
    plugins = worker.vllm_plugins
    if plugins is not None and _PLUGIN_NAME not in [name.strip() for name in plugins.split(",")]:
        return f"VLLM_PLUGINS={plugins!r} there does not name {_PLUGIN_NAME!r}, so vLLM never loaded it: add it"
    return f"{MASTER_SWITCH}={raw!r} there, yet the plugin did not register (see that worker's log)"


def ray_non_carry_over() -> tuple[frozenset[str], str]:
    """vLLM's list of variables its Ray executors do not copy to workers, and the file it comes from."""
    import importlib

    try:
        module = importlib.import_module("vllm.ray.ray_env")  # vLLM's own reading of the list
    except ImportError:
        return frozenset(), "vLLM's ray_non_carry_over_env_vars.json"
    return (
        frozenset(getattr(module, "RAY_NON_CARRY_OVER_ENV_VARS", ()) or ()),
        str(getattr(module, "RAY_NON_CARRY_OVER_ENV_VARS_FILE", "ray_non_carry_over_env_vars.json")),
    )


# ---- worker ----


def worker_ready(runner: Any, rows_read_in_front_end: bool) -> None:
    """In a worker with the plugin on, once its KV cache exists: if its engine core never asked (the engine
    runs without the plugin), say what that means, or refuse where the front-end must read the plugin's store."""
    global _noted_unchecked
    if _checked_by_engine or runner_state.prepared_capture(runner) is None:
        return
    text = (
        "vllm-ascend-routing: this worker runs the plugin, but the engine that drives it does not (its "
        f"process has no {MASTER_SWITCH}=1: the variable reached only the workers, e.g. set on the Ray nodes but "
        "not where the LLM / server is started)"
    )
    if rows_read_in_front_end:
        raise WorkerMismatchError(
            f"{text}. On this vLLM release the front-end reads the rows from the plugin's store, so it would "
            f"return zeros: set {MASTER_SWITCH}=1 where the engine starts (vLLM carries it to the workers)."
        )
    if not _noted_unchecked:
        _noted_unchecked = True
        logger.warning(
            "%s. Rows are recorded here and returned exactly, but the engine's start-up check of its workers "
            "and validation mode's array checks do not run: set %s=1 (and the same VLLM_ASCEND_ROUTING_* values) "
            "where the engine starts, or in Ray's runtime_env.",
            text,
            MASTER_SWITCH,
        )
