# SPDX-License-Identifier: Apache-2.0
"""Every environment variable the plugin reads, in one place.

Values are read lazily (module ``__getattr__``) so a test or a process that sets a variable after import
still sees it, and so importing this module never imports vLLM or torch. ``setup.py`` reads the build
section by path.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_ASCEND_ROUTING: bool = False
    VLLM_ASCEND_ROUTING_VLLM_API: str = "auto"
    VLLM_ASCEND_ROUTING_FORCE_REFERENCE: bool = False
    VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB: int = 256
    VLLM_ASCEND_ROUTING_STORE: str = ""
    VLLM_ASCEND_ROUTING_KV_SECRET: str = ""
    VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S: int = 60
    VLLM_ASCEND_ROUTING_STORE_MIB: int = 2048
    VLLM_ASCEND_ROUTING_STORE_TTL_S: int = 3600
    VLLM_ASCEND_ROUTING_VALIDATE: str = "off"
    VLLM_ASCEND_ROUTING_TARGET_DEVICE: str = ""
    VLLM_ASCEND_ROUTING_CACHE: str = "~/.cache/vllm_ascend_routing"
    VLLM_ASCEND_ROUTING_MODELS: str = "<tmp>/vllm_ascend_routing_models"


def flag_reader(name: str) -> Callable[[], bool]:
    """A reader of the 0/1 variable ``name`` (also ``true``/``false``, ``yes``/``no``, ``on``/``off``; unset: 0)."""

    def read() -> bool:
        value = os.getenv(name, "0").strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("", "0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={value!r}: expected 0 or 1")

    return read


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.getenv(name, default).strip().lower() or default
        if value not in choices:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
        return value

    return read


def _whole_number(name: str, default: int, unit: str = "MiB") -> Callable[[], int]:
    def read() -> int:
        value = os.getenv(name, "").strip()
        if not value:
            return default
        if not value.isdigit():
            raise ValueError(f"{name}={value!r}: expected a whole number of {unit} (0 or more)")
        return int(value)

    return read


def _generations() -> tuple[str, ...]:
    """``auto`` and the generations the release table says the plugin implements (read when the variable is)."""
    from vllm_ascend_routing import releases

    return ("auto", *(span.generation.value for span in releases.implemented()))


def _validate_mode() -> str:
    value = os.getenv("VLLM_ASCEND_ROUTING_VALIDATE", "0").strip().lower()
    modes = {"": "off", "0": "off", "off": "off", "1": "log", "log": "log", "strict": "strict"}
    if value not in modes:
        raise ValueError(f"VLLM_ASCEND_ROUTING_VALIDATE={value!r}: expected 0, 1 or strict")
    return modes[value]


environment_variables: dict[str, Callable[[], Any]] = {
    # ---- runtime ----
    # Master switch: the plugin does nothing at all unless this is 1.
    "VLLM_ASCEND_ROUTING": flag_reader("VLLM_ASCEND_ROUTING"),
    # Force the vLLM API generation instead of detecting it (tests, source builds with odd versions).
    "VLLM_ASCEND_ROUTING_VLLM_API": lambda: _choice("VLLM_ASCEND_ROUTING_VLLM_API", "auto", _generations())(),
    # Check every returned routed-experts array: "1" logs violations, "strict" raises ("0": off).
    "VLLM_ASCEND_ROUTING_VALIDATE": _validate_mode,
    # Use the PyTorch reference of record_topk_ids even where a native kernel is built.
    "VLLM_ASCEND_ROUTING_FORCE_REFERENCE": flag_reader("VLLM_ASCEND_ROUTING_FORCE_REFERENCE"),
    # With a KV connector the plugin has no carrier for (an offload tier, a cache service): how much memory each
    # scheduler may hold the rows of requests computed on its instance in, so that loads of their KV are served
    # (kv_carrier.HeldRowsCarrier; least recently used dropped first; 0: every such load is computed instead).
    "VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB": _whole_number("VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB", 256),
    # Signs the rows P/D carries in kv_transfer_params (NIXL, vllm-ascend's Mooncake: they pass through clients and
    # proxies) and derives the names of rows lent by transfer id (vLLM's MooncakeConnector): set the same value on
    # every prefill and decode instance; unset, an instance accepts only rows it lent itself.
    "VLLM_ASCEND_ROUTING_KV_SECRET": lambda: os.getenv("VLLM_ASCEND_ROUTING_KV_SECRET", ""),
    # vLLM's MooncakeConnector P/D: how long a decode request waits for its prompt's rows (lent through the row store
    # when the prefill finishes; its proxy sends both requests at once) before its prompt is computed here instead.
    "VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S": _whole_number("VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S", 60, "seconds"),
    # Where finished requests' rows go instead of the output (docs/output.md, "The row store"): unset, rows inline;
    # "shm", node-local shared memory; "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata", Mooncake.
    # The output then carries routed_experts_info["store_key"]; the trainer fetches with replay.fetch.
    "VLLM_ASCEND_ROUTING_STORE": lambda: os.getenv("VLLM_ASCEND_ROUTING_STORE", "").strip(),
    # The most each engine core keeps in the store at once (MiB, its live objects); past it a request's rows go inline.
    "VLLM_ASCEND_ROUTING_STORE_MIB": _whole_number("VLLM_ASCEND_ROUTING_STORE_MIB", 2048),
    # Seconds an object lives unless released first (0: until released or the engine's shutdown).
    "VLLM_ASCEND_ROUTING_STORE_TTL_S": _whole_number("VLLM_ASCEND_ROUTING_STORE_TTL_S", 3600, "seconds"),
    # ---- build (read by setup.py) ----
    # Native kernel backend to build: "cpu", "cuda", "npu" (each with the CPU kernel), or "" (none: pure Python).
    "VLLM_ASCEND_ROUTING_TARGET_DEVICE": _choice(
        "VLLM_ASCEND_ROUTING_TARGET_DEVICE", "", ("", "empty", "cpu", "cuda", "npu")
    ),
    # ---- tooling (scripts/venv.py, doctor's models; the tests' own settings: tests/settings.py) ----
    # Where per-release virtual environments and downloaded wheels are cached.
    "VLLM_ASCEND_ROUTING_CACHE": lambda: os.path.expanduser(
        os.getenv("VLLM_ASCEND_ROUTING_CACHE") or "~/.cache/vllm_ascend_routing"
    ),
    # Where the tiny test models are built (reused while their recipe is unchanged).
    "VLLM_ASCEND_ROUTING_MODELS": lambda: (
        os.getenv("VLLM_ASCEND_ROUTING_MODELS") or os.path.join(tempfile.gettempdir(), "vllm_ascend_routing_models")
    ),
}
# The ones that change what the plugin does at run time (the others build it or drive the tooling and tests).
runtime_variables: tuple[str, ...] = (
    "VLLM_ASCEND_ROUTING",
    "VLLM_ASCEND_ROUTING_VLLM_API",
    "VLLM_ASCEND_ROUTING_VALIDATE",
    "VLLM_ASCEND_ROUTING_FORCE_REFERENCE",
    "VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB",
    "VLLM_ASCEND_ROUTING_KV_SECRET",
    "VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S",
    "VLLM_ASCEND_ROUTING_STORE",
    "VLLM_ASCEND_ROUTING_STORE_MIB",
    "VLLM_ASCEND_ROUTING_STORE_TTL_S",
)


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def adopt_ray_job_variables() -> list[str]:
    """In a Ray driver whose job ``runtime_env`` sets the plugin's variables that its own environment lacks,
    copy them into ``os.environ`` and return their names.

    Ray gives a job's ``runtime_env`` to its actors and tasks, not to the driver process, so a user who passes
    ``VLLM_ASCEND_ROUTING=1`` there would otherwise get vLLM's Ray workers with the plugin and a front-end and
    engine core (the driver and its children) without it: no start-up check of the workers, no validation.
    A variable the driver sets itself wins. Costs a dictionary lookup unless Ray is imported and connected."""
    ray = sys.modules.get("ray")
    if ray is None or "VLLM_ASCEND_ROUTING" in os.environ:
        return []
    try:
        if not ray.is_initialized():
            return []
        job_variables = dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})
    except Exception:  # noqa: BLE001 (no usable Ray context: nothing to adopt)
        return []
    adopted = [name for name in environment_variables if name in job_variables and name not in os.environ]
    for name in adopted:
        os.environ[name] = str(job_variables[name])
    return adopted


def declare_to_vllm() -> None:
    """Add the plugin's variables to vLLM's registry (``vllm.envs.environment_variables``), which vLLM
    0.31+ checks every ``VLLM_*`` variable against ("Unknown vLLM environment variable", an error under
    ``--fail-on-environ-validation``). Only where vLLM has already loaded that module: imports nothing."""
    registry = getattr(sys.modules.get("vllm.envs"), "environment_variables", None)
    if isinstance(registry, dict):
        for name, read in environment_variables.items():
            registry.setdefault(name, read)
