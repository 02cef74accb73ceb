"""First-use papercuts, each as a new user met it: the top-level help lists every command, progress
reaches a log (not only a terminal), a rerun that writes nothing says "up to date", --device auto,
no "install accelerate" warning on a VAE load, a remote verify that does not speak of the page cache,
a push without settings that names them in one line, describe() that leads with what a user needs."""
from __future__ import annotations

import contextlib
import http.server
import io
import logging
import os
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from PIL import Image

import latentfast
from latentfast.cache import LatentCache
from latentfast.cache.cli import main as cache_main


def latentfast_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "latentfast", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(80, 60), (60, 80), (70, 70), (96, 48)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
    return str(folder)


BUILD = ("--encoder", "toy", "--resolution", "64", "--min-bucket", "32", "--max-bucket", "128", "--bucket-step", "32")


def _npz_folder(folder) -> str:
    os.makedirs(folder)
    rng = np.random.default_rng(1)
    for i in range(3):
        np.savez(os.path.join(folder, f"a{i}.npz"), latents=rng.standard_normal((4, 8, 8)).astype(np.float32))
    return str(folder)


# -- progress in a log ---------------------------------------------------------------------------------
def test_progress_bar_is_tqdm_on_a_terminal_and_lines_in_a_log(monkeypatch):
    from tqdm import tqdm

    from latentfast.progress import LogProgress, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress_bar(total=3, desc="x", file=Terminal()), tqdm)
    monkeypatch.setenv("LATENTFAST_PROGRESS_INTERVAL", "0")  # a line at every update: no clock in the test
    log = io.StringIO()
    bar = progress_bar(total=3, initial=1, desc="latent cache", unit="images", file=log)
    assert isinstance(bar, LogProgress)
    bar.update(1)
    bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("latent cache: 2/3 images (67%)") and lines[1].startswith("latent cache: 3/3 images (100%)")
    assert len(lines) == 3 and lines[2].startswith("latent cache: 3/3 images")  # the last count again at close
    quiet = io.StringIO()
    progress_bar(total=3, file=quiet, disable=True).update(3)
    assert quiet.getvalue() == ""
    monkeypatch.setenv("LATENTFAST_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="LATENTFAST_PROGRESS_INTERVAL must be a number of seconds >= 0, got 'soon'"):
        progress_bar(total=3, file=io.StringIO())


@pytest.mark.slow
def test_build_and_import_print_progress_lines_into_a_log(photos, tmp_path):
    """Before: tqdm(disable=None) printed nothing when stderr was not a terminal (nohup, torchrun, SLURM)."""
    env = {"LATENTFAST_PROGRESS_INTERVAL": "0"}
    build = latentfast_cli("cache", "build", "--images", photos, "--out", str(tmp_path / "out"), *BUILD,
                           "--batch-size", "2", env=env)
    assert build.returncode == 0, build.stderr
    assert "latent cache: 2/4 images (50%)" in build.stderr and "latent cache: 4/4 images (100%)" in build.stderr
    imported = latentfast_cli("cache", "import", _npz_folder(tmp_path / "npz"), "--out", str(tmp_path / "imp"),
                              "--format", "npz", env=env)
    assert imported.returncode == 0, imported.stderr
    assert "import: 3/3 files (100%)" in imported.stderr
    quiet = latentfast_cli("cache", "build", "--images", photos, "--out", str(tmp_path / "q"), *BUILD, "--quiet", env=env)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""


def test_bench_says_a_suite_is_still_running_in_a_log(monkeypatch, tmp_path):
    """Before: `latentfast bench` printed nothing for minutes while a suite measured."""
    from latentfast import bench_runner

    log = io.StringIO()

    def run_report(quick):  # a suite that finishes once the log has shown it is alive (no sleep to tune)
        deadline = time.monotonic() + 60
        while "bench normalize: still running" not in log.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"ok": True}

    monkeypatch.setenv("LATENTFAST_PROGRESS_INTERVAL", "0")
    monkeypatch.setattr(bench_runner, "load_suite", lambda name: types.SimpleNamespace(run_report=run_report))
    with contextlib.redirect_stderr(log), contextlib.redirect_stdout(io.StringIO()):
        results = bench_runner.run_benchmarks(out_dir=str(tmp_path), quick=True, suites=["normalize"])
    assert results["suites"] == {"normalize": {"ok": True}}
    assert "bench normalize: still running (" in log.getvalue()


@pytest.mark.slow
def test_push_and_pull_print_progress_lines(tmp_path, monkeypatch, capsys):
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    from latentfast.testing import create_bucket, s3_server, write_random_cache

    folder = write_random_cache(str(tmp_path), 5, 2, 4, 6, layouts=("ragged",))["ragged"]
    monkeypatch.setenv("LATENTFAST_PROGRESS_INTERVAL", "0")
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    n_files = len(os.listdir(folder))
    with s3_server() as endpoint:
        create_bucket(endpoint, "pcuts")
        assert cache_main(["cache", "push", folder, "s3://pcuts/c", "--endpoint-url", endpoint]) == 0
        assert f"push: {n_files}/{n_files} files (100%)" in capsys.readouterr().err
        assert cache_main(["cache", "pull", "s3://pcuts/c", str(tmp_path / "back"), "--endpoint-url", endpoint]) == 0
        assert f"pull: {n_files}/{n_files} files (100%)" in capsys.readouterr().err


# -- diffusers' accelerate warning -----------------------------------------------------------------------
def test_loading_a_vae_prints_no_install_accelerate_warning(tmp_path):
    """Before: every `cache build --encoder diffusers:...` printed diffusers' "install accelerate" warning."""
    diffusers = pytest.importorskip("diffusers")
    import importlib.util

    from latentfast.encoders import load_diffusers_vae

    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is installed: diffusers has nothing to warn about")
    torch.manual_seed(0)
    diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                            layers_per_block=1).save_pretrained(str(tmp_path / "vae"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    library = logging.getLogger("diffusers")  # (it does not propagate to the root logger: its own handler prints)
    library.addHandler(handler)
    try:
        load_diffusers_vae(str(tmp_path / "vae"))
        library.getChild("models.modeling_utils").warning("another warning")  # the others still reach the log
    finally:
        library.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]


def test_the_accelerate_filter_drops_that_warning_only():
    from latentfast.encoders import NoAccelerateWarning

    def record(msg, level=logging.WARNING):
        return logging.LogRecord("diffusers.models.modeling_utils", level, __file__, 1, msg, None, None)

    keep = NoAccelerateWarning()
    assert not keep.filter(record("Cannot initialize model with low cpu memory usage because `accelerate` was not found "
                                  "in the environment. Defaulting to `low_cpu_mem_usage=False`."))
    assert keep.filter(record("Passed `torch_dtype` x is not a `torch.dtype`. Defaulting to `torch.float32`."))


# -- describe() --------------------------------------------------------------------------------------------
def test_describe_leads_with_what_a_user_needs():
    """Before: ~30 lines of internal *_into op names, nothing on object storage or cold reads."""
    report = latentfast.describe()
    lines = report.splitlines()
    assert lines[0].startswith(f"latentfast {latentfast.__version__} (torch {torch.__version__}")
    assert lines[1].startswith("  native library: ")
    for label in ("threads: ", "GPU: ", "triton: ", "object storage (s3://, gs://, az:// caches): ", "cold cache reads: "):
        assert any(line.startswith("  " + label) for line in lines), (label, report)
    assert f"threads: {torch.get_num_threads()} " in report
    assert "_into" not in report and len(lines) <= 12
    assert "obstore" in report or "obstore is not installed" in report
    verbose = latentfast.describe(verbose=True)
    assert verbose.startswith(report.rsplit("\n", 1)[0]) and all(op in verbose for op in latentfast._ops.SCHEMAS)
