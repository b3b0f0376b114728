# SPDX-License-Identifier: Apache-2.0
"""Why doctor's engine did not start, and what to do next: every start-up failure ends in a verdict.

``classify(exc, log)`` reads the exception (its chain included) and, where vLLM only says "see the root cause
above" (a worker or engine-core process failed, its traceback went to the log), the exception lines of the
output the engine's processes wrote (``preflight.logtail``). The first rule of ``RULES`` that matches names the
kind of failure and the next step; nothing matched is ``unknown`` (the traceback, and a bug report).

The kinds, in the order they are tried (the more specific first):

``engine_flags``   vLLM's parser refused the flags after ``--``
``package``        a package is missing (``No module named 'torch'``) or releases that do not go together
``plugin_refused`` this plugin refused the release or the layout (its message says what to change)
``numa_binding``   vLLM's CPU build could not bind each rank's threads to a NUMA node of its own
``out_of_memory``  the model, its KV cache or the activations do not fit
``collective_init`` the ranks could not set up NCCL, HCCL or gloo
``model``          vLLM could not find or read the model (path, config, weights, architecture)
``unknown``        none of these
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from vllm_ascend_routing.preflight import guide

PLUGIN = "vllm-ascend-routing"
# The plugin's own refusals (by class name: importing them here would import vLLM's and torch's layers).
PLUGIN_ERRORS = frozenset(
    {
        "UnsupportedVllmError",
        "WorkerMismatchError",
        "ShmSpaceError",
        "ShmCollisionError",
        "StateDirError",
        "UnboundLayerError",
        "SharedExpertsError",
        "PlacementError",
        "ValidationUnavailableError",
        "UnknownMoELayersError",
        "RoutingNotRecordedError",
    }
)
# An exception line of a traceback in a log, prefixes such as "(Worker_TP0 pid=7) ERROR ..." allowed.
EXCEPTION_LINE = re.compile(r"(?:^|[\s:)\]])((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)): (.+)$")
# vLLM's messages that only point at a root cause another process logged.
SEE_ABOVE = ("see root cause above", "see stack trace for root cause", "initialization failed", "engine core")
REASON_CHARS = 400


@dataclass(frozen=True)
class Failure:
    """A start-up failure: its kind, what failed (one line), and what to do next."""

    kind: str
    reason: str
    next_step: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "reason": self.reason, "next_step": self.next_step}


@dataclass(frozen=True)
class Cause:
    """One exception as the classifier sees it: its class name (and its bases'), and its message."""

    names: tuple[str, ...]
    message: str

    @property
    def line(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.names[0]}: {first}" if first else self.names[0]

    def text(self) -> str:
        return f"{' '.join(self.names)} {self.message}".lower()


def _missing_module(cause: Cause) -> str | None:
    found = re.search(r"No module named '([\w.]+)'", cause.message)
    return found.group(1).split(".")[0] if found else None


def _package_step(cause: Cause) -> str:
    module = _missing_module(cause)
    if module is not None:
        return f"install {module} in the environment vLLM runs in ({guide.PAIRS}); doctor's versions show the rest"
    return (
        f"the installed releases do not go together ({guide.PAIRS}): reinstall the pair, then rerun doctor; "
        f"releases the plugin serves: {guide.COMPATIBILITY}"
    )


def _is_package(cause: Cause) -> bool:
    if {"ModuleNotFoundError", "PackageNotFoundError"} & set(cause.names):
        return True
    text = cause.text()
    if "ImportError" in cause.names:
        return True
    return "undefined symbol" in text or "no module named" in text


def _is_plugin(cause: Cause) -> bool:
    return bool(PLUGIN_ERRORS & set(cause.names)) or cause.message.lstrip().startswith(PLUGIN)


def _has(*needles: str) -> Callable[[Cause], bool]:
    return lambda cause: any(needle in cause.text() for needle in needles)


@dataclass(frozen=True)
class Rule:
    kind: str
    matches: Callable[[Cause], bool]
    next_step: Callable[[Cause], str]


RULES: tuple[Rule, ...] = (
    Rule("engine_flags", lambda cause: "EngineFlagsError" in cause.names, lambda cause: guide.ENGINE_FLAGS),
    Rule("package", _is_package, _package_step),
    Rule("plugin_refused", _is_plugin, lambda cause: guide.PLUGIN_REFUSED),
    Rule(
        "numa_binding",
        _has("numa node", "vllm_cpu_omp_threads_bind", "cpu id list", "bind threads"),
        lambda cause: guide.NUMA_BINDING,
    ),
    Rule(
        "out_of_memory",
        _has(
            "outofmemoryerror",
            "memoryerror",
            "out of memory",
            "cannot allocate memory",
            "no available memory for the cache blocks",
            "available kv cache memory",
            "insufficient memory",
            "not enough memory",
        ),
        lambda cause: guide.OUT_OF_MEMORY,
    ),
    Rule(
        "collective_init",
        _has(
            "nccl",
            "hccl",
            "gloo",
            "distnetworkerror",
            "diststoreerror",
            "c10d",
            "init_process_group",
            "process group",
            "rendezvous",
        ),
        lambda cause: guide.COLLECTIVE_INIT,
    ),
    Rule(
        "model",
        _has(
            "repo id must",
            "not a valid model identifier",
            "is not a local folder",
            "does not appear to have a file named",
            "config.json",
            "can't load",
            "unrecognized model",
            "model type",
            "model architectures",
            "are not supported for now",
            "safetensors",
            "repositorynotfounderror",
            "gatedrepoerror",
            "localentrynotfounderror",
            "hfvalidationerror",
            "trust_remote_code",
            "no such file or directory",
        ),
        lambda cause: guide.MODEL,
    ),
)


def causes(exc: BaseException) -> list[Cause]:
    """``exc`` and the exceptions it was raised from or during, outermost first (each once)."""
    found: list[Cause] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = tuple(cls.__name__ for cls in type(current).__mro__ if cls not in (object, BaseException))
        found.append(Cause(names or (type(current).__name__,), str(current)))
        current = current.__cause__ or current.__context__
    return found


def logged_causes(log: str) -> list[Cause]:
    """The exception lines a traceback left in ``log`` (the engine processes' output), last first."""
    found = []
    for line in reversed(log.splitlines()):
        match = EXCEPTION_LINE.search(line.strip())
        if match:
            name = match.group(1).rsplit(".", 1)[-1]
            found.append(Cause((name,), match.group(2)))
    return found


def _points_elsewhere(cause: Cause) -> bool:
    return any(phrase in cause.message.lower() for phrase in SEE_ABOVE)


def classify(exc: BaseException, log: str = "") -> Failure:
    """The kind of start-up failure ``exc`` is, what failed, and the next step. The exception's own chain is
    read first; where it only points at another process's traceback, the exception lines ``log`` holds."""
    own = causes(exc)
    candidates = own + (logged_causes(log) if all(_points_elsewhere(cause) for cause in own) else [])
    for rule in RULES:
        for cause in candidates:
            if rule.matches(cause):
                return Failure(rule.kind, _shorten(cause.line), rule.next_step(cause))
    cause = candidates[0]
    return Failure("unknown", _shorten(cause.line), guide.UNKNOWN)


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"
