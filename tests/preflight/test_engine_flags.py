# SPDX-License-Identifier: Apache-2.0
"""``doctor --model PATH -- ENGINE FLAGS``: the flags after ``--`` reach doctor untouched, vLLM's own parser reads
them (what they change, nothing else), one it does not know is refused, and the pre-flight's defaults yield to them."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from vllm_ascend_routing import __main__ as cli
from vllm_ascend_routing.preflight import doctor, engine_flags, findings, guide


def test_what_follows_the_separator_goes_to_doctor_as_engine_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(doctor, "run", lambda **options: seen.update(options) or 0)
    flags = ["--data-parallel-size", "2", "--enable-expert-parallel", "--additional-config", '{"a": 1}']
    monkeypatch.setattr(sys, "argv", ["x", "doctor", "--model", "/m", "--tensor-parallel-size", "2", "--", *flags])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 0 and seen["model"] == "/m"
    assert seen["model_options"]["engine_flags"] == flags and seen["model_options"]["tensor_parallel_size"] == 2


def test_engine_flags_without_a_model_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(sys, "argv", ["x", "doctor", "--", "--enforce-eager"])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 2 and "engine flags after -- are for doctor --model PATH only" in capsys.readouterr().err


def test_the_preflight_defaults_yield_to_the_users_flags_but_routed_experts_stay_on() -> None:
    given = {"model": "/m", "max_num_batched_tokens": 8192, "enable_return_routed_experts": False}
    options = engine_flags.preflight_options(given, on_cpu=True, cpu_kv_cache_bytes=123)
    assert options["max_num_batched_tokens"] == 8192 and options["enable_return_routed_experts"] is True
    assert options["max_model_len"] == engine_flags.DEFAULTS["max_model_len"]
    assert options["kv_cache_memory_bytes"] == 123
    sized = engine_flags.preflight_options({"kv_cache_memory_bytes": 7}, on_cpu=True, cpu_kv_cache_bytes=123)
    assert sized["kv_cache_memory_bytes"] == 7
    assert "kv_cache_memory_bytes" not in engine_flags.preflight_options({}, on_cpu=False, cpu_kv_cache_bytes=123)


@pytest.mark.vllm
def test_vllms_parser_reads_the_flags_a_user_serves_with() -> None:
    """No engine: vLLM's parser only (vLLM's engine arguments of this release)."""
    flags = ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--enable-expert-parallel"]
    flags += ["--max-num-batched-tokens", "32", "--enforce-eager", "--dtype", "bfloat16"]
    given = engine_flags.parse("/m", flags)
    assert given == {
        "model": "/m",
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "enable_expert_parallel": True,
        "max_num_batched_tokens": 32,
        "enforce_eager": True,
        "dtype": "bfloat16",
    }
    assert engine_flags.parse("/m", []) == {"model": "/m"}
    with pytest.raises(engine_flags.EngineFlagsError, match="refused: --no-such-flag"):
        engine_flags.parse("/m", ["--no-such-flag"])
    with pytest.raises(engine_flags.EngineFlagsError, match="not after --"):
        engine_flags.parse("/m", ["--model", "/other"])


def test_flags_vllm_refuses_are_a_clear_fail_of_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.preflight.test_doctor import fake_environment, fake_targets
    from vllm_ascend_routing.preflight import model_check

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise engine_flags.EngineFlagsError("vLLM's engine-argument parser refused: --no-such-flag")

    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(1))
    monkeypatch.setattr(findings, "binder_coverage", lambda: {"module_level": False, "rows": [], "unknown": []})
    monkeypatch.setattr(model_check, "run", refused)
    printed: list[str] = []
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, platform="cpu", model="/", report=report) == 1  # a path that exists
    reason = "EngineFlagsError: vLLM's engine-argument parser refused: --no-such-flag"
    assert printed[-1] == doctor.VERDICT + f"FAIL (engine_flags): {reason}. Next: {guide.ENGINE_FLAGS}"
    assert (report["verdict"]["stage"], report["verdict"]["kind"]) == ("engine_start", "engine_flags")
