"""The verdicts of ``bench/gpu_check.sh``, in Python so a CPU test can check them.

    python -m latentfast.bench.gpu_check_summary tests REPORT.xml PYTEST_EXIT   # one line: "passed: ..." or "FAILED ..."
    python -m latentfast.bench.gpu_check_summary bench OUT_DIR                   # the suites' summaries from OUT_DIR/bench_*.json

Run by path (it imports nothing of latentfast), so it works even when the build failed.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import xml.etree.ElementTree as ET


def tests_verdict(junit_path: str, exit_code: int) -> tuple[bool, str]:
    """Whether the GPU tests passed, and a one-line account. A skipped test fails the check: on a GPU
    machine a skip means a GPU path was not exercised (the skip reasons are in the pytest log)."""
    try:
        suites = list(ET.parse(junit_path).getroot().iter("testsuite"))
    except (OSError, ET.ParseError):
        timed_out = ", timed out" if exit_code in (124, 137) else ""
        return False, f"FAILED: no test report (pytest exit {exit_code}{timed_out})"
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts = ", ".join(f"{v} {k}" for k, v in total.items())
    if exit_code != 0 or total["failures"] or total["errors"]:
        return False, f"FAILED (pytest exit {exit_code}): {counts}"
    if total["tests"] == 0:
        return False, f"FAILED: no gpu test ran ({counts})"
    if total["skipped"]:
        return False, f"FAILED: {counts} (a skipped gpu test is a failure here)"
    return True, f"passed: {counts}"


def bench_lines(out_dir: str) -> list[str]:
    """Every suite's summary figures (and errors) from ``out_dir/bench_<suite>.json``."""
    lines = []
    for path in sorted(glob.glob(os.path.join(out_dir, "bench_*.json"))):
        with open(path) as fh:
            data = json.load(fh)
        for suite, report in data.get("suites", {}).items():
            lines.append(f"[{suite}]")
            lines += [f"  {key:<52} {value}" for key, value in (report.get("summary") or {}).items()]
        lines += [f"[{suite}] FAILED: {err}" for suite, err in data.get("errors", {}).items()]
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["tests"] and len(argv) == 3:
        ok, line = tests_verdict(argv[1], int(argv[2]))
        print(line)
        return 0 if ok else 1
    if argv[:1] == ["bench"] and len(argv) == 2:
        print("\n".join(bench_lines(argv[1])) or "no benchmark figures")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
