# SPDX-License-Identifier: Apache-2.0
import pytest

from vllm_ascend_routing import envs


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    assert envs.VLLM_ASCEND_ROUTING is False
    assert envs.VLLM_ASCEND_ROUTING_VLLM_API == "auto"
    assert envs.VLLM_ASCEND_ROUTING_FORCE_REFERENCE is False
    assert envs.VLLM_ASCEND_ROUTING_TARGET_DEVICE == ""
    assert envs.VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB == 256


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_bool_parsing(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", raw)
    assert envs.VLLM_ASCEND_ROUTING is value


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "maybe")
    with pytest.raises(ValueError, match="VLLM_ASCEND_ROUTING='maybe'"):
        _ = envs.VLLM_ASCEND_ROUTING
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "v9")
    with pytest.raises(ValueError, match="runner-output"):
        _ = envs.VLLM_ASCEND_ROUTING_VLLM_API
    for bad in ("-1", "1.5", "lots"):
        monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB", bad)
        with pytest.raises(ValueError, match="whole number of MiB"):
            _ = envs.VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB", "0")  # holds nothing: every such load computed
    assert envs.VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB == 0


def test_read_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "shm")
    assert envs.VLLM_ASCEND_ROUTING_VLLM_API == "shm"
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "aux-output")
    assert envs.VLLM_ASCEND_ROUTING_VLLM_API == "aux-output"
    assert set(dir(envs)) == set(envs.environment_variables)
    with pytest.raises(AttributeError):
        _ = envs.NOT_A_VARIABLE
