# SPDX-License-Identifier: Apache-2.0
"""``make gpu-e2e`` and ``make gpu-e2e-prep`` (scripts/gpu_e2e/) where no GPU is: the loud failure, and every part
that runs without one (the sm_90 cut, the payload's manifest and size check, the job runner's timeouts, deadline and
dependencies, the verdict on an engine check's result)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import scripts

fatbin = scripts.load("scripts/gpu_e2e/fatbin.py", "_gpu_e2e_fatbin")
prep = scripts.load("scripts/gpu_e2e/prep.py", "_gpu_e2e_prep")
jobs = scripts.load("scripts/gpu_e2e/jobs.py", "_gpu_e2e_jobs")
cases = scripts.load("scripts/gpu_e2e/cases.py", "_gpu_e2e_cases")
device_run = scripts.load("scripts/gpu_e2e/device_run.py", "_gpu_e2e_device_run")
engine_checks = scripts.load("scripts/gpu_e2e/engine_checks.py", "_gpu_e2e_engine_checks")

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-e2e runs the real thing")


@NO_GPU
def test_without_a_gpu_make_gpu_e2e_fails_loudly_naming_the_gpu(tmp_path: Path) -> None:
    """The make target itself, with this interpreter (torch without a GPU): exit status 1, the last line names the
    missing GPU, and the summary says the gpu step failed and nothing else ran."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(
        ["make", "--no-print-directory", "gpu-e2e", f"PYTHON={sys.executable}"],
        cwd=scripts.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-e2e: FAILED: no NVIDIA GPU"), done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"].startswith("FAILED: no NVIDIA GPU")
    assert [step["step"] for step in summary["steps"]] == ["gpu"] and summary["steps"][0]["status"] == "failed"
    assert "jobs" not in summary and (tmp_path / "run.log").read_text().count("FAILED") == 1


def test_without_torch_the_failure_names_the_gpu_too(tmp_path: Path) -> None:
    """An interpreter without torch at all (this machine's plain python3): the same loud failure."""
    python = shutil.which("python3")
    if python is None:
        pytest.skip("no python3 on PATH")
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, check=False).returncode == 0
    if has_torch:
        pytest.skip("python3 here has torch: the test above covers it")
    done = subprocess.run(
        [python, str(scripts.ROOT / "scripts/gpu_e2e/device_run.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "gpu-e2e: FAILED: no NVIDIA GPU usable: torch is not importable" in done.stdout


# ---- the sm_90 cut, on a synthetic ELF holding two fatbins ----


def fatbin_blob(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A fatbin: header, then (kind, arch, payload) entries, each with a 64-byte entry header."""
    body = b""
    for kind, arch, payload in entries:
        header = fatbin.ENTRY.pack(kind, 0, 64, len(payload), 0, 0, 0, 0, arch)
        body += header + bytes(64 - len(header)) + payload
    return fatbin.HEADER.pack(fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf_with_section(name: bytes, data: bytes) -> tuple[bytes, int]:
    """A minimal 64-bit little-endian ELF: section 1 is ``name`` holding ``data``, section 2 the names."""
    names = b"\0" + name + b"\0.shstrtab\0"
    data_offset = 64
    names_offset = data_offset + len(data)
    table_offset = names_offset + len(names)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, table_offset)
    struct.pack_into("<HHH", header, 0x3A, 64, 3, 2)
    sections = bytes(64)
    sections += struct.pack("<IIQQQQIIQQ", 1, 1, 0, 0, data_offset, len(data), 0, 0, 8, 0)
    sections += struct.pack("<IIQQQQIIQQ", 2 + len(name), 3, 0, 0, names_offset, len(names), 0, 0, 1, 0)
    return bytes(header) + data + names + sections, data_offset


def test_fatbin_cut_keeps_sm90_code_and_every_offset(tmp_path: Path) -> None:
    """Fatbin 1 has an sm_90 cubin: it and nothing else is kept (other cubins and all PTX zeroed). Fatbin 2 has none:
    its PTX up to compute_90 is kept (JIT), compute_100's PTX and other cubins zeroed. Size and offsets unchanged."""
    first = fatbin_blob([(2, 80, b"A" * 40), (2, 90, b"B" * 48), (1, 90, b"C" * 24), (2, 100, b"D" * 32)])
    second = fatbin_blob([(2, 80, b"E" * 16), (1, 80, b"F" * 24), (1, 100, b"G" * 8)])
    padding = bytes(-len(first) % 8)
    elf, start = elf_with_section(b".nv_fatbin", first + padding + second)
    source, target = tmp_path / "lib.so", tmp_path / "cut.so"
    source.write_bytes(elf)
    stats = fatbin.strip(source, target, 90)
    cut = target.read_bytes()
    assert len(cut) == len(elf)
    section = cut[start : start + len(first + padding + second)]
    assert section.count(b"B") == 48 and section.count(b"F") == 24
    for letter in b"ACDEG":
        assert section.count(bytes([letter])) == 0, chr(letter)
    assert stats == {
        "fatbins": 2,
        "fatbins_without_own_cubin": 1,
        "kept_cubin": 48,
        "kept_ptx": 24,
        "zeroed": 40 + 24 + 32 + 16 + 8,
    }
    assert cut[:start] == elf[:start]  # nothing outside the entries' payloads changed


def test_fatbin_cut_refuses_what_it_does_not_understand(tmp_path: Path) -> None:
    path = tmp_path / "x.so"
    path.write_bytes(b"not an elf" * 10)
    with pytest.raises(fatbin.FatbinError, match="not a 64-bit"):
        fatbin.strip(path, tmp_path / "y.so", 90)
    elf, _ = elf_with_section(b".text", b"\0" * 32)
    path.write_bytes(elf)
    with pytest.raises(fatbin.FatbinError, match="no .nv_fatbin section"):
        fatbin.strip(path, tmp_path / "y.so", 90)
    only_other, _ = elf_with_section(b".nv_fatbin", fatbin_blob([(2, 80, b"A" * 8)]))
    path.write_bytes(only_other)
    with pytest.raises(fatbin.FatbinError, match="no code for sm_90"):
        fatbin.strip(path, tmp_path / "y.so", 90)
    assert not (tmp_path / "y.so").exists()


# ---- the payload: manifest, reuse, size ----


def fake_payload(dest: Path, zip_bytes: int, recipe: str | None = None) -> dict[str, Any]:
    (dest / "deps").mkdir(parents=True)
    (dest / prep.ZIP_NAME).write_bytes(b"z" * zip_bytes)
    (dest / "deps" / "a-1.0-py3-none-any.whl").write_bytes(b"w" * 100)
    manifest = {"recipe": recipe or prep.recipe_hash(), "vllm": prep.VLLM_VERSION, "arch": "sm_90", "built": "now"}
    manifest["files"] = prep.files_of(dest)
    (dest / prep.MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_payload_is_reused_only_when_its_recipe_and_files_match(tmp_path: Path) -> None:
    dest = tmp_path / "payload"
    fake_payload(dest, 1000)
    assert prep.up_to_date(dest) is not None
    (dest / "deps" / "a-1.0-py3-none-any.whl").write_bytes(b"w" * 99)  # a file changed size
    assert prep.up_to_date(dest) is None
    stale = tmp_path / "stale"
    fake_payload(stale, 1000, recipe="0" * 16)  # built by another recipe (prep.py, fatbin.py, requirements.txt)
    assert prep.up_to_date(stale) is None


def test_payload_over_what_one_run_carries_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "payload"
    fake_payload(dest, 1000)
    monkeypatch.setattr(prep, "working_tree_bytes", lambda: 2 * 2**20)
    line = prep.check_size(dest)
    assert "of the 64.0 MiB one device run carries" in line
    monkeypatch.setattr(prep, "working_tree_bytes", lambda: prep.LIMIT_BYTES - 500)
    with pytest.raises(prep.PrepError, match="too large for one run"):
        prep.check_size(dest)


def test_the_device_run_checks_the_payload_it_is_given(tmp_path: Path) -> None:
    with pytest.raises(device_run.StepError, match="no payload .* run make gpu-e2e-prep"):
        device_run.check_payload(tmp_path / "missing")
    dest = tmp_path / "payload"
    fake_payload(dest, 1000)
    assert device_run.check_payload(dest)["vllm"] == prep.VLLM_VERSION
    (dest / prep.ZIP_NAME).write_bytes(b"y" * 1000)  # same size, other bytes
    with pytest.raises(device_run.StepError, match="does not match its SHA-256"):
        device_run.check_payload(dest)


def test_the_payload_folder_is_ignored_by_git() -> None:
    (scripts.ROOT / ".gpu-e2e").mkdir(exist_ok=True)
    assert prep.ignored_by_git(scripts.ROOT / ".gpu-e2e")


# ---- the job runner ----


def python_job(name: str, code: str, **kwargs: Any) -> Any:
    return jobs.Job(name, [sys.executable, "-c", code], **kwargs)


def test_jobs_results_failures_timeouts_and_dependencies(tmp_path: Path) -> None:
    marker = tmp_path / "child-alive"
    grandchild = f"import time; time.sleep(30); open({str(marker)!r}, 'w')"
    child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {grandchild!r}])"
    plan = [
        python_job("ok", "print('GPU_E2E_RESULT ' + '{\"rows\": 3}')"),
        python_job("bad", "import sys; print('GPU_E2E_RESULT {\"ok\": false}'); sys.exit(1)"),
        python_job("slow", child + "; import time; time.sleep(60)", timeout_s=2),
        python_job("after_bad", "print('ran')", after=("bad",), needs_ok=True),
        python_job("after_ok", "print('ran')", after=("ok",), needs_ok=True),
    ]
    outcomes = jobs.run_jobs(plan, tmp_path / "logs", time.monotonic() + 60, parallel=2, on_event=lambda _: None)
    assert {name: o.status for name, o in outcomes.items()} == {
        "ok": "passed",
        "bad": "failed",
        "slow": "timed out",
        "after_bad": "skipped",
        "after_ok": "passed",
    }
    assert outcomes["ok"].result == {"rows": 3} and outcomes["bad"].result == {"ok": False}
    assert "its timeout" in outcomes["slow"].detail
    time.sleep(1)
    assert not marker.exists()  # the job's child went with it (its process group), it did not outlive the job


def test_jobs_deadline_keeps_what_finished(tmp_path: Path) -> None:
    plan = [
        python_job("quick", "print('GPU_E2E_RESULT {}')"),
        python_job("long", "import time; time.sleep(60)"),
        python_job("queued", "print('never')", after=("long",)),
    ]
    outcomes = jobs.run_jobs(plan, tmp_path, time.monotonic() + 3, parallel=4, on_event=lambda _: None)
    assert outcomes["quick"].status == "passed"
    assert outcomes["long"].status == "timed out" and "deadline" in outcomes["long"].detail
    assert outcomes["queued"].status == "not started"


def test_jobs_refuse_an_unknown_dependency(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown jobs"):
        jobs.run_jobs([python_job("a", "pass", after=("b",))], tmp_path, time.monotonic() + 5, 1)


# ---- the plan and the verdict on a case's result ----


def test_the_cpu_dry_run_leaves_out_only_the_gpu_cases() -> None:
    assert engine_checks.selected(True, None) == [n for n in cases.ALL_CASES if n not in cases.GPU_ONLY]
    assert engine_checks.selected(False, None) == list(cases.ALL_CASES)


def test_cases_on_request_run_only_where_named() -> None:
    """The offload case is a second call's (``--only offload``): the first run's budget and benchmark are unchanged."""
    assert "offload" not in cases.ALL_CASES and "offload" in cases.KNOWN_CASES
    assert engine_checks.selected(False, ["offload"]) == engine_checks.selected(True, ["offload"]) == ["offload"]
    assert device_run.chosen("offload") == (["offload"], False)
    with pytest.raises(SystemExit, match="unknown cases"):
        engine_checks.selected(False, ["offloading"])
    assert cases.verdict("offload", {**good_result("offload"), "offload": {**good_rows(), "tier": False}}, True) == []
    with pytest.raises(SystemExit, match="unknown cases"):
        engine_checks.selected(False, ["nope"])


def good_result(name: str) -> dict[str, Any]:
    case = cases.CASES[name]
    wanted = "native-cuda, native-cpp on cpu" if case.native else "triton on cuda, host-numpy on cpu"
    return {
        "batch": {"rows": 90, "matched": 90, "ok": True},
        "sentinel": {"rows_checked": 500, "zero_rows": 0, "invalid_ids": 0, "steps_checked": 40},
        "engine": {
            "async_scheduling": case.expect_async,
            "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE",
            "workers": [{"kernel_backend": wanted}],
        },
        **({"preemption": {"rows": 10, "matched": 10, "ok": True, "preemptions": 3}} if case.preempt else {}),
        **({"reload": good_reload()} if case.reload else {}),
        **({"sleep": {**good_reload(), "label": "sleep / wake-up"}} if case.sleep else {}),
        **({"offload": {**good_rows(), "loaded": [96, 0, 112, 128], "same_tokens": 4, "tier": True,
                        "next_turn_loaded": [128, 112, 0, 144], "next_turn_past_answer": 2}}
           if case.offload else {}),
    }  # fmt: skip


def good_rows() -> dict[str, Any]:
    return {"rows": 90, "matched": 90, "ok": True}


def good_reload() -> dict[str, Any]:
    exact = {"rows": 105, "matched": 105, "ok": True, "problems": []}
    return {
        "vllm": "0.26.0",
        "same_tokens": [True, True, True],
        "before": dict(exact, rows=315, matched=315),
        "after": dict(exact, rows=315, matched=315),
        "after_first_moe_layer": dict(exact),
        "checked_after": {"rows_checked": 315, "zero_rows": 0, "invalid_ids": 0},
    }


@pytest.mark.parametrize(
    "name, change, failure",
    [
        ("graphs_f32", lambda r: r["batch"].update(matched=88, ok=False), "batch: 2 of 90 rows wrong"),
        ("graphs_f32", lambda r: r["sentinel"].update(rows_checked=0), "counted no rows"),
        ("graphs_f32", lambda r: r["sentinel"].update(zero_rows=4), "always-on check reported"),
        ("graphs_f32", lambda r: r["engine"].update(async_scheduling=False), "async scheduling False, expected True"),
        ("graphs_f32", lambda r: r["engine"].update(cudagraph_mode="CUDAGraphMode.NONE"), "CUDA graphs off"),
        ("graphs_f32_sync_native", lambda r: r["engine"].update(workers=[{"kernel_backend": "triton on cuda"}]),
         "expected native-cuda"),
        ("cache_preempt", lambda r: r["preemption"].update(preemptions=0), "preempted nothing"),
        ("graphs_f32", lambda r: r["reload"]["checked_after"].update(zero_rows=9), "reload_weights: the always-on"),
        ("graphs_f32", lambda r: r["sleep"]["checked_after"].update(invalid_ids=7), "sleep / wake-up: the always-on"),
        ("graphs_f32", lambda r: r.update(sleep={"label": "sleep / wake-up", "not_run": "RuntimeError: x"}),
         "sleep / wake-up not run: RuntimeError: x"),
        ("graphs_f32", lambda r: r.pop("sleep"), "the sleep / wake-up part did not run"),
        ("graphs_f32", lambda r: r["reload"]["after"].update(matched=300, ok=False), "after: 300 of 315 rows exact"),
        ("graphs_f32", lambda r: r["reload"]["after_first_moe_layer"].update(matched=100, ok=False),
         "after_first_moe_layer: 100 of 105"),
        ("graphs_f32", lambda r: r["reload"].update(same_tokens=[True, False, True]), "changed the generated tokens"),
        ("offload", lambda r: r["offload"].update(loaded=[0, 0, 0, 0]), "nothing was loaded through the offload tier"),
        ("offload", lambda r: r["offload"].update(loaded=[None, 0, 9, 0]), "nothing was loaded through the offload"),
        ("offload", lambda r: r["offload"].update(same_tokens=3), "tokens after the reload differ: 3 of 4"),
        ("offload", lambda r: r["offload"].update(matched=80, ok=False), "offload: 10 of 90 rows wrong"),
        ("offload", lambda r: r["offload"].update(next_turn_past_answer=0), "no next turn loaded its answer's rows"),
    ],
)  # fmt: skip
def test_verdict_names_each_failure(name: str, change: Any, failure: str) -> None:
    result = good_result(name)
    assert cases.verdict(name, result, cpu=False) == []
    change(result)
    assert any(failure in line for line in cases.verdict(name, result, cpu=False)), cases.verdict(name, result, False)


def test_verdict_on_the_cpu_does_not_ask_for_gpu_facts() -> None:
    result = good_result("graphs_f32")
    result["engine"] = {"async_scheduling": False, "cudagraph_mode": "CUDAGraphMode.NONE", "workers": []}
    assert cases.verdict("graphs_f32", result, cpu=True) == []


def test_table_shows_rows_oracle_and_the_check() -> None:
    layers = [{"layer": 0, "near_ties": 1, "rows": 40}, {"layer": 2, "near_ties": 0, "rows": 40}]
    consistency = {"verdict": "PASS", "layers": layers}
    result = {**good_result("graphs_f32"), "what": "graphs", "oracle": {"consistency": consistency}}
    lines = engine_checks.table({"graphs_f32": jobs.Outcome("graphs_f32", "passed", 9.0, 0, result)})
    assert lines[2] == "| graphs_f32 | graphs | passed | 90 / 90 | PASS (near-ties L0 1/40, L2 0/40) | 500, 0, 0 |"


def test_native_cases_run_from_the_built_copy_after_the_build(tmp_path: Path) -> None:
    """The case on the native kernel runs the copy's own cases.py with the copy's environment, after the build; every
    other case runs the checkout's, at once."""
    tree = tmp_path / "tree"
    plan = engine_checks.plan(
        list(cases.ALL_CASES), False, tmp_path, {"WHICH": "checkout"}, (tree, {"WHICH": "copy"}), "kernel_build"
    )
    for job in plan:
        native = job.name in cases.CASES and cases.CASES[job.name].native
        root = tree if native else scripts.ROOT
        assert job.command[1] == str(root / "scripts" / "gpu_e2e" / "cases.py"), job.name
        assert job.env["WHICH"] == ("copy" if native else "checkout")
        assert job.after == (("kernel_build",) if native else ())
        assert job.needs_ok and "--cpu" not in job.command
    assert sum(cases.CASES[j.name].native for j in plan if j.name in cases.CASES) == 1


def test_device_jobs_build_in_a_copy_and_test_on_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU run's jobs: the kernel built in a copy of the checkout (never the checkout the running engines import),
    the CUDA tests after it on that copy, every case, and the quiet marker last."""
    monkeypatch.setattr(device_run, "WORK", tmp_path)
    plan = {job.name: job for job in device_run.device_jobs(list(cases.ALL_CASES), tmp_path / "site", tmp_path)}
    tree = tmp_path / "native"
    assert (tree / "scripts" / "gpu_check.py").is_file() and (tree / "tests" / "test_parallel.py").is_file()
    assert not (tree / ".gpu-e2e").exists() and not (tree / ".git").exists() and not list(tree.rglob("*.so"))
    build, tests = plan["kernel_build"], plan["cuda_tests"]
    assert build.cwd == str(tree) and build.command[1:] == [
        str(tree / "scripts/gpu_check.py"),
        "--build-only",
        "--keep-build",
    ]
    assert not build.engine and not tests.engine and tests.after == ("kernel_build",) and tests.needs_ok
    compile(tests.command[2], "<cuda_tests>", "exec")  # the -c program is valid Python
    assert all(name in tests.command[2] for name in device_run.CUDA_TESTS)
    assert set(plan) == {"kernel_build", "cuda_tests", "quiet", *cases.ALL_CASES}
    assert list(plan)[-1] == "quiet" and set(plan["quiet"].after) == {n for n in plan if n not in ("quiet", "bench")}
    assert plan["eager_f32"].env["PYTHONPATH"] == f"{tmp_path / 'site'}{os.pathsep}{scripts.ROOT}"
    assert plan["graphs_f32_sync_native"].env["PYTHONPATH"] == f"{tmp_path / 'site'}{os.pathsep}{tree}"


def test_only_runs_the_kernel_jobs_where_they_are_asked_for_or_needed() -> None:
    assert device_run.chosen("") == (list(cases.ALL_CASES), True)
    assert device_run.chosen("bench,graphs_bf16") == (["graphs_bf16", "bench"], False)
    assert device_run.chosen("graphs_f32_sync_native") == (["graphs_f32_sync_native"], True)
    assert device_run.chosen("cuda_tests") == ([], True)
    assert device_run.chosen("cuda_tests,eager_f32") == (["eager_f32"], True)
    with pytest.raises(SystemExit, match="unknown cases"):
        device_run.chosen("eager")
