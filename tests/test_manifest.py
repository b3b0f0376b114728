# SPDX-License-Identifier: Apache-2.0
"""The manifest collects the rows every patching module declares (no vLLM needed)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pytest

from tests import test_import_graph
from vllm_ascend_routing import _cpu_compat, manifest, validate
from vllm_ascend_routing.backends import ascend, cpu_moe
from vllm_ascend_routing.compat.aux_output import adapter as aux_output
from vllm_ascend_routing.compat.aux_output import config_check
from vllm_ascend_routing.compat.interface import UnsupportedVllmError
from vllm_ascend_routing.compat.runner_output import adapter as runner_output
from vllm_ascend_routing.compat.shm import adapter as shm
from vllm_ascend_routing.features import FEATURES
from vllm_ascend_routing.patching import CAPTURING, RELY, REPLACE, VALIDATION, Patch

GENERATIONS = [api.generation for api in manifest.adapters()]


def test_every_declared_row_is_collected() -> None:
    collected = {(p.target, p.generations, p.platform) for p in manifest.all_patches()}
    for module in (shm, runner_output, aux_output, cpu_moe, ascend, _cpu_compat, validate):
        assert module.PATCHES, module.__name__
        for patch in module.PATCHES:
            assert (patch.target, patch.generations, patch.platform) in collected, patch.target


def test_rows_name_a_module_and_a_symbol() -> None:
    for patch in manifest.all_patches():
        module_name, colon, qualname = patch.target.partition(":")
        assert colon and module_name.split(".")[0] in ("vllm", "vllm_ascend") and qualname, patch.target
        assert patch.why and patch.remove_when and patch.release_text.startswith(("vLLM", "vllm-ascend"))


@pytest.mark.parametrize("generation", GENERATIONS, ids=lambda g: g.value)
@pytest.mark.parametrize("platform", manifest.platforms())
def test_rows_are_unique_and_runner_hooks_come_first(generation: object, platform: str) -> None:
    rows = manifest.patches_for(generation, platform)  # type: ignore[arg-type]
    targets = [patch.target for patch in rows]
    assert len(targets) == len(set(targets))
    api = next(api for api in manifest.adapters() if api.generation is generation)
    if platform in api.runner_classes:  # else refused on that platform (integration.install), no runner rows
        assert targets[0].endswith(".load_model")


def test_a_target_two_features_hook_is_one_row_and_still_required_by_both() -> None:
    """0.31+'s AuxOutput scheduler connector: the per-request options replace take_output and build_connector_meta
    (required on every engine), the rows of loaded tokens wrap them per instance once a KV connector is configured.
    One manifest row each (the options'), and the KV connector check still requires both."""
    from vllm_ascend_routing.compat.aux_output import kv_rows as _kv_aux
    from vllm_ascend_routing.compat.aux_output import requests as _aux_requests

    shared = {patch.target for patch in _aux_requests.PATCHES}
    rows = [p for p in manifest.patches_for(aux_output.AuxOutputAdapter.generation, "cpu") if p.target in shared]
    assert sorted(p.target for p in rows) == sorted(shared) and all(p.action == REPLACE and p.required for p in rows)
    assert shared <= {patch.target for patch in aux_output.AuxOutputAdapter.kv_rows.patches}
    assert not shared & {patch.target for patch in _kv_aux.PATCHES}


def test_validation_rows_cover_every_generation_that_installs_them() -> None:
    rows = [patch for patch in manifest.all_patches() if patch.feature == VALIDATION]
    assert {patch.target for patch in rows} == {patch.target for patch in validate.PATCHES}
    assert all(patch.generations == CAPTURING for patch in rows)


def test_aux_output_rows_include_its_runner_hooks_and_binder() -> None:
    targets = {patch.target for patch in manifest.patches_for(aux_output.AuxOutputAdapter.generation, "cpu")}
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens" in targets
    assert aux_output.BINDER.target in targets and config_check.CONFIG_CHECK.target in targets


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the refusal where vLLM is absent")
def test_without_vllm_every_required_target_is_named_in_the_refusal() -> None:
    generation = runner_output.RunnerOutputAdapter.generation
    with pytest.raises(UnsupportedVllmError) as refused:
        manifest.verify(generation, "cpu")
    message = str(refused.value)
    rows = manifest.patches_for(generation, "cpu")
    required = [p for p in rows if p.required and p.package == "vllm" and not p.feature]  # validation off
    assert required and all(patch.target.partition(":")[0] in message for patch in required)
    assert "vLLM's capturer binder: none of" in message  # the group: neither member exists


def test_an_optional_absent_target_is_not_a_problem() -> None:
    patch = Patch("vllm_ascend_routing_absent_module:thing", "why", "never", required=False)
    assert manifest.problem(patch) is None
    assert manifest.problem(Patch("vllm_ascend_routing_absent_module:thing", "why", "never")) is not None


def _replaced_in(module: ModuleType) -> set[str]:
    """Targets of the rows ``module`` passes to ``patching.replace`` (a row constant, or each row of a tuple the
    call's loop iterates over), read from its source."""
    tree = ast.parse(inspect.getsource(module))
    loops = {
        node.target.id: node.iter.id
        for node in ast.walk(tree)
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name)
    }
    targets: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) in ("patching.replace", "replace")):
            continue
        argument = node.args[0]
        assert isinstance(argument, ast.Name), ast.unparse(node)
        value = getattr(module, loops.get(argument.id, argument.id))
        rows = value if isinstance(value, tuple) else (value,)
        targets.update(row.target for row in rows)
    return targets


def _package_modules() -> list[ModuleType]:
    package = Path(manifest.__file__).resolve().parent
    names = [test_import_graph.module_name(path) for path in sorted(package.rglob("*.py"))]
    modules = [importlib.import_module(name) for name in names if not name.endswith("__main__")]
    return [module for module in modules if "patching" in inspect.getsource(module)]  # the modules that may patch


def test_a_row_says_replace_exactly_when_some_module_replaces_its_target() -> None:
    """Every ``patching.replace`` of the package names a declared row, and a row says REPLACE exactly where one
    does: the manifest's rows (the adapters' and every feature's) are the patches actually applied."""
    replaced = {target for module in _package_modules() for target in _replaced_in(module)}
    declared: dict[str, set[str]] = {}
    for adapter in manifest.adapters():
        for patch in adapter.patches:
            declared.setdefault(patch.target, set()).add(patch.action)
    for feature in FEATURES:
        for patch in feature.patches:
            declared.setdefault(patch.target, set()).add(patch.action)
    assert replaced <= set(declared), f"undeclared targets replaced: {sorted(replaced - set(declared))}"
    for target, actions in declared.items():
        if target in replaced:
            assert REPLACE in actions, f"{target} is replaced but no row says so"
        else:
            assert actions == {RELY}, f"{target} says {actions}, nothing replaces it"


@pytest.mark.parametrize("platform", ["cpu", "npu"], ids=lambda platform: f"{platform}-runners")
def test_runner_rows_replace_hooked_methods_and_rely_on_subclasses_that_inherit_them(platform: str) -> None:
    for api in manifest.adapters():
        rows = manifest.patches_for(api.generation, platform)[: len(api.runner_hooks) * 4]
        for runner in api.runner_classes.get(platform, ()):  # a generation may refuse a platform (0.21.0: npu)
            mine = [row for row in rows if row.target.startswith(runner.path)]
            expected = RELY if runner.hooks_optional else REPLACE
            assert mine and {row.action for row in mine} == {expected}, runner.path


def test_the_start_up_count_tells_replaced_targets_from_relied_on_symbols() -> None:
    replaced, relied = Patch("vllm.x:f", "why", "never"), Patch("vllm.x:C", "why", "never", action=RELY)
    optional = Patch("vllm.x:g", "why", "never", required=False)
    findings = [
        manifest.Finding(replaced, True, None),
        manifest.Finding(optional, False, None),  # absent here, and optional
        manifest.Finding(relied, True, None),
    ]
    assert manifest.counted(findings) == "1 patch targets + 1 relied-on symbols verified (1 optional absent here)"
    assert manifest.counted(findings[2:]) == "0 patch targets + 1 relied-on symbols verified"
