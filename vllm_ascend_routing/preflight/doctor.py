# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ascend_routing doctor``: what the plugin would do here, a self-check, and always a verdict.

The report (``preflight.findings``): the versions a maintainer needs, the vLLM release and API generation (or why
it is refused), the platform, the kernel backend, every setting (with where its value comes from: the
environment, its default, or doctor, which runs its engine with the plugin on), every patch target checked
against the installed source, one line per class vLLM's own binder names. ``--surface`` stops there (a release
that cannot run here, e.g. a CUDA-only wheel): ``PASS (static: N/N targets verified)``.

Then vLLM with the plugin on the embedded tiny MoE (``preflight.self_check``), or with ``--model PATH`` on the
user's own model and engine flags (``preflight.model_check``). An engine that does not start is classified
(``preflight.startup``: engine flags, NUMA binding, out of memory, collective init, the model, a missing or
mismatched package, the plugin's refusal) with the next step. The engine is shut down before the verdict.

The last line is always ``vllm-ascend-routing doctor: PASS`` or ``... FAIL (<kind>): <reason>. Next: <step>``;
exit status 0 / 1. ``--json`` (``run_json``): the same run, the text on stderr (with vLLM's own logging), stdout
one line, the JSON document ``run`` filled in (``new_report``: the keys tools read).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from vllm_ascend_routing.preflight import findings, guide

VERDICT = "vllm-ascend-routing doctor: "  # prefix of the last line
PLATFORMS = ("cuda", "cpu", "npu")  # runner_mixin.RUNNER_CLASSES (not imported: doctor loads lazily)
# The JSON document's first key and value: a tool finds the document by it among vLLM's log lines, and the
# number changes when a key changes meaning (2: settings' "source" and "why" replaced "default", "engine_env"
# added, the verdict's "kind" and "next_step" added, start-up failures classified instead of "crash").
SCHEMA = "vllm-ascend-routing-doctor/2"
# Columns of the --model report's per-layer tables, explained in the report itself (the oracle's from
# preflight.consistency.Result.table, the rows' from model_check.plausibility).
COLUMNS = (
    ("rows", "(token, layer) rows returned for the layer"),
    ("all-zero", "rows with no expert id: every row of a dense layer (no router), none of a MoE layer's"),
    ("experts routed to", "distinct expert ids seen in the layer"),
    ("agree", "rows whose top-k set equals the re-prefill's for the same token"),
    ("overlap", "mean share of the top-k ids the two passes have in common"),
    ("zero", "all-zero rows of the generation"),
    ("off-1 off0 off+1", "agreement with the re-prefill's previous, same and next token (a shifted row peaks off 0)"),
    ("other", "agreement with another request's row at the same position (high only where prompts share a prefix)"),
    ("near-ties", "differing rows within the dtype's rounding (counted, tolerated up to the budget)"),
    ("verdict", "the fault the layer's wrong rows share (docs/preflight.md explains each)"),
)


def new_report() -> dict[str, Any]:
    """The ``--json`` document before any check ran: every key present, ``None`` where a stage did not run."""
    return {
        "schema": SCHEMA,
        "versions": None,  # versions.collect(): package and commit, vLLM, vllm-ascend, torch(_npu), CANN, driver
        "vllm": None,  # the installed release; None where vLLM is not importable
        "generation": None,  # the API generation detected; None where refused
        "refused": None,  # why the plugin refuses this release
        "platform": None,  # the one the patch targets were checked for (--platform, else vLLM's)
        "kernel_backend": None,
        "settings": [],  # {"name", "value", "source": "default" | "environment" | "doctor", "why", "problem"}
        "engine_env": {},  # vLLM's variables doctor set for its engine ({name: value}; the environment had none)
        "patches": None,  # {"generation", "platform", "verified", "total", "rows": [{"target", "present", "problem"}]}
        "binder": None,  # {"module_level", "rows": [{"name", "known", "handling"}], "unknown": [names]}
        "self_check": None,  # self_check.run's dict
        # {"model", "ok", "detail", "engine_flags", "engine_options", "engine_env", "consistency", "workload"}
        "model_check": None,
        # {"ok", "stage", "kind", "reason", "next_step", "text"}: text is the last line less VERDICT
        "verdict": None,
        "exit_status": None,
    }


def plugin_settings(surface: bool, model: str | None) -> dict[str, tuple[str, str]]:
    """The plugin's settings doctor runs its engine with (``name: (value, why)``): none for ``--surface``."""
    if surface:
        return {}
    forced = {"VLLM_ASCEND_ROUTING": ("1", "its engine runs the plugin")}
    if model is not None:
        forced["VLLM_ASCEND_ROUTING_VALIDATE"] = ("strict", "every returned array checked, a violation fails")
    elif "VLLM_ASCEND_ROUTING_VALIDATE" not in os.environ:
        forced["VLLM_ASCEND_ROUTING_VALIDATE"] = ("1", "every returned array checked too")
    return forced


@contextlib.contextmanager
def environment_set(values: dict[str, str]) -> Iterator[None]:
    """``values`` in the environment while doctor runs; what was there before, afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _print(line: str) -> None:
    print(line, flush=True)


def _end(report: dict[str, Any], print_fn: Callable[[str], Any], stage: str, text: str, **failed: str) -> int:
    """Print the verdict line, record it in ``report``; the exit status (0 only without a failure)."""
    sys.stdout.flush()
    sys.stderr.flush()
    print_fn(VERDICT + text)
    ok = not failed
    report["verdict"] = {
        "ok": ok,
        "stage": stage,
        "kind": failed.get("kind"),
        "reason": failed.get("reason"),
        "next_step": failed.get("next_step"),
        "text": text,
    }
    report["exit_status"] = 0 if ok else 1
    return report["exit_status"]


def _fail(
    report: dict[str, Any], print_fn: Callable[[str], Any], stage: str, kind: str, reason: str, next_step: str
) -> int:
    text = f"FAIL ({kind}): {reason.rstrip('. ')}. Next: {next_step}"
    return _end(report, print_fn, stage, text, kind=kind, reason=reason, next_step=next_step)


def _failed_start(
    report: dict[str, Any], print_fn: Callable[[str], Any], stage: str, exc: BaseException, log: str = ""
) -> int:
    """A stage that raised: the traceback on stderr (for a bug report), then its classification and verdict."""
    from vllm_ascend_routing.preflight import startup

    failure = startup.classify(exc, log)
    if failure.kind != "engine_flags":  # vLLM's parser said why already; any other traceback is for a bug report
        traceback.print_exception(exc, file=sys.stderr)
    print_fn(f"  {stage.replace('_', ' ')} failed ({failure.kind}): {failure.reason}")
    print_fn(f"  next step: {failure.next_step}")
    return _fail(report, print_fn, stage, failure.kind, failure.reason, failure.next_step)


def _header(report: dict[str, Any], print_fn: Callable[[str], Any]) -> None:
    plugin, *others = findings.version_lines(report["versions"])
    found = findings.environment_lines(report)
    after_vllm = 1 if report["vllm"] is not None else 0  # the other releases next to vLLM's
    lines = [plugin, *found[:after_vllm], *others, *found[after_vllm:]]
    width = max(len(label) for label, _ in lines)
    print_fn("vllm-ascend-routing doctor")
    for label, value in lines:
        print_fn(f"  {label:<{width}}  {value}")


def _environment_failure(report: dict[str, Any], problem: str) -> tuple[str, str, str]:
    """The kind, reason and next step of a problem ``findings.environment`` found."""
    if any(setting["problem"] == problem for setting in report["settings"]):
        return "setting", problem, guide.SETTING
    if report["vllm"] is not None:
        return "plugin_refused", problem, guide.PLUGIN_REFUSED
    installed = (report["versions"] or {}).get("vllm")
    if installed is None:
        return "package", problem, f"install vLLM ({guide.PAIRS})"
    try:  # installed, yet not importable: why
        import vllm  # noqa: F401
    except Exception as exc:
        from vllm_ascend_routing.preflight import startup

        failure = startup.classify(exc)
        return failure.kind, f"vLLM {installed} is installed but does not import: {failure.reason}", failure.next_step
    return "package", problem, f"install vLLM ({guide.PAIRS})"


def run(
    num_prompts: int = 4,
    mode: str = "compiled",
    print_fn: Callable[[str], Any] = _print,
    surface: bool = False,
    platform: str | None = None,
    dtype: str = "auto",
    model: str | None = None,
    model_options: dict[str, Any] | None = None,
    report: dict[str, Any] | None = None,
) -> int:
    """The report, then the self-check in ``dtype`` (or, with ``model``, ``model_check`` on the user's model with
    ``model_options``: tensor_parallel_size, max_tokens, trust_remote_code, engine_flags); 0 on PASS, 1 on FAIL.
    ``report`` (a ``new_report()``), when given, is filled with what was printed, as data. Whatever fails, the
    last line printed is the verdict."""
    from vllm_ascend_routing import versions

    report = new_report() if report is None else report
    report["versions"] = versions.collect()  # package metadata only: works where nothing else imports
    forced = plugin_settings(surface, model)
    with environment_set({name: value for name, (value, _) in forced.items()}):
        try:
            problem = findings.environment(report, {name: why for name, (_, why) in forced.items()})
        except Exception as exc:  # e.g. torch missing: the kernel backend's import
            _header(report, print_fn)
            return _failed_start(report, print_fn, "environment", exc)
        report["versions"] = versions.collect()  # again: torch's CUDA build, once vLLM imported torch
        _header(report, print_fn)
        if problem is not None:
            return _fail(report, print_fn, "environment", *_environment_failure(report, problem))
        try:
            return _checks(report, print_fn, num_prompts, mode, surface, platform, dtype, model, model_options)
        except Exception as exc:
            return _failed_start(report, print_fn, "checks", exc)


def _checks(
    report: dict[str, Any],
    print_fn: Callable[[str], Any],
    num_prompts: int,
    mode: str,
    surface: bool,
    platform: str | None,
    dtype: str,
    model: str | None,
    model_options: dict[str, Any] | None,
) -> int:
    platform = report["platform"] = platform or findings.platform()
    if platform not in PLATFORMS:
        reason = f"vLLM reports platform {platform!r}, which has no patch targets here"
        return _fail(report, print_fn, "platform", "platform", reason, guide.PLATFORM)
    patches = report["patches"] = findings.targets(platform)
    for line in findings.target_lines(patches):
        print_fn(f"  {line}")
    missing = findings.first_problem(patches)
    if missing is not None:
        return _fail(report, print_fn, "patches", "not_covered", missing, guide.NOT_COVERED)
    binder = report["binder"] = findings.binder_coverage()
    coverage, uncovered = findings.coverage_lines(binder)
    for line in coverage:
        print_fn(f"  {line}")
    if uncovered is not None:
        return _fail(report, print_fn, "binder", "not_covered", uncovered, guide.NOT_COVERED)
    if surface:
        verified = f"static: {patches['verified']}/{patches['total']} targets verified"
        return _end(report, print_fn, "surface", f"PASS ({verified})")
    if model is not None:
        return _model_check(report, print_fn, model, num_prompts, dtype, mode, model_options or {})
    return _self_check(report, print_fn, num_prompts, mode, dtype)


def _engine(
    report: dict[str, Any], print_fn: Callable[[str], Any], stage: str, start: Callable[[], Any]
) -> tuple[Any, int | None]:
    """``start()`` with the output of this process and its children kept (``preflight.logtail``): its result, or,
    where it raised, the start-up failure's verdict (the exit status)."""
    from vllm_ascend_routing.preflight import logtail

    tail = logtail.Tail()
    try:
        with tail:
            return start(), None
    except Exception as exc:
        return None, _failed_start(report, print_fn, stage, exc, tail.text())


def _self_check(report: dict[str, Any], print_fn: Callable[[str], Any], num_prompts: int, mode: str, dtype: str) -> int:
    from vllm_ascend_routing.preflight import offline, self_check

    chosen = self_check.resolve_dtype(dtype)
    print_fn(
        f"self-check: tiny Qwen3-MoE ({self_check.model_for(chosen)}), {num_prompts} prompts, {mode}, {chosen}, "
        "against float32 transformers ..."
    )
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    engine_env = report["engine_env"] = {name: value for name, value in wanted.items() if name not in os.environ}
    print_fn(f"  {offline.engine_env_line(engine_env)}")
    with environment_set(engine_env):
        checked, failed = _engine(report, print_fn, "engine_start", lambda: self_check.run(num_prompts, mode, chosen))
    if failed is not None:
        return failed
    report["self_check"] = checked
    _device_name(report)
    print_fn(f"  {checked['detail']}")
    if checked["ok"]:
        return _end(report, print_fn, "self_check", "PASS")
    return _fail(report, print_fn, "self_check", "routing", checked["detail"], guide.ROUTING)


def _model_check(
    report: dict[str, Any],
    print_fn: Callable[[str], Any],
    model: str,
    num_prompts: int,
    dtype: str,
    mode: str,
    options: dict[str, Any],
) -> int:
    from vllm_ascend_routing.preflight import model_check, offline

    if model.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(model)):
        return _fail(report, print_fn, "engine_start", "model", f"--model {model}: no such path here", guide.MODEL)

    def start() -> tuple[bool, str, dict[str, Any]]:
        return model_check.run(model, print_fn, num_prompts, dtype=dtype, mode=mode, **options)

    before = {name: os.environ.get(name) for name in offline.ENGINE_ENV}
    checked, failed = _engine(report, print_fn, "engine_start", start)
    # What model_check set for the engine, also where it did not start (the report is printed after this).
    report["engine_env"] = {
        name: os.environ[name] for name, was in before.items() if was is None and name in os.environ
    }
    if failed is not None:
        return failed
    ok, detail, extra = checked
    report["model_check"] = {"model": model, "ok": ok, "detail": detail, **extra}
    _device_name(report)
    print_fn("  columns of the tables above:")
    for names, meaning in COLUMNS:
        print_fn(f"    {names}: {meaning}")
    print_fn(f"  {detail}")
    if ok:
        return _end(report, print_fn, "model_check", "PASS")
    return _fail(report, print_fn, "model_check", "routing", detail, guide.ROUTING)


def _device_name(report: dict[str, Any]) -> None:
    """The device's name through torch, asked once the engine ran (asking before could initialise the device in
    this process before vLLM starts its workers)."""
    from vllm_ascend_routing import versions

    if report["versions"] is not None and report["versions"].get("device_name") is None:
        report["versions"]["device_name"] = versions.device_name()


def run_json(**options: Any) -> int:
    """``run(**options)`` with everything it and vLLM print (its workers included) sent to stderr, then the
    filled report as one JSON line on stdout: stdout holds nothing else for a tool to skip."""
    sys.stdout.flush()
    stdout = os.dup(1)
    # The file descriptor, for vLLM's C++ code and its worker processes, which inherit it; sys.stdout too, for
    # Python code holding another stream as sys.stdout (a test's capture).
    os.dup2(2, 1)
    report = new_report()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            status = run(report=report, **options)
    except BaseException as exc:  # interrupted (Ctrl-C, a signal): still a verdict (exit status 1)
        reason = f"{type(exc).__name__}: {exc}"
        report["verdict"] = {
            "ok": False,
            "stage": "interrupted",
            "kind": "interrupted",
            "reason": reason,
            "next_step": None,
            "text": None,
        }
        report["exit_status"] = 1
        raise
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
        print(json.dumps(report), flush=True)
    return status
