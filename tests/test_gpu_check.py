"""bench/gpu_check.sh cannot pass without a GPU: it stops within seconds, naming what is missing, and its
verdict on the GPU tests counts a skipped test as a failure."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from latentfast.bench import gpu_check_summary

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run in full")
@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/python3"])
def test_refuses_within_seconds_without_a_gpu(tmp_path, python):
    # its own session, so that a check which wrongly goes on (to pip, the tests) is stopped whole
    proc = subprocess.Popen(["bash", str(ROOT / "bench" / "gpu_check.sh")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHON=python, OUT=str(tmp_path), BUDGET="60"))
    try:
        stdout, stderr = proc.communicate(timeout=300)  # a hang guard
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 2, stdout + stderr
    assert "gpu_check: FAILED, no CUDA GPU" in stdout, stdout
    if python == sys.executable:  # the reason names what is missing: a CUDA build of torch, or a GPU
        import torch
        reason = "sees no CUDA GPU" if torch.version.cuda else "is built without CUDA"
        assert reason in stdout, stdout
    assert "### python environment" not in stdout, "it went on past the GPU step"  # refused at once
    assert "### build" not in stdout, "nothing may be built or run without a GPU"


def _junit(tmp_path, tests=0, failures=0, errors=0, skipped=0) -> str:
    path = tmp_path / "report.xml"
    path.write_text(f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="{errors}" '
                    f'skipped="{skipped}"/></testsuites>')
    return str(path)


def test_verdict_counts_a_skip_as_a_failure(tmp_path):
    assert gpu_check_summary.tests_verdict(_junit(tmp_path, tests=12), 0) == (True, "passed: 12 tests, 0 failures, "
                                                                                    "0 errors, 0 skipped")
    ok, line = gpu_check_summary.tests_verdict(_junit(tmp_path, tests=12, skipped=1), 0)
    assert not ok and "a skipped gpu test is a failure" in line
    ok, line = gpu_check_summary.tests_verdict(_junit(tmp_path, tests=0), 5)
    assert not ok
    ok, line = gpu_check_summary.tests_verdict(_junit(tmp_path, tests=0), 0)
    assert not ok and "no gpu test ran" in line
    ok, line = gpu_check_summary.tests_verdict(_junit(tmp_path, tests=3, failures=1), 1)
    assert not ok and "1 failures" in line
    ok, line = gpu_check_summary.tests_verdict(str(tmp_path / "missing.xml"), 124)
    assert not ok and "timed out" in line


def test_results_table_reads_every_suite(tmp_path):
    (tmp_path / "bench_normalize.json").write_text('{"suites": {"normalize": {"summary": {"x_eager_both_reuse": 4.2}}}}')
    (tmp_path / "bench_decode.json").write_text('{"suites": {}, "errors": {"decode": "RuntimeError: boom"}}')
    lines = gpu_check_summary.bench_lines(str(tmp_path))
    assert "[decode] FAILED: RuntimeError: boom" in lines
    assert "[normalize]" in lines and any("x_eager_both_reuse" in line and "4.2" in line for line in lines)
