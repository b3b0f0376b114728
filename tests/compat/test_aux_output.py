# SPDX-License-Identifier: Apache-2.0
"""The aux-output generation's driving of vLLM's AuxOutput connector from a V1-shaped runner (no vLLM
needed): hook order, the batch fields the connector reads, sampled counts, and what is left alone.
The real connector (vLLM 0.31/0.32) is exercised end to end by the e2e suite."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_ascend_routing import runner_mixin, runner_state
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.compat import _lift
from vllm_ascend_routing.compat._lift import Site
from vllm_ascend_routing.compat.aux_output import adapter as aux_output
from vllm_ascend_routing.compat.aux_output import config_check
from vllm_ascend_routing.compat.aux_output.adapter import AuxOutputAdapter
from vllm_ascend_routing.compat.interface import UnsupportedVllmError


class FakePending:
    def __init__(self, batch: Any, log: list[Any]) -> None:
        self.request_ids = list(batch.req_ids)
        self.batch = batch
        self.log = log

    def enqueue_cpu_copy(self, num_sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        self.log.append(("copy", num_sampled.tolist(), num_rejected.tolist()))

    def process_output(self) -> dict[str, Any]:
        self.log.append(("process",))
        return {r: ("rows", r) for r in self.request_ids}


class FakeConnector:
    def __init__(self, *, vllm_config: Any, model: Any, kv_cache_config: Any) -> None:
        self.log: list[Any] = [("init", kv_cache_config)]
        self.batches: list[Any] = []

    def begin_step(self, metadata: Any) -> None:
        self.log.append(("begin", metadata))

    def prepare_output(self, batch: Any) -> FakePending:
        self.log.append(("prepare", list(batch.req_ids)))
        self.batches.append(batch)
        return FakePending(batch, self.log)


class V1Runner:
    """The parts of vLLM 0.31's V1 runner the driver touches."""

    def __init__(self, **config: Any) -> None:
        self.vllm_config = SimpleNamespace(
            speculative_config=None, scheduler_config=SimpleNamespace(async_scheduling=False), **config
        )
        self.model = object()
        self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=np.zeros(8, dtype=np.int32))
        self.events: list[str] = []
        self.next_sampled: dict[str, list[int]] = {}

    def load_model(self) -> None:
        self.events.append("load")

    def initialize_kv_cache(self, kv_cache_config: Any, is_profiling: bool = False) -> None:
        self.events.append(f"kv profiling={is_profiling}")

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        # _update_states: the batch is the scheduled requests, computed tokens as before this step
        self.input_batch.req_ids = list(scheduler_output.order)
        for i, computed in enumerate(scheduler_output.computed):
            self.input_batch.num_computed_tokens_cpu[i] = computed
        self.events.append("forward")

    def sample_tokens(self, grammar_output: Any) -> Any:
        self.events.append("sample")
        # vLLM's output may list requests in its own order
        ids = list(reversed(self.input_batch.req_ids))
        return SimpleNamespace(
            req_ids=ids, sampled_token_ids=[self.next_sampled[r] for r in ids], aux_output_connector_output=None
        )


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> V1Runner:
    api = AuxOutputAdapter()
    monkeypatch.setattr(aux_output, "connector_class", lambda: FakeConnector)
    cls = type("PatchedV1Runner", (V1Runner,), {})
    runner_mixin.apply_mixin(cls, api)
    made = cls()
    # A top-1 capture: the fake forward writes no rows, which the always-on check accepts only for top-1.
    buffer, errors = torch.zeros(128, 2, 1, dtype=torch.int16), torch.zeros(1, dtype=torch.int64)
    runner_state.set_prepared(made, PreparedCapture.bound(buffer, errors, 8, (0, 1)))
    return made


def step(order: list[str], scheduled: dict[str, int], computed: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        order=order,
        num_scheduled_tokens=scheduled,
        computed=computed,
        total_num_scheduled_tokens=sum(scheduled.values()),
        aux_output_connector_metadata=f"m{order}",
    )


def test_drives_the_connector_like_model_runner_v2(runner: V1Runner) -> None:
    runner.initialize_kv_cache("kv", is_profiling=True)
    assert not hasattr(runner, aux_output._DRIVER) or getattr(runner, aux_output._DRIVER) is None
    runner.initialize_kv_cache("kv")
    connector = getattr(runner, aux_output._DRIVER).connector
    # step: request a (decode, 40 computed) and b (prefill chunk of 100 after 16 prefix hits, not last)
    runner.execute_model(step(["a", "b"], {"a": 1, "b": 100}, [40, 16]))
    runner.next_sampled = {"a": [7], "b": []}
    out = runner.sample_tokens(None)
    batch = connector.batches[0]
    assert batch.req_ids == ["a", "b"]
    assert batch.query_start_loc_np.tolist() == [0, 1, 101]
    assert batch.num_computed_tokens_np.tolist() == [40, 16]
    assert [e[0] for e in connector.log] == ["init", "begin", "prepare", "copy", "process"]
    assert connector.log[3] == ("copy", [1, 0], [0, 0])  # sampled counts in the connector's order
    assert out.aux_output_connector_output == {"a": ("rows", "a"), "b": ("rows", "b")}
    # the runner's arrays are reused next step: the connector got copies
    runner.input_batch.num_computed_tokens_cpu[:] = 99
    assert batch.num_computed_tokens_np.tolist() == [40, 16]


def test_zero_token_step_still_begins_and_prepares_nothing(runner: V1Runner) -> None:
    runner.initialize_kv_cache("kv")
    connector = getattr(runner, aux_output._DRIVER).connector
    runner.execute_model(step([], {}, []))
    runner.next_sampled = {}
    runner.sample_tokens(None)
    assert [e[0] for e in connector.log] == ["init", "begin"]


def test_model_runner_v2_keeps_its_own_connector(runner: V1Runner) -> None:
    runner.aux_output_connector = "vLLM's"  # type: ignore[attr-defined]
    runner.initialize_kv_cache("kv")
    assert getattr(runner, aux_output._DRIVER, None) is None


def test_async_scheduling_is_refused_at_start_up(runner: V1Runner) -> None:
    runner.vllm_config.scheduler_config.async_scheduling = True
    with pytest.raises(UnsupportedVllmError, match="async"):
        runner.initialize_kv_cache("kv")


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_steps_report_the_rejected_drafts(runner: V1Runner, k: int) -> None:
    """Per request: drafts scheduled minus drafts accepted (sampled - 1), as Model Runner V2 counts them.
    a: every draft accepted; b: none; c: partial (k=3: one of three); d: a prefill chunk (no drafts, no
    sample); e: a finished prefill (no drafts, one sample)."""
    runner.vllm_config.speculative_config = SimpleNamespace(num_speculative_tokens=k)
    runner.initialize_kv_cache("kv")
    connector = getattr(runner, aux_output._DRIVER).connector
    order = ["a", "b", "c", "d", "e"]
    scheduled = {"a": 1 + k, "b": 1 + k, "c": 1 + k, "d": 64, "e": 9}
    out = step(order, scheduled, [40, 41, 42, 0, 30])
    out.scheduled_spec_decode_tokens = {r: list(range(k)) for r in "abc"}
    runner.execute_model(out)
    accepted_c = min(1, k - 1)
    runner.next_sampled = {"a": [1] * (k + 1), "b": [2], "c": [3] * (accepted_c + 1), "d": [], "e": [5]}
    runner.sample_tokens(None)
    copy = next(entry for entry in connector.log if entry[0] == "copy")
    assert copy == ("copy", [k + 1, 1, accepted_c + 1, 0, 1], [0, k, k - accepted_c, 0, 0])
    assert connector.batches[0].query_start_loc_np.tolist() == [0, 1 + k, 2 + 2 * k, 3 + 3 * k, 67 + 3 * k, 76 + 3 * k]


def test_more_samples_than_drafts_is_an_error_not_a_guess(runner: V1Runner) -> None:
    runner.vllm_config.speculative_config = SimpleNamespace(num_speculative_tokens=1)
    runner.initialize_kv_cache("kv")
    out = step(["a"], {"a": 2}, [10])
    out.scheduled_spec_decode_tokens = {"a": [9]}
    runner.execute_model(out)
    runner.next_sampled = {"a": [1, 2, 3]}
    with pytest.raises(RuntimeError, match="sampled 3 tokens with only 1 drafts"):
        runner.sample_tokens(None)


@pytest.fixture
def platforms(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """Make ``platform`` vLLM's ``current_platform`` (a stand-in ``vllm.platforms`` module) for the test."""
    import sys

    def use(platform: Any) -> None:
        monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=platform))

    return use


def test_config_check_exempts_only_the_v1_runner_on_cpu(
    monkeypatch: pytest.MonkeyPatch, platforms: Callable[[Any], None]
) -> None:
    class CpuPlatform:  # like vLLM's: the answers are the class's own
        def is_cpu(self) -> bool:
            return True

        def is_out_of_tree(self) -> bool:
            return False

    platform = CpuPlatform()
    platforms(platform)
    seen: list[bool] = []

    def upstream(self: Any) -> None:  # vLLM's first rule: Model Runner V2, TPU or an out-of-tree platform
        seen.append(self.use_v2_model_runner or platform.is_out_of_tree())
        assert self.model_config.runner_type == "generate"  # every other attribute is the config's own
        self.checked = True  # and so is what the check writes

    site = Site(upstream.__code__)
    lifted = _lift.lifted(CpuPlatform.is_out_of_tree, lambda: site, config_check._driven_here)
    monkeypatch.setattr(CpuPlatform, "is_out_of_tree", lifted)
    check = config_check._skipping_the_drafter(upstream)

    def config(enabled: bool, v2: bool, runner_type: str = "generate") -> SimpleNamespace:
        return SimpleNamespace(
            aux_output_config=SimpleNamespace(enabled=enabled),
            use_v2_model_runner=v2,
            model_config=SimpleNamespace(runner_type=runner_type),
        )

    v1 = config(enabled=True, v2=False)
    check(v1)
    check(config(enabled=True, v2=True))
    check(config(enabled=False, v2=False))
    check(config(enabled=True, v2=False, runner_type="draft"))  # the drafter's copy: not checked at all
    assert seen == [True, True, False]  # exempt: the V1 runner the plugin drives, and Model Runner V2; not off
    assert v1.use_v2_model_runner is False and v1.checked is True  # the config itself is left as it was
    assert platform.is_out_of_tree() is False  # any other reader: vLLM's answer


def test_config_check_lifts_vllm_s_refusal_only_for_connectors_the_plugin_carries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.31+ refuses routed experts with NIXL, MoRIIO and Mooncake (``has_connector`` in its AuxOutput check):
    the check sees no NixlConnector (its rows ride in its kv_transfer_params), still sees the others, and every other
    reader of the config sees vLLM's own answer."""

    class KvConfig:
        def __init__(self, name: str) -> None:
            self.kv_connector, self.kv_role, self.kv_connector_extra_config = name, "kv_consumer", {}

        def has_connector(self, name: str) -> bool:
            return self.kv_connector == name

    refused: list[str] = []

    def upstream(self: Any) -> None:  # vLLM's connector rule, a loop in the check itself
        for name in ("NixlConnector", "MooncakeConnector"):
            if self.kv_transfer_config.has_connector(name):
                refused.append(name)
        assert self.kv_transfer_config.kv_role == "kv_consumer"  # every other attribute is the config's own

    site = Site(upstream.__code__)
    monkeypatch.setattr(
        KvConfig, "has_connector", _lift.lifted(KvConfig.has_connector, lambda: site, config_check._carried)
    )
    for name in ("NixlConnector", "MooncakeConnector"):
        config = SimpleNamespace(kv_transfer_config=KvConfig(name))
        upstream(config)
        assert config.kv_transfer_config.has_connector(name)  # any other reader: vLLM's answer
    assert refused == ["MooncakeConnector"]  # without a row store and a secret the plugin does not serve it
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_SECRET", "s")
    refused.clear()
    upstream(SimpleNamespace(kv_transfer_config=KvConfig("MooncakeConnector")))
    assert refused == []  # with them its rows go by transfer id through the store: lifted (kv.named)
