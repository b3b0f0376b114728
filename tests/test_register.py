# SPDX-License-Identifier: Apache-2.0
import subprocess
import sys

import pytest

import vllm_ascend_routing
from tests import settings
from vllm_ascend_routing import integration


def test_off_by_default_imports_nothing() -> None:
    """With the variable unset, register() returns without importing vLLM, torch or our modules."""
    code = (
        "import sys, vllm_ascend_routing as p; p.register(); "
        "heavy = [m for m in ('vllm', 'torch', 'vllm_ascend_routing.integration') if m in sys.modules]; "
        "print(heavy)"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_enabled_installs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(integration, "install", lambda: calls.append(1))
    monkeypatch.setattr(vllm_ascend_routing, "_registered", False)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "1")
    vllm_ascend_routing.register()
    vllm_ascend_routing.register()
    assert calls == [1]


def test_failed_install_is_not_marked_done(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise RuntimeError("unsupported")

    monkeypatch.setattr(integration, "install", refuse)
    monkeypatch.setattr(vllm_ascend_routing, "_registered", False)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "1")
    for _ in range(2):  # every process start refuses again, loudly
        with pytest.raises(RuntimeError, match="unsupported"):
            vllm_ascend_routing.register()


def test_entry_point_declared() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("vllm_ascend_routing") == "vllm_ascend_routing:register"


def test_logger_goes_through_vllm_namespace() -> None:
    from vllm_ascend_routing._logging import get_logger

    assert get_logger("vllm_ascend_routing.integration").name.startswith("vllm.")


def test_variables_are_declared_to_vllm_even_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.31+ warns about (or, with --fail-on-environ-validation, refuses) every VLLM_* variable its
    registry does not know: once any of the plugin's is set, register() adds them all, and does nothing
    else while the plugin is off; it imports nothing (vLLM's registry only if vLLM loaded it)."""
    from types import ModuleType

    from vllm_ascend_routing import envs

    fake = ModuleType("vllm.envs")
    fake.environment_variables = {"VLLM_HOST_IP": lambda: ""}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", fake)
    monkeypatch.setattr(integration, "install", lambda: pytest.fail("installed while off"))
    monkeypatch.setattr(vllm_ascend_routing, "_registered", False)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "0")
    vllm_ascend_routing.register()
    registry = fake.environment_variables  # type: ignore[attr-defined]
    assert set(envs.environment_variables) <= set(registry) and "VLLM_HOST_IP" in registry
    assert registry["VLLM_ASCEND_ROUTING"]() is False


@pytest.mark.vllm
def test_vllm_environment_validation_accepts_the_plugins_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    validate_environ = getattr(current_platform, "validate_environ", None)  # vLLM's proxy: None if absent
    if not callable(validate_environ):
        pytest.skip("this vLLM release does not validate environment variables (0.31+ does)")
    monkeypatch.setattr(vllm_ascend_routing, "_registered", True)  # the plugin itself is not under test here
    for name in settings.settings:  # the test suite's own (tests/settings.py): not the plugin's, not declared by it
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    vllm_ascend_routing.register()
    validate_environ(True)  # --fail-on-environ-validation: raises on an unknown VLLM_*
