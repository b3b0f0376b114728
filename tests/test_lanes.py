# SPDX-License-Identifier: Apache-2.0
"""``scripts/lanes.py`` (make test's two lanes) and the venv script's rule that lets lanes share a venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import scripts

lanes = scripts.load("scripts/lanes.py", "_lanes_under_test")
venv_script = scripts.load("scripts/venv.py", "_venv_script_for_lanes")

# wait-for-flag passes only if flag, made by another lane, appears within 5 s: the lanes really overlap.
MAKEFILE = """\
wait-for-flag:
\t@for i in $$(seq 50); do if [ -f flag ]; then echo saw-flag; exit 0; fi; sleep 0.1; done; exit 1
flag:
\t@touch flag; echo made-flag
broken:
\t@echo about-to-fail; exit 3
pytest-like:
\t@echo "FAILED tests/e2e/test_x.py::test_y - AssertionError: 3 != 4"; echo "1 failed, 2 passed"; exit 1
after:
\t@echo after-ran
skipping:
\t@echo "SKIPPED: no nvcc on PATH"
"""

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def run(tmp_path: Path, *argv: str) -> tuple[int, str]:
    (tmp_path / "Makefile").write_text(MAKEFILE)
    done = subprocess.run(
        [sys.executable, str(scripts.ROOT / "scripts" / "lanes.py"), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout


@needs_make
def test_two_targets_run_at_the_same_time_and_tag_their_lines(tmp_path: Path) -> None:
    code, out = run(tmp_path, "wait-for-flag", "flag")
    assert code == 0, out
    assert "[wait-for-flag] saw-flag" in out.splitlines() and "[flag] made-flag" in out.splitlines()


@needs_make
def test_one_job_runs_the_targets_one_after_another(tmp_path: Path) -> None:
    code, out = run(tmp_path, "--jobs", "1", "wait-for-flag", "flag")
    assert code == 1, out  # the flag's target starts only after the waiting one gave up
    lines = out.splitlines()
    assert max(i for i, line in enumerate(lines) if line.startswith("[wait-for-flag]")) < min(
        i for i, line in enumerate(lines) if line.startswith("[flag]")
    )


@needs_make
def test_a_failed_target_fails_the_run_and_the_others_go_on(tmp_path: Path) -> None:
    code, out = run(tmp_path, "--jobs", "1", "broken", "after", "flag")
    assert code == 1
    assert "[broken] about-to-fail" in out and "[after] after-ran" in out and "[flag] made-flag" in out
    table = out[out.index("lanes: ") :]
    assert "broken" in table and "FAILED" in table
    assert [line.split()[-1] for line in table.splitlines() if line.strip().startswith(("after", "flag"))] == [
        "ok",
        "ok",
    ]


@needs_make
def test_the_end_of_the_run_names_what_each_failed_target_failed(tmp_path: Path) -> None:
    code, out = run(tmp_path, "--jobs", "1", "pytest-like", "broken", "after")
    assert code == 1
    recap = out[out.index("lanes: ") :].splitlines()
    start = recap.index("pytest-like failed (exit 2):")  # make's exit status for a failed recipe
    assert recap[start + 1] == "  FAILED tests/e2e/test_x.py::test_y - AssertionError: 3 != 4"
    assert recap[start + 2] == "broken failed (exit 2):" and recap[start + 3] == "  about-to-fail"  # no FAILED line
    assert not any(line.startswith("after failed") for line in recap)


@needs_make
def test_a_target_that_says_skipped_is_not_ok(tmp_path: Path) -> None:
    code, out = run(tmp_path, "--jobs", "1", "skipping", "after")
    assert code == 0, out
    table = out[out.index("lanes: ") :]
    assert [
        line.split(None, 3)[-1] for line in table.splitlines() if line.strip().startswith(("skipping", "after"))
    ] == [
        "skipped (no nvcc on PATH)",
        "ok",
    ]


@needs_make
@pytest.mark.parametrize("require", ["", "vllm,nvcc"])
def test_test_native_without_nvcc_says_skipped_or_fails_where_required(tmp_path: Path, require: str) -> None:
    """The real Makefile's test-native with no nvcc on PATH: never a silent ok."""
    nvcc = shutil.which("nvcc")
    directories = os.environ["PATH"].split(os.pathsep)
    if nvcc is not None:  # that directory's other tools stay reachable, nvcc does not
        shadow = tmp_path / "bin"
        shadow.mkdir()
        for tool in Path(nvcc).parent.iterdir():
            if tool.name != "nvcc":
                (shadow / tool.name).symlink_to(tool)
        directories = [str(shadow), *(d for d in directories if Path(d) != Path(nvcc).parent)]
    done = subprocess.run(
        ["make", "--no-print-directory", "test-native"],
        cwd=scripts.ROOT,
        env={**os.environ, "PATH": os.pathsep.join(directories), "VLLM_ASCEND_ROUTING_TEST_REQUIRE": require},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if require:
        assert done.returncode != 0 and "requires it" in done.stdout, done.stdout + done.stderr
    else:
        assert done.returncode == 0 and done.stdout.startswith(lanes.SKIPPED), done.stdout + done.stderr


@needs_make
def test_the_queue_runs_two_targets_at_once_tagged_by_target(tmp_path: Path) -> None:
    code, out = run(tmp_path, "--jobs", "2", "wait-for-flag", "flag", "after")
    assert code == 0, out
    lines = out.splitlines()
    assert "[wait-for-flag] saw-flag" in lines and "[flag] made-flag" in lines and "[after] after-ran" in lines
    table = out[out.index("lanes: ") :]
    assert "worker 1" in table and "worker 2" in table


@needs_make
def test_the_queue_goes_on_after_a_failure_and_records_each_targets_seconds(tmp_path: Path) -> None:
    history = tmp_path / "cache" / "lane-seconds.json"
    code, out = run(tmp_path, "--jobs", "1", "--history", str(history), "broken", "after")
    assert code == 1 and "[after] after-ran" in out, out
    recorded = json.loads(history.read_text())
    assert set(recorded) == {"broken", "after"} and all(seconds >= 0 for seconds in recorded.values())


def test_targets_kept_apart_never_overlap_and_nothing_waits_forever() -> None:
    """A worker skips a target that clashes with a running one, takes the next, and waits when only clashing
    ones are left; every target still runs once."""
    queue = lanes.Queue([lanes.Stage(name) for name in ("shm-e2e", "shm-ascend", "other")], [{"shm-e2e", "shm-ascend"}])
    first = queue.take()
    second = queue.take()
    assert first is not None and second is not None
    assert (first.target, second.target) == ("shm-e2e", "other")  # shm-ascend skipped while shm-e2e runs
    taken: list[str] = []
    waiter = threading.Thread(target=lambda: taken.append(getattr(queue.take(), "target", "")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not taken  # only a clashing target is left: it waits
    queue.done(first)
    waiter.join(5)
    assert taken == ["shm-ascend"]
    queue.done(second)
    assert queue.take() is None


def test_the_queue_is_longest_first_by_last_time_and_new_targets_lead() -> None:
    history = {"short": 60.0, "long": 1500.0, "middle": 300.0}
    assert lanes.longest_first(["short", "new", "middle", "long", "newer"], history) == [
        "new",
        "newer",
        "long",
        "middle",
        "short",
    ]


def test_an_unreadable_history_orders_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "history.json"
    broken.write_text("{not json")
    assert lanes.read_history(str(broken)) == {} and lanes.read_history(str(tmp_path / "absent.json")) == {}
    broken.write_text('["a list"]')
    assert lanes.read_history(str(broken)) == {}


def test_the_checkout_is_reinstalled_only_when_its_sources_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane asking for a venv another lane runs tests in must not reinstall the package under it."""
    installs: list[tuple[str, ...]] = []
    monkeypatch.setattr(venv_script, "pip", lambda py, *args: installs.append(args))
    monkeypatch.setattr(venv_script, "checkout_wheel", lambda py, digest: Path(f"{digest}.whl"))
    digest = ["first"]
    monkeypatch.setattr(venv_script, "checkout_digest", lambda: digest[0])
    venv_script.install_checkout(tmp_path)
    venv_script.install_checkout(tmp_path)
    assert len(installs) == 1 and json.loads((tmp_path / "vllm_ascend_routing.checkout.json").read_text()) == "first"
    digest[0] = "second"  # an edited source file
    venv_script.install_checkout(tmp_path)
    assert len(installs) == 2
    digest[0] = None  # not a git checkout: nothing to compare, always reinstall
    venv_script.install_checkout(tmp_path)
    venv_script.install_checkout(tmp_path)
    assert len(installs) == 4


def test_the_checkout_digest_follows_the_package_sources() -> None:
    if shutil.which("git") is None or not (scripts.ROOT / ".git").exists():
        pytest.skip("not a git checkout (the digest is None there, tested above)")
    first = venv_script.checkout_digest()
    assert first is not None and first == venv_script.checkout_digest()
    probe = scripts.ROOT / "vllm_ascend_routing" / "_lanes_digest_probe.py"
    try:
        probe.write_text("# untracked, not ignored: it would be in the wheel\n")
        assert venv_script.checkout_digest() != first
    finally:
        probe.unlink()
    assert venv_script.checkout_digest() == first


def test_the_checkout_wheel_is_built_once_per_digest_and_installed_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each venv installs the one wheel of the checkout's sources: no venv builds in the checkout's build/ while
    another does, and the second venv's install costs no build."""
    built: list[str] = []

    def fake_run(cmd: list[str]) -> None:
        assert cmd[1:4] == ["-m", "pip", "wheel"] and "--no-deps" in cmd
        out = Path(cmd[cmd.index("-w") + 1])
        out.mkdir(parents=True)
        (out / "vllm_ascend_routing-0.0.0-py3-none-any.whl").write_text("wheel")
        built.append(str(out))

    installs: list[tuple[str, ...]] = []
    monkeypatch.setattr(venv_script, "run", fake_run)
    monkeypatch.setattr(venv_script, "pip", lambda py, *args: installs.append(args))
    monkeypatch.setattr(venv_script, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(venv_script, "checkout_digest", lambda: "d1")
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_TARGET_DEVICE", raising=False)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        venv_script.install_checkout(tmp_path / name)
    wheel = tmp_path / "cache" / "checkout-wheels" / "d1" / "vllm_ascend_routing-0.0.0-py3-none-any.whl"
    assert len(built) == 1 and installs == [("--no-deps", "--force-reinstall", str(wheel))] * 2, (built, installs)
    wheels = tmp_path / "cache" / "checkout-wheels"
    os.utime(wheels / "d1", (1, 1))
    for age, digest in enumerate(("d2", "d3", "d4", "d5", "d6"), start=2):
        venv_script.checkout_wheel(Path("python"), digest)
        os.utime(wheels / digest, (age, age))  # each newer than the last, whatever the clock's resolution
    kept = sorted(path.name for path in wheels.iterdir() if path.is_dir())
    assert len(kept) == 5 and "d6" in kept and "d1" not in kept, kept
    # A native build is the venv's own: built in the checkout, never a shared wheel.
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_TARGET_DEVICE", "cpu")
    monkeypatch.setattr(venv_script, "checkout_digest", lambda: "d7")
    venv_script.install_checkout(tmp_path / "a")
    assert installs[-1][-1] == str(venv_script.ROOT) and len(built) == 6
