# SPDX-License-Identifier: Apache-2.0
"""``make gpu-e2e-rehearse`` (scripts/gpu_e2e/rehearse.py): the parts that decide its verdict, without its ~6 GB
environment: a module from a distribution the GPU machine's image lacks is named, the stand-in driver exports what a
library leaves undefined and fails every call, the image's list agrees with the environment rebuilt from it, and a
probe that finds a module missing fails the step."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import scripts

rehearse = scripts.load("scripts/gpu_e2e/rehearse.py", "_gpu_e2e_rehearse")
venv = scripts.load("scripts/venv.py", "_venv_for_rehearse")


def test_a_module_from_a_distribution_the_image_lacks_is_named() -> None:
    image = ["torch", "PyYAML", "setuptools"]
    owners = {"torch": "torch", "yaml": "pyyaml", "distutils": "setuptools", "jaraco": "jaraco.functools"}
    assert rehearse.outside_image(owners, image) == {"jaraco.functools": ["jaraco"]}
    # A file no installed distribution lists is named too, never taken as held.
    assert rehearse.outside_image({"loose": None}, image) == {"no distribution (module loose)": ["loose"]}
    assert rehearse.outside_image({"torch": "torch", "yaml": "PyYAML"}, image) == {}


def test_the_image_list_holds_the_versions_the_rehearsal_environment_pins() -> None:
    image = rehearse.image_packages()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0" and image["triton"] == "3.6.0"
    for requirement in venv.GPU_IMAGE_PACKAGES:
        name, _, version = requirement.partition("==")
        assert rehearse.normalize(name) in image, f"{name}: the environment installs what the image does not hold"
        assert not version or image[rehearse.normalize(name)] in (None, version), requirement
    # What the payload brings is what the image lacks or holds at another version, never the same one.
    carried = (Path(rehearse.HERE) / "requirements.txt").read_text().split()
    for line in (word for word in carried if "==" in word):
        name, _, version = line.partition("==")
        assert image.get(rehearse.normalize(name)) != version, f"{line} is in the image already"


@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("nm")), reason="no C compiler or nm on this machine")
def test_the_driver_stub_exports_what_a_library_leaves_undefined_and_fails_every_call(tmp_path: Path) -> None:
    user = tmp_path / "user.c"
    user.write_text(
        "int cuMemCreate(void); int cuCtxGetCurrent(void); int f(void) { return cuMemCreate() + cuCtxGetCurrent(); }\n"
    )
    library = tmp_path / "site" / "vllm" / "_C.abi3.so"
    library.parent.mkdir(parents=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(user)], check=True)
    assert rehearse.driver_symbols([library]) == ["cuCtxGetCurrent", "cuMemCreate"]
    detail = rehearse.build_driver_stub(tmp_path / "site", tmp_path / "stub")
    assert detail.startswith("2 driver functions of 1 libraries")
    stub = ctypes.CDLL(str(tmp_path / "stub" / "libcuda.so.1"))
    assert stub.cuInit(0) == 100 and stub.cuMemCreate() == 100  # CUDA_ERROR_NO_DEVICE: nothing sees a GPU
    assert "REHEARSAL ONLY" in (tmp_path / "stub" / "libcuda.c").read_text()


def probe_result(**changes: Any) -> dict[str, Any]:
    result = {"failures": {}, "plugins": ["vllm_ascend_routing:register"], "owners": {"torch": "torch"}}
    return {**result, **changes}


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"failures": {"vllm.v1.engine.core": "ModuleNotFoundError: No module named 'msgspec'"}}, "msgspec"),
        ({"plugins": []}, "found as []"),
        ({"plugins": ["vllm_ascend_routing:register"] * 2}, "want it once"),
        ({"owners": {"torch": "torch", "lark": "lark"}}, "lark came from lark, which the GPU machine's image"),
    ],
)
def test_the_imports_step_fails_naming_what_the_gpu_run_would_lack(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, Any], named: str
) -> None:
    monkeypatch.setattr(rehearse, "child", lambda arguments, env, python=None: probe_result(**changes))
    with pytest.raises(rehearse.RehearsalError, match=named.replace("[", r"\[").replace("]", r"\]")):
        rehearse.check_imports({})
    monkeypatch.setattr(rehearse, "child", lambda arguments, env, python=None: probe_result())
    assert "1 top-level modules" in rehearse.check_imports({})


def test_the_reference_step_needs_every_moe_layer_hooked_and_equal_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    archs = rehearse.gpu_run_architectures()
    assert {"qwen3_moe_robust", "mixtral", "qwen3_moe_bench", "qwen3_moe_dense"} <= set(archs)
    digest = {"moe_layers": [0, 2], "hooked": [0, 2], "ids": "a", "logits": [1.0, 0.0, 2.0]}

    def answers(mine: dict[str, Any], theirs: dict[str, Any]) -> Any:
        return lambda arguments, env, python=None: theirs if python else mine

    same = {"transformers": "5.17.0", **dict.fromkeys(archs, digest)}
    monkeypatch.setattr(rehearse, "child", answers(same, {**same, "transformers": "5.24.0"}))
    assert "equal to transformers 5.24.0's" in rehearse.check_reference({}, Path("/nowhere"), "python")
    unhooked = {**same, archs[0]: {**digest, "hooked": [0]}}
    monkeypatch.setattr(rehearse, "child", answers(unhooked, unhooked))
    with pytest.raises(rehearse.RehearsalError, match="routers hooked in layers"):
        rehearse.check_reference({}, Path("/nowhere"), None)
    other = {**same, archs[-1]: {**digest, "ids": "b"}}
    monkeypatch.setattr(rehearse, "child", answers(same, other))
    with pytest.raises(rehearse.RehearsalError, match=f"{archs[-1]}: ids or logits differ"):
        rehearse.check_reference({}, Path("/nowhere"), "python")


def test_without_nvcc_the_kernel_build_is_a_failure_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rehearse.shutil, "which", lambda name: None)
    with pytest.raises(rehearse.RehearsalError, match="no nvcc on PATH"):
        rehearse.check_kernel_build(tmp_path)
