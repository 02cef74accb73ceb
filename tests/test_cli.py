"""The console commands: `latentfast demo --quick` and `latentfast bench --quick` end to end."""
from __future__ import annotations

import json
import os
import re
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
    proc = _latentfast("bench", "--quick", "--suite", "normalize", "--suite", "replay", "--out", str(tmp_path / "bench"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    # the replay suite measures memory with torch's profiler: its start/stop logs must not reach the user
    for noise in ("USDT", "profiler_start", "gpuGetDeviceCount", "Memory block of unknown size"):
        assert noise not in output, noise
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert set(report["suites"]) == {"normalize", "replay"} and not report["errors"]
    # every headline ratio is the quotient of two figures of the same row, measured the same way
    normalize = report["suites"]["normalize"]
    summary = normalize["summary"]
    row = next(r for r in normalize["rows"] if round(r["input_MB"], 1) == summary["input_MB"])
    kernel = summary["provider"]
    assert summary["x_eager_both_reuse"] == pytest.approx(row[f"{kernel}_reuse_GBps"] / row["eager_reuse_GBps"], rel=0.01)
    assert summary["x_eager_both_alloc"] == pytest.approx(row[f"{kernel}_alloc_GBps"] / row["eager_alloc_GBps"], rel=0.01)
    assert summary["fraction_of_copy_reuse"] == pytest.approx(row[f"{kernel}_reuse_GBps"] / row["copy_GBps"], rel=0.01)
    replay = report["suites"]["replay"]["summary"]
    assert replay["replay_gradient_max_rel_error"] <= 1e-6
    assert replay["ddp_reductions_per_step_gradient_sync"] < replay["ddp_reductions_per_step_every_replay"]
    _check_tables(proc.stdout)


# a column header names its unit, or is one of these label columns
UNIT = re.compile(r"\bx\b|\bMB\b|MiB|GB/s|MB/s|\bms\b|\bus\b|\(s\)|\(x\)|%|bytes|\(count\)|\(samples\)|\(ratio\)|\(b/micro\)|/ step")
LABEL_COLUMNS = {"provider", "loop", "layout", "reader", "path", "setting", "encode", "features", "gradient sync"}


def _check_tables(text: str) -> None:
    """Every printed table: units in every header, a legend for its baselines, no jargon."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if i and re.fullmatch(r"-+( {2}-+)*", line.strip() or "x")]
    assert len(rules) >= 4, text[-3000:]
    for i in rules:
        spans = [m.span() for m in re.finditer(r"-+", lines[i])]
        header = [lines[i - 1][: end].strip() if k == 0 else lines[i - 1][start:end].strip() for k, (start, end) in enumerate(spans)]
        unnamed = [c for c in header if not UNIT.search(c) and c not in LABEL_COLUMNS]
        assert not unnamed, (lines[i - 1], unnamed)
        after = "\n".join(lines[i + 1 : i + 40])
        assert "legend" in after or re.search(r"^  \S+: ", after, re.M), lines[i - 1]  # a legend follows the table
    assert "spec's way" not in text  # baselines are named for what they are


def test_bench_rejects_unknown_suite(tmp_path):
    proc = _latentfast("bench", "--suite", "nope", "--out", str(tmp_path))
    # argparse refuses it and lists the choices (run_benchmarks still refuses unknown names from Python)
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr and "'normalize', 'decode'" in proc.stderr


def test_help_says_where_output_goes():
    demo = _latentfast("demo", "--help")
    assert demo.returncode == 0 and "summary.json" in demo.stdout and "default:" in demo.stdout and "latentfast-demo" in demo.stdout
    bench = _latentfast("bench", "--help")
    assert bench.returncode == 0 and "bench.json" in bench.stdout and "--out" in bench.stdout


def test_cache_subcommands_are_wired():
    proc = _latentfast("cache", "--help")
    assert proc.returncode == 0 and all(word in proc.stdout for word in ("build", "inspect", "verify"))
