"""The console commands: `latentfast demo --quick` and `latentfast bench --quick` end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from latentfast.demo import STAGES


def _latentfast(*args, cwd=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "latentfast.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_quick_writes_every_stage(tmp_path):
    proc = _latentfast("demo", "--quick", "--out", str(tmp_path / "demo"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert set(summary["stages"]) == set(STAGES)
    for name, stage in summary["stages"].items():
        assert "error" not in stage, (name, stage)
        assert stage["value"] == stage["value"], name  # not NaN
    assert summary["stages"]["replay"]["value"] <= 1e-5
    assert summary["stages"]["train"]["last_loss"] > 0
    assert "ratio" in proc.stdout and "summary:" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_quick_writes_json(tmp_path):
    proc = _latentfast("bench", "--quick", "--suite", "normalize", "--suite", "balance", "--out", str(tmp_path / "bench"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert set(report["suites"]) == {"normalize", "balance"} and not report["errors"]
    assert report["suites"]["normalize"]["summary"]["x_eager_both_reuse"] > 0


def test_bench_rejects_unknown_suite(tmp_path):
    proc = _latentfast("bench", "--suite", "nope", "--out", str(tmp_path))
    assert proc.returncode != 0 and "unknown suite" in (proc.stdout + proc.stderr)


def test_cache_subcommands_are_wired():
    proc = _latentfast("cache", "--help")
    assert proc.returncode == 0 and all(word in proc.stdout for word in ("build", "inspect", "verify"))
