# SPDX-License-Identifier: Apache-2.0
"""The engine's start-up check of its workers (``peers``): what each worker reports, every way a worker can
fail to run the plugin and the message naming it, the engine-core hook, the worker that was never asked, and
the Ray job ``runtime_env`` a driver adopts. End to end under Ray and the external launcher:
tests/e2e/test_distributed.py."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest

import vllm_ascend_routing
from vllm_ascend_routing import envs, peers, runner_state

ENGINE = {"VLLM_ASCEND_ROUTING": "True", "VLLM_ASCEND_ROUTING_VLLM_API": "auto", "VLLM_ASCEND_ROUTING_VALIDATE": "off"}
VERSION = vllm_ascend_routing.__version__


def state(**changes: Any) -> peers.WorkerState:
    fields: dict[str, Any] = {
        "rank": 1,
        "host": "node-b",
        "pid": 4242,
        "ray_node": "abc123",
        "version": VERSION,
        "active": True,
        "raw_switch": "1",
        "settings": dict(ENGINE),
        "vllm_plugins": None,
        "bound_layers": 3,
    }
    fields.update(changes)
    return peers.WorkerState(**fields)


def test_a_worker_running_the_plugin_as_the_engine_does_agrees() -> None:
    assert peers.mismatch(state(), ENGINE, VERSION) is None


def test_the_message_names_the_worker() -> None:
    text = peers.mismatch(state(active=False, raw_switch="0"), ENGINE, VERSION)
    assert text is not None
    assert text.startswith("worker rank 1 (pid 4242 on host node-b, Ray node abc123): the plugin is off there")


def test_a_node_environment_set_to_zero_is_named_with_ray_precedence() -> None:
    text = peers.mismatch(state(active=False, raw_switch="0"), ENGINE, VERSION) or ""
    assert "VLLM_ASCEND_ROUTING='0' in its environment" in text
    assert "a value on the Ray node wins over the driver's" in text
    assert "runtime_env" in text


def test_a_name_on_the_non_carry_over_list_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = (frozenset({"VLLM_ASCEND_ROUTING"}), "/cfg/ray_non_carry_over_env_vars.json")
    monkeypatch.setattr(peers, "ray_non_carry_over", lambda: listed)
    text = peers.mismatch(state(active=False, raw_switch=None), ENGINE, VERSION) or ""
    assert "not carried to Ray workers (/cfg/ray_non_carry_over_env_vars.json, non-carry-over list)" in text


def test_an_unset_variable_off_the_list_says_vllm_did_not_carry_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "ray_non_carry_over", lambda: (frozenset(), "x.json"))
    text = peers.mismatch(state(active=False, raw_switch=None), ENGINE, VERSION) or ""
    assert "is unset in its environment (vLLM did not carry it" in text


def test_vllm_plugins_leaving_the_plugin_out_is_named() -> None:
    text = peers.mismatch(state(active=False, vllm_plugins="lora_filesystem_resolver"), ENGINE, VERSION) or ""
    assert "VLLM_PLUGINS='lora_filesystem_resolver' there does not name 'vllm_ascend_routing'" in text


def test_another_version_is_refused() -> None:
    text = peers.mismatch(state(version="0.0.9"), ENGINE, VERSION) or ""
    assert f"runs vllm-ascend-routing 0.0.9, the engine {VERSION}" in text


def test_validation_settings_must_agree() -> None:
    worker = state(settings={**ENGINE, "VLLM_ASCEND_ROUTING_VALIDATE": "strict"})
    text = peers.mismatch(worker, ENGINE, VERSION) or ""
    assert "VLLM_ASCEND_ROUTING_VALIDATE='strict' there, 'off' here" in text


def test_a_worker_that_bound_no_layer_is_refused() -> None:
    for bound in (None, 0):
        assert "bound no MoE layer" in (peers.mismatch(state(bound_layers=bound), ENGINE, VERSION) or "")


class Worker:
    """What vLLM's collective_rpc hands a function: the worker (wrapper), with its model runner."""

    def __init__(self, rank: int, runner: Any) -> None:
        self.rank = rank
        self.model_runner = runner


class Runner:
    model = object()


def bound_runner(layers: tuple[int, ...]) -> Runner:
    runner = Runner()
    prepared = types.SimpleNamespace(num_bound_layers=len(layers))
    runner_state.set_prepared(runner, prepared)  # type: ignore[arg-type]
    return runner


class Executor:
    """vLLM's executor contract: ``collective_rpc(function)`` returns the function's result per worker."""

    def __init__(self, workers: list[Worker], reply_changes: dict[int, dict[str, Any]] | None = None) -> None:
        self.workers = workers
        self.reply_changes = reply_changes or {}
        self.calls = 0

    def collective_rpc(self, method: Any) -> list[Any]:
        self.calls += 1
        replies = [method(worker) for worker in self.workers]
        for rank, changes in self.reply_changes.items():
            replies[rank].update(changes)
        return replies


@pytest.fixture
def plugin_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "1")
    monkeypatch.setattr(vllm_ascend_routing, "_registered", True)


@pytest.mark.usefixtures("plugin_on")
def test_every_worker_agreeing_passes_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    executor = Executor([Worker(0, bound_runner((0, 1, 2))), Worker(1, bound_runner((0, 1, 2)))])
    with caplog.at_level(logging.INFO, logger="vllm.plugins.vllm_ascend_routing"):
        workers = peers.verify_workers(executor)
    assert [worker.rank for worker in workers] == [0, 1]
    assert all(worker.bound_layers == 3 and worker.active for worker in workers)
    assert "all 2 worker(s) run the plugin (3 MoE layers bound each" in caplog.text
    assert "checked in" in caplog.text


@pytest.mark.usefixtures("plugin_on")
def test_one_worker_off_refuses_start_up_naming_it() -> None:
    executor = Executor(
        [Worker(0, bound_runner((0, 1))), Worker(1, Runner())], {1: {"active": False, "raw_switch": "0"}}
    )
    with pytest.raises(peers.WorkerMismatchError) as raised:
        peers.verify_workers(executor)
    text = str(raised.value)
    assert "1 of 2 worker(s) of this engine do not run the plugin" in text
    assert "worker rank 1 (pid" in text and "VLLM_ASCEND_ROUTING='0' in its environment" in text
    assert "worker rank 0" not in text


@pytest.mark.usefixtures("plugin_on")
def test_a_worker_that_cannot_run_the_question_refuses_start_up() -> None:
    class Broken:
        def collective_rpc(self, method: Any) -> list[Any]:
            raise ModuleNotFoundError("No module named 'vllm_ascend_routing'")

    with pytest.raises(peers.WorkerMismatchError, match="Install vllm-ascend-routing .* on every node"):
        peers.verify_workers(Broken())


def test_the_question_marks_the_worker_process_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "_checked_by_engine", False)
    reply = peers.worker_state(Worker(3, bound_runner((1,))))
    assert peers._checked_by_engine is True
    assert reply["rank"] == 3 and reply["bound_layers"] == 1 and reply["version"] == VERSION
    assert set(reply["settings"]) == set(peers.AGREED)
    assert peers.worker_state(None)["bound_layers"] is None  # no runner: nothing bound


def test_the_engine_hook_asks_only_when_routed_experts_are_requested(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    monkeypatch.setattr(peers, "verify_workers", asked.append)
    initialized: list[Any] = []
    hooked = peers._checking_workers(
        lambda self, config: initialized.append(config) or "kv-config", lambda config: config.requested
    )
    core = types.SimpleNamespace(model_executor="executor")
    for requested in (True, False):
        assert hooked(core, types.SimpleNamespace(requested=requested)) == "kv-config"
    assert asked == ["executor"]  # once: only the engine that requested routed experts
    assert len(initialized) == 2


def test_each_generation_says_where_routed_experts_are_requested() -> None:
    from vllm_ascend_routing.compat.aux_output import adapter as aux_output
    from vllm_ascend_routing.compat.runner_output import adapter as runner_output
    from vllm_ascend_routing.compat.shm import adapter as shm

    in_model_config = types.SimpleNamespace(model_config=types.SimpleNamespace(enable_return_routed_experts=True))
    in_aux_config = types.SimpleNamespace(aux_output_config=types.SimpleNamespace(enable_return_routed_experts=True))
    assert shm.ShmAdapter().routed_experts_requested(in_model_config)
    assert runner_output.RunnerOutputAdapter().routed_experts_requested(in_model_config)
    assert aux_output.AuxOutputAdapter().routed_experts_requested(in_aux_config)  # vLLM 0.31+ moved the flag


def test_the_hook_point_is_in_the_manifest() -> None:
    from vllm_ascend_routing import manifest
    from vllm_ascend_routing.releases import Generation

    for generation in (Generation.SHM, Generation.RUNNER_OUTPUT, Generation.AUX_OUTPUT):
        targets = [patch.target for patch in manifest.patches_for(generation, "cpu")]
        assert peers.ENGINE_KV_CACHE_INIT.target in targets


class TestWorkerNeverAsked:
    @pytest.fixture(autouse=True)
    def never_asked(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(peers, "_checked_by_engine", False)
        monkeypatch.setattr(peers, "_noted_unchecked", False)

    def test_rows_read_by_the_front_end_refuse(self) -> None:
        with pytest.raises(peers.WorkerMismatchError, match="front-end reads the rows from the plugin's store"):
            peers.worker_ready(bound_runner((0,)), rows_read_in_front_end=True)

    def test_rows_in_vllms_transport_warn_once(self, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.WARNING, logger="vllm.plugins.vllm_ascend_routing"):
            peers.worker_ready(bound_runner((0,)), rows_read_in_front_end=False)
            peers.worker_ready(bound_runner((0,)), rows_read_in_front_end=False)
        notes = [record for record in caplog.records if "the engine that drives it does not" in record.message]
        assert len(notes) == 1
        assert "validation mode's array checks do not run" in notes[0].message

    def test_a_runner_without_capture_says_nothing(self, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.DEBUG, logger="vllm.plugins.vllm_ascend_routing"):
            peers.worker_ready(Runner(), rows_read_in_front_end=True)  # capture off in this engine: nothing to say
            peers.worker_ready(Runner(), rows_read_in_front_end=False)
        assert [record.getMessage() for record in caplog.records] == []

    def test_an_asked_worker_says_nothing(self, caplog: pytest.LogCaptureFixture) -> None:
        peers.worker_state(None)
        with caplog.at_level(logging.DEBUG, logger="vllm.plugins.vllm_ascend_routing"):
            peers.worker_ready(bound_runner((0,)), rows_read_in_front_end=True)  # no refusal
            peers.worker_ready(bound_runner((0,)), rows_read_in_front_end=False)  # no warning
        assert [record.getMessage() for record in caplog.records] == []


def test_a_folder_named_ray_on_the_path_is_no_ray_node(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory holding a folder ``ray`` (no Ray installed there) imports as a namespace package without
    Ray's API: the worker's state says "no Ray node" instead of failing the engine's start-up question."""
    import importlib

    (tmp_path / "ray").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_ASCEND_ROUTING", raising=False)
    installed = sys.modules.pop("ray", None)
    try:
        importlib.invalidate_caches()
        namespace = importlib.import_module("ray")
        assert not hasattr(namespace, "is_initialized")  # really the stray folder, not an installed Ray
        assert peers.worker_state(None)["ray_node"] is None
        assert envs.adopt_ray_job_variables() == []
    finally:
        sys.modules.pop("ray", None)
        if installed is not None:
            sys.modules["ray"] = installed


class FakeRay(types.ModuleType):
    def __init__(self, env_vars: dict[str, str] | None, initialized: bool = True) -> None:
        super().__init__("ray")
        self.env_vars = env_vars
        self.initialized = initialized

    def is_initialized(self) -> bool:
        return self.initialized

    def get_runtime_context(self) -> Any:
        runtime_env = {} if self.env_vars is None else {"env_vars": self.env_vars}
        return types.SimpleNamespace(runtime_env=runtime_env)


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_ray_driver_adopts_its_jobs_runtime_env(clean_environment: pytest.MonkeyPatch) -> None:
    job = {"VLLM_ASCEND_ROUTING": "1", "VLLM_ASCEND_ROUTING_VALIDATE": "strict", "OTHER": "x"}
    clean_environment.setitem(sys.modules, "ray", FakeRay(job))
    assert envs.adopt_ray_job_variables() == ["VLLM_ASCEND_ROUTING", "VLLM_ASCEND_ROUTING_VALIDATE"]
    assert envs.VLLM_ASCEND_ROUTING is True and envs.VLLM_ASCEND_ROUTING_VALIDATE == "strict"
    import os

    assert "OTHER" not in os.environ  # only the plugin's own variables


def test_the_drivers_own_variable_wins(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("VLLM_ASCEND_ROUTING", "0")
    clean_environment.setitem(sys.modules, "ray", FakeRay({"VLLM_ASCEND_ROUTING": "1"}))
    assert envs.adopt_ray_job_variables() == []
    assert envs.VLLM_ASCEND_ROUTING is False


@pytest.mark.parametrize("ray", [None, FakeRay({"VLLM_ASCEND_ROUTING": "1"}, initialized=False), FakeRay(None)])
def test_nothing_is_adopted_without_a_connected_ray_job(clean_environment: pytest.MonkeyPatch, ray: Any) -> None:
    if ray is None:
        clean_environment.delitem(sys.modules, "ray", raising=False)
    else:
        clean_environment.setitem(sys.modules, "ray", ray)
    assert envs.adopt_ray_job_variables() == []
    assert envs.VLLM_ASCEND_ROUTING is False
