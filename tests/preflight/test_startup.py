# SPDX-License-Identifier: Apache-2.0
"""Every pre-flight ends in a verdict: each kind of start-up failure, planted where it arises (the engine's start,
inside ``model_check.run``), ends in ``FAIL (<kind>): <reason>. Next: <step>``, in the text and in ``--json``.

Where the failure can be raised by the real code here (torch's allocator and gloo, transformers' config loader,
Python's import system, the plugin's own start-up check), it is; vLLM's own failures (no vLLM in the unit
environment) are raised with vLLM's message, from this process or from a child process whose traceback only
the log holds ("see root cause above"). The last tests run the real ones in processes of their own: no torch (a
bare virtual environment), a model that is not there, vLLM's NUMA refusal.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness.vllm_cache import fresh_cache_root
from tests.preflight.test_doctor import fake_environment, fake_targets
from vllm_ascend_routing import __version__
from vllm_ascend_routing.preflight import doctor, findings, guide, model_check, startup

NUMA_MESSAGE = (
    "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers. Allowed NUMA nodes are [0]. Please try to "
    "bind threads manually or decrease DP/TP/PP."
)


def vllm_numa_assertion() -> None:
    """vLLM's CPU build (``OMPProcessManager._get_autobind_cpu_ids``) with TP 2 on one NUMA node."""
    allowed_numa_nodes, local_world_size = [0], 2
    assert len(allowed_numa_nodes) >= local_world_size, NUMA_MESSAGE


def numa_in_an_engine_core_process() -> None:
    """The same assertion in a child process (vLLM's engine core under data parallel): the parent only hears
    "see root cause above"; the root cause is in the output the child inherited."""
    code = (
        "import sys, traceback\n"
        "try:\n"
        f"    assert False, {NUMA_MESSAGE!r}\n"
        "except AssertionError:\n"
        "    for line in traceback.format_exc().splitlines():\n"
        "        print('(EngineCore_DP0 pid=4242) ERROR ' + line, file=sys.stderr)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")


def torch_allocation() -> None:
    import torch

    torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator: "Cannot allocate memory"


def vllm_kv_cache_too_small() -> None:
    raise ValueError(  # vllm/v1/core/kv_cache_utils.py, _check_enough_kv_cache_memory
        "To serve at least one request with the model's max seq len (1024), (0.06 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (0.01 GiB). Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine."
    )


def gloo_unreachable() -> None:
    import torch.distributed as dist

    dist.init_process_group(  # rank 1 of 2, its master on a port nothing listens on
        "gloo", init_method="tcp://127.0.0.1:9", rank=1, world_size=2, timeout=datetime.timedelta(seconds=1)
    )


def nccl_error() -> None:
    import torch.distributed as dist

    raise dist.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3"
    )


def config_missing(tmp_path: Path) -> Callable[[], None]:
    def load() -> None:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(tmp_path))  # a directory without config.json

    return load


def module_missing() -> None:
    import vllm_ascend_routing_no_such_dependency  # noqa: F401


def releases_mismatched() -> None:
    from json import no_such_name  # type: ignore[attr-defined]  # noqa: F401


def workers_unreachable() -> None:
    from vllm_ascend_routing import peers

    class Executor:
        def collective_rpc(self, method: Any) -> list[Any]:
            raise TimeoutError("RPC call to collective_rpc timed out")

    peers.verify_workers(Executor())  # the plugin's start-up check of its workers refuses


def something_new() -> None:
    raise RuntimeError("a failure nobody has seen yet")


def run_doctor(monkeypatch: pytest.MonkeyPatch, start: Callable[[], None]) -> tuple[list[str], dict[str, Any]]:
    """``doctor --model /m`` (a directory) whose engine start raises what ``start`` raises."""

    def model_check_run(*args: Any, **kwargs: Any) -> Any:
        start()
        pytest.fail("the planted failure did not raise")

    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(1))
    monkeypatch.setattr(findings, "binder_coverage", lambda: {"module_level": False, "rows": [], "unknown": []})
    monkeypatch.setattr(model_check, "run", model_check_run)
    printed: list[str] = []
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, platform="cpu", model="/", report=report) == 1
    return printed, report


CASES = [
    ("numa_binding", vllm_numa_assertion, "AssertionError: Not enough allowed NUMA nodes", guide.NUMA_BINDING),
    ("numa_binding", numa_in_an_engine_core_process, "AssertionError: Not enough allowed NUMA", guide.NUMA_BINDING),
    ("out_of_memory", torch_allocation, "RuntimeError: [enforce fail", guide.OUT_OF_MEMORY),
    ("out_of_memory", vllm_kv_cache_too_small, "ValueError: To serve at least one request", guide.OUT_OF_MEMORY),
    ("collective_init", gloo_unreachable, "DistNetworkError: ", guide.COLLECTIVE_INIT),
    ("collective_init", nccl_error, "DistBackendError: NCCL error in", guide.COLLECTIVE_INIT),
    ("model", None, "config.json", guide.MODEL),  # transformers' own words: OSError or ValueError by release
    ("package", module_missing, "ModuleNotFoundError: No module named 'vllm_ascend_routing_no_such_dependency'", None),
    ("package", releases_mismatched, "ImportError: cannot import name 'no_such_name' from 'json'", None),
    ("plugin_refused", workers_unreachable, "WorkerMismatchError: vllm-ascend-routing: the engine could not", None),
    ("unknown", something_new, "RuntimeError: a failure nobody has seen yet", guide.UNKNOWN),
]


@pytest.mark.parametrize(
    ("kind", "start", "reason", "next_step"),
    CASES,
    ids=[f"{c[0]}-{c[1].__name__ if c[1] else 'config'}" for c in CASES],
)
def test_each_start_up_failure_ends_in_its_verdict(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kind: str,
    start: Callable[[], None] | None,
    reason: str,
    next_step: str | None,
) -> None:
    printed, report = run_doctor(monkeypatch, start or config_missing(tmp_path))
    verdict = report["verdict"]
    print(printed[-1])
    assert (verdict["ok"], verdict["stage"], verdict["kind"]) == (False, "engine_start", kind), verdict
    assert reason in verdict["reason"], verdict["reason"]
    if next_step is not None:
        assert verdict["next_step"] == next_step
    assert printed[-1] == doctor.VERDICT + verdict["text"]
    assert verdict["text"] == f"FAIL ({kind}): {verdict['reason'].rstrip('. ')}. Next: {verdict['next_step']}"
    assert printed[-2] == f"  next step: {verdict['next_step']}"  # the step also on a line of its own
    assert report["exit_status"] == 1 and report["versions"]["vllm_ascend_routing"]


def test_the_next_step_names_what_is_missing() -> None:
    try:
        module_missing()
    except ImportError as exc:
        missing = startup.classify(exc)
    try:
        releases_mismatched()
    except ImportError as exc:
        mismatched = startup.classify(exc)
    assert missing.next_step.startswith("install vllm_ascend_routing_no_such_dependency in the environment")
    assert mismatched.next_step.startswith("the installed releases do not go together")


def test_the_log_is_read_only_where_the_exception_points_there() -> None:
    """A failure with a message of its own is classified by it, never by an older traceback in the log."""
    log = f"(Worker pid=1) AssertionError: {NUMA_MESSAGE}\n"
    assert startup.classify(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), log).kind == "out_of_memory"
    pointing = RuntimeError("WorkerProc initialization failed due to an exception in a background process. See stack")
    assert startup.classify(pointing, log).kind == "numa_binding"
    assert startup.classify(pointing, "").kind == "unknown"


def test_a_chained_cause_is_found() -> None:
    """vLLM wraps a worker's error (``raise RuntimeError(...) from exc``): the cause decides."""
    try:
        try:
            raise MemoryError("Cannot allocate memory")
        except MemoryError as exc:
            raise RuntimeError("Engine core initialization failed.") from exc
    except RuntimeError as wrapped:
        assert startup.classify(wrapped).kind == "out_of_memory"


def test_a_model_path_that_does_not_exist_fails_before_any_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(1))
    monkeypatch.setattr(findings, "binder_coverage", lambda: {"module_level": False, "rows": [], "unknown": []})
    monkeypatch.setattr(model_check, "run", lambda *a, **k: pytest.fail("no engine for a path that is not there"))
    printed: list[str] = []
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, platform="cpu", model="/nonexistent", report=report) == 1
    assert printed[-1] == doctor.VERDICT + f"FAIL (model): --model /nonexistent: no such path here. Next: {guide.MODEL}"


def test_an_environment_that_cannot_load_the_kernel_backend_still_ends_in_a_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``findings.environment`` raising (torch missing: the kernel backend's import) prints the report so far, the
    classification and the verdict; ``versions`` is filled from package metadata alone."""

    def environment(report: dict[str, Any], forced: dict[str, str] | None = None) -> None:
        report.update(vllm=None, platform="(vLLM not importable)")
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(findings, "environment", environment)
    printed: list[str] = []
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, report=report) == 1
    assert printed[0] == "vllm-ascend-routing doctor" and printed[1].split()[0] == "vllm-ascend-routing"
    assert report["verdict"]["kind"] == "package" and report["verdict"]["stage"] == "environment"
    assert printed[-1].startswith(doctor.VERDICT + "FAIL (package): ModuleNotFoundError: No module named 'torch'")
    assert report["versions"]["vllm_ascend_routing"]


# ---- in processes of their own: the failures as a user meets them ----


def doctor_process(
    python: str, *args: str, cwd: Path, env: dict[str, str] | None = None, text_too: bool = True
) -> tuple[int, str, Any]:
    """``python -m vllm_ascend_routing doctor --json ARGS`` (and, ``text_too``, without ``--json``): the exit status,
    the last line of the text (stdout; with ``--json`` stderr's), the JSON document."""
    from tests.harness import pythonpath

    environment = pythonpath({**os.environ, **(env or {})})  # this checkout, in any interpreter
    command = [python, "-m", "vllm_ascend_routing", "doctor"]
    as_json = subprocess.run(  # --json before the engine flags: what follows "--" is vLLM's
        [*command, "--json", *args], capture_output=True, text=True, env=environment, cwd=cwd, timeout=600
    )
    last = as_json.stderr.strip().splitlines()[-1]  # --json: the text on stderr, its verdict last there too
    if text_too:
        text = subprocess.run([*command, *args], capture_output=True, text=True, env=environment, cwd=cwd, timeout=600)
        assert text.returncode == as_json.returncode, (text.stderr[-2000:], as_json.stderr[-2000:])
        assert text.stdout.strip().splitlines()[-1] == last, (text.stdout[-2000:], as_json.stderr[-2000:])
    return as_json.returncode, last, json.loads(as_json.stdout)


def test_without_torch_doctor_ends_in_a_verdict_with_its_versions(tmp_path: Path) -> None:
    """An interpreter with no torch (and no vLLM): a bare virtual environment of this Python."""
    # -I: the standard library's venv (a test that puts scripts/ on sys.path would shadow it with scripts/venv.py)
    subprocess.run([sys.executable, "-I", "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    status, last, report = doctor_process(str(tmp_path / "bare" / "bin" / "python"), cwd=tmp_path)
    assert status == 1 and last.startswith(
        doctor.VERDICT + "FAIL (package): ModuleNotFoundError: No module named 'torch'"
    )
    assert report["schema"] == doctor.SCHEMA and report["verdict"]["kind"] == "package"
    assert report["verdict"]["next_step"].startswith("install torch in the environment vLLM runs in")
    assert report["versions"]["vllm_ascend_routing"] == __version__ and report["versions"]["torch"] is None
    assert doctor.VERDICT + report["verdict"]["text"] == last


def on_the_newest_generation() -> None:
    from tests.preflight.test_doctor import on_the_newest_generation_only

    on_the_newest_generation_only("start-up failures")


@pytest.mark.vllm
@pytest.mark.e2e
def test_a_model_that_is_not_there_ends_in_a_model_verdict(tmp_path: Path) -> None:
    """``--model /nonexistent``: doctor's own check, before any engine; a hub name that cannot be had offline:
    vLLM's (transformers') error, classified."""
    on_the_newest_generation()
    # --json alone: text and JSON agree is the bare-venv test's case (an engine-free start costs ~17 s of imports)
    status, last, report = doctor_process(sys.executable, "--model", "/nonexistent", cwd=tmp_path, text_too=False)
    assert status == 1 and last.startswith(doctor.VERDICT + "FAIL (model): --model /nonexistent: no such path here")
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    status, last, report = doctor_process(
        sys.executable, "--model", "no-such-org/no-such-moe", cwd=tmp_path, env=offline, text_too=False
    )
    assert status == 1 and last.startswith(doctor.VERDICT + "FAIL (model): "), last
    assert report["verdict"]["kind"] == "model" and report["verdict"]["next_step"] == guide.MODEL
    assert report["versions"]["vllm"] and report["versions"]["vllm_ascend_routing"] == __version__
    print(last)


def numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


@pytest.mark.vllm
@pytest.mark.e2e
def test_vllms_numa_refusal_ends_in_a_numa_verdict(tmp_path: Path) -> None:
    """TP 2 on the CPU build of a one-NUMA-node machine, with vLLM's automatic binding asked for explicitly
    (doctor binds the ranks itself where the variable is unset): vLLM's assertion, classified."""
    from vllm_ascend_routing.preflight import models

    on_the_newest_generation()
    if numa_nodes() >= 2:
        pytest.skip(f"{numa_nodes()} NUMA nodes here: vLLM binds TP 2 without complaint")
    model = models.build_tiny_moe("qwen3_moe", tmp_path / "model")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CACHE_ROOT": str(fresh_cache_root(tmp_path / "cache"))}
    status, last, report = doctor_process(
        sys.executable, "--model", str(model.path), "--", "--tensor-parallel-size", "2", cwd=tmp_path, env=env
    )
    assert status == 1 and last.startswith(doctor.VERDICT + "FAIL (numa_binding): AssertionError: Not enough allowed")
    assert report["verdict"]["next_step"] == guide.NUMA_BINDING and report["verdict"]["stage"] == "engine_start"
    print(last)


def test_the_engine_env_doctor_set_is_reported_when_the_engine_did_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing.preflight import offline

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    def start() -> None:  # model_check sets the engine's variables, then vLLM refuses
        offline.set_engine_env({"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        vllm_numa_assertion()

    try:
        _, report = run_doctor(monkeypatch, start)
        assert (
            report["engine_env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} and report["verdict"]["kind"] == "numa_binding"
        )
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
