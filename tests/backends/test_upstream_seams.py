# SPDX-License-Identifier: Apache-2.0
"""Never worse than vLLM's own binder: every kind of layer it binds, the plugin binds or leaves to it.

On the installed vLLM (the e2e releases, and vLLM 0.33.0's CUDA wheel in its import-only environment: make
test-static), every class vLLM's module-level ``bind_routed_experts_capturer`` can bind is enumerated from
vLLM's own modules: ``BaseRouter`` subclasses, modules that set a ``capture_fn`` and have a ``layer_id``
(``RoutedExpertsCaptureSource``), and ``FusedMoEExpertsMonolithic`` subclasses that declare replay capture.
Each becomes a layer built without a GPU (``__new__`` plus the attributes the binder reads) in two identical
models: vLLM's binder binds one to vLLM's capturer; the plugin binds the other at load and is handed another
capturer of the same class. The same logical ids go in through the layer's own seam, and the two buffers
must hold the same rows. The plugin's code paths are the real ones; vLLM's capturer is built by ``__new__``
because its constructor sizes itself from a model config.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend_routing.backends import upstream
from vllm_ascend_routing.compat._common import attach_buffer, bind_target_model
from vllm_ascend_routing.releases import version_key

pytestmark = pytest.mark.vllm

NUM_LAYERS, TOP_K, NUM_EXPERTS, NUM_TOKENS = 4, 2, 8, 6
# The base class of every router vLLM's binder binds by its capture hook (the router backend's seam).
ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router:BaseRouter"
LAYER_ID = 2


@pytest.fixture(scope="module")
def binder() -> Any:
    found = upstream.deferral_binder()  # the module-level binder (0.28+), or 0.27's runner method
    if found is None:
        import vllm

        # From 0.27 on there must be one: a binder lost there (a broken bytecode check, a moved symbol) fails here.
        assert version_key(vllm.__version__) < (0, 27), f"vLLM {vllm.__version__}: no binder found for deferred layers"
        pytest.skip("before 0.27 vLLM's binder binds routers only (the router backend's tests cover them)")
    return found


def _modules_mentioning(pattern: str) -> list[str]:
    """Dotted names of vLLM's modules whose source matches ``pattern`` (read as text: importing all of vLLM
    loads platform code that may not load here)."""
    import vllm

    root = Path(vllm.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if re.search(pattern, path.read_text(errors="replace")):
            relative = path.relative_to(root.parent).with_suffix("")
            found.append(".".join(relative.parts).removesuffix(".__init__"))
    return found


def _import(modules: list[str]) -> list[str]:
    """Import ``modules``; the names of those that fail, with why."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# What makes a module define a class of each kind vLLM's binder binds.
SOURCES = {
    "router": r"class \w+\([\w.]*Router\w*\)",
    "capture_source": r"self\.capture_fn\s*[:=]",
    "monolithic": r"def supports_routing_replay_capture",
}


@pytest.fixture(scope="module")
def vllm_classes(binder: Any) -> dict[str, Any]:
    """Every class of each kind vLLM's binder binds, from the vLLM modules that can define one."""
    failed = {kind: _import(_modules_mentioning(pattern)) for kind, pattern in SOURCES.items()}
    router = upstream._resolved(ROUTER)
    monolithic = upstream._resolved(upstream.MONOLITHIC_EXPERTS)
    sources = []
    for cls in set(_subclasses(torch.nn.Module)):
        if not cls.__module__.startswith("vllm.") or inspect.isabstract(cls):
            continue
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(SOURCES["capture_source"], source) and "layer_id" in source:
            sources.append(cls)
    routers = [cls for cls in set(_subclasses(router)) if not inspect.isabstract(cls)]
    capturing = []
    if monolithic is not None:
        for cls in set(_subclasses(monolithic)):
            if not inspect.isabstract(cls) and cls.__new__(cls).supports_routing_replay_capture():
                capturing.append(cls)  # its own answer, wherever in its bases it is written
    by_name = lambda classes: sorted(classes, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")  # noqa: E731
    return {
        "router": by_name(routers),
        "capture_source": by_name(sources),
        "monolithic": by_name(capturing),
        "failed": failed,
    }


def _capturer() -> Any:
    """vLLM's own capturer class, built without a model config: the attributes its capture path reads."""
    cls = upstream._resolved(f"{upstream.CAPTURER}:RoutedExpertsCapturer")
    capturer = cls.__new__(cls)
    capturer.device_buffer = torch.zeros(NUM_TOKENS, NUM_LAYERS, TOP_K, dtype=torch.int32)
    capturer.shape_per_token = (NUM_LAYERS, TOP_K)
    capturer.dp_rank, capturer.tp_size = 0, 1
    capturer.output_dtype = torch.uint8
    return capturer


class _Model(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([layer])


def _layer_name() -> str:
    return f"model.layers.{LAYER_ID}.mlp.experts"


def _router_layer(router_cls: type, monolithic_experts: Any = None) -> torch.nn.Module:
    """An ``MoERunner`` as vLLM's binder reads it: ``layer_id``/``layer_name``, ``router``, the quant method
    (``is_monolithic``, ``moe_kernel.impl.fused_experts``) through ``routed_experts``."""
    runner_cls = upstream._resolved("vllm.model_executor.layers.fused_moe.layer:MoERunner")
    layer = runner_cls.__new__(runner_cls)
    torch.nn.Module.__init__(layer)
    router = router_cls.__new__(router_cls)
    router.capture_fn = None
    # What the zero_expert_router backend reads (its zero-expert count); other routers ignore them.
    router.e_score_correction_bias, router.num_logical_experts = torch.zeros(NUM_EXPERTS + 2), NUM_EXPERTS
    quant = SimpleNamespace(
        is_monolithic=monolithic_experts is not None,
        moe_kernel=SimpleNamespace(impl=SimpleNamespace(fused_experts=monolithic_experts)),
    )
    object.__setattr__(layer, "router", router)
    object.__setattr__(layer, "routed_experts", SimpleNamespace(quant_method=quant, routing_sink=None))
    object.__setattr__(layer, "layer_name", _layer_name())
    return layer


def _monolithic_experts(cls: type) -> Any:
    experts = cls.__new__(cls)
    moe_config = SimpleNamespace(
        ep_size=1, use_ep=False, dp_size=1, max_num_tokens=NUM_TOKENS, experts_per_token=TOP_K, device="cpu"
    )
    object.__setattr__(experts, "moe_config", moe_config)
    return experts


def _capture_source(cls: type) -> torch.nn.Module:
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.capture_fn = None
    layer.prefix = _layer_name()  # MegaMoE's layer_id reads it
    if not isinstance(inspect.getattr_static(cls, "layer_id", None), property):
        layer.layer_id = LAYER_ID
    return layer


def _fire(layer: torch.nn.Module, kind: str, ids: torch.Tensor) -> None:
    """The layer's own seam, as vLLM's forward calls it."""
    if kind == "capture_source":
        layer.capture_fn(ids)
    elif kind == "router":
        layer.router.capture_fn(ids)
    else:
        sink = layer.routed_experts.routing_sink
        if sink is not None:  # 0.32+: the kernel fills the sink's buffer, then calls its capture_fn
            sink.buffer[: len(ids)] = ids
            sink.capture_fn(sink.buffer[: len(ids)])
        else:  # 0.28-0.31: the experts' own hook (set_capture_fn)
            layer.routed_experts.quant_method.moe_kernel.impl.fused_experts.routing_replay_capture_fn(ids)


def _build(kind: str, cls: type, routers: list[type]) -> torch.nn.Module:
    if kind == "capture_source":
        return _capture_source(cls)
    if kind == "router":
        return _router_layer(cls)
    return _router_layer(routers[0], _monolithic_experts(cls))


def _rows_through(kind: str, cls: type, routers: list[type], binder: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from vllm.forward_context import override_forward_context

    ids = torch.randint(0, NUM_EXPERTS, (NUM_TOKENS - 1, TOP_K), generator=torch.Generator().manual_seed(7))
    upstream_model, plugin_model = _Model(_build(kind, cls, routers)), _Model(_build(kind, cls, routers))
    upstream_capturer, plugin_capturer = _capturer(), _capturer()
    binder(upstream_model, upstream_capturer)
    prepared = bind_target_model(plugin_model, NUM_TOKENS, (NUM_LAYERS, TOP_K, NUM_EXPERTS), torch.device("cpu"))
    attach_buffer(prepared, plugin_capturer)
    context = SimpleNamespace(dp_metadata=None, batch_descriptor=None)
    with override_forward_context(context):  # type: ignore[arg-type]
        _fire(upstream_model.layers[0], kind, ids)
        _fire(plugin_model.layers[0], kind, ids)
    how = {"deferred": len(prepared.deferred), "layer_ids": prepared.layer_ids}
    return upstream_capturer.device_buffer, plugin_capturer.device_buffer, how


# Routers a backend of the plugin records differently from vLLM's hook, on purpose (and which backend).
IMPROVED_ROUTERS = {"ZeroExpertRouter": ("zero_expert_router",)}


def _plugin_backend(router_cls: type) -> str | None:
    from vllm_ascend_routing import backends

    layer = _router_layer(router_cls)
    return next((name for name, backend in backends.BACKENDS if backend.handles(layer)), None)


def test_vllm_names_no_kind_of_layer_the_plugin_does_not_know(binder: Any) -> None:
    if upstream.binder() is None:
        pytest.skip("vLLM 0.27 binds in its runner method (doctor's coverage lines read the module-level binder)")
    names = {seam.name for seam in upstream.seams()}
    assert {"BaseRouter", "RoutedExpertsCaptureSource"} <= names, names
    assert upstream.unknown_seams() == []


@pytest.mark.parametrize("kind", ["router", "capture_source", "monolithic"])
def test_each_class_vllm_binds_gets_the_same_rows_with_the_plugin(
    kind: str, binder: Any, vllm_classes: dict[str, list[type]]
) -> None:
    if kind == "capture_source" and upstream._resolved(upstream.CAPTURE_SOURCE) is None:
        pytest.skip("vLLM binds capture sources from 0.28 (RoutedExpertsCaptureSource)")
    classes = vllm_classes[kind]
    assert not vllm_classes["failed"][kind], vllm_classes["failed"][kind]  # every candidate module imported
    if kind == "monolithic" and not classes:
        pytest.skip("no monolithic experts of this vLLM declare replay capture")
    assert classes, f"vLLM's binder binds {kind} layers, but none were found in vLLM's modules"
    report = []
    for cls in classes:
        if kind == "router" and (backend := _plugin_backend(cls)) != "router":
            # A backend of the plugin that records this router its own way (zero_expert_router: zero experts as
            # their own ids where vLLM's hook sees them overwritten), tested in that backend's own tests.
            assert backend in IMPROVED_ROUTERS.get(cls.__name__, ()), f"{cls.__qualname__}: {backend}"
            report.append(f"{cls.__qualname__} (plugin's {backend} backend)")
            continue
        expected, got, how = _rows_through(kind, cls, vllm_classes["router"], binder)
        assert torch.equal(expected, got.to(expected.dtype)), f"{cls.__module__}.{cls.__qualname__}"
        assert expected[: NUM_TOKENS - 1, LAYER_ID].ne(0).any()  # the ids really went in
        assert how["layer_ids"] == (LAYER_ID,)
        assert how["deferred"] == (0 if kind == "router" else 1), (cls, how)
        report.append(cls.__qualname__)
    print(f"{kind}: {len(report)} classes: {', '.join(report)}")
