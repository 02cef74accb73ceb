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


# -- the help ------------------------------------------------------------------------------------------
def test_top_level_help_lists_every_command():
    """Before: `latentfast --help` listed cache build | import | inspect | verify, not push, pull, merge."""
    from latentfast.cli import build_parser, command_names

    leaves = command_names(build_parser())
    assert {"demo", "bench", "cache build", "cache import", "cache merge", "cache inspect", "cache verify", "cache push",
            "cache pull"} <= set(leaves)
    text = " ".join(latentfast_cli("--help").stdout.split())
    assert [leaf for leaf in leaves if leaf not in text] == [], text
    cache = " ".join(latentfast_cli("cache", "--help").stdout.split())
    assert "{" + ",".join(leaf.split()[1] for leaf in leaves if leaf.startswith("cache ")) + "}" in cache


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


def test_the_cli_flushes_every_line_into_a_log():
    """stdout to a file or pipe is block-buffered: a bench suite's tables reached the log at the end."""
    code = ("import atexit, sys; from latentfast import cli; "
            "atexit.register(lambda: print('LB', sys.stdout.line_buffering, file=sys.stderr)); cli.main(['cache', 'inspect', '/none'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LB True" in proc.stderr, proc.stderr


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


# -- a rerun that writes nothing -----------------------------------------------------------------------
def test_a_rerun_that_changes_nothing_says_up_to_date(photos, tmp_path, capsys):
    """Before: every rerun printed `latent cache written: ...`, as if it had written something."""
    out = str(tmp_path / "out")
    assert cache_main(["cache", "build", "--images", photos, "--out", out, *BUILD]) == 0
    assert "latent cache written" in capsys.readouterr().out
    assert cache_main(["cache", "build", "--images", photos, "--out", out, *BUILD]) == 0
    rerun = capsys.readouterr().out
    assert "up to date: 4 unchanged" in rerun and "written" not in rerun
    src = _npz_folder(tmp_path / "npz")
    args = ["cache", "import", src, "--out", str(tmp_path / "imp"), "--format", "npz"]
    assert cache_main(args) == 0 and "latent cache written" in capsys.readouterr().out
    assert cache_main(args) == 0
    rerun = capsys.readouterr().out
    assert "up to date: 3 unchanged" in rerun and "written" not in rerun


# -- --device --------------------------------------------------------------------------------------------
def test_device_defaults_to_auto_and_says_what_it_picked(photos, tmp_path, capsys):
    """Before: --device defaulted to cpu, so a GPU user encoded on the CPU without a word."""
    from latentfast.cache.cli import pick_device
    from latentfast.cli import build_parser

    assert build_parser().parse_args(["cache", "build", "--images", "x", "--out", "y"]).device == "auto"
    assert cache_main(["cache", "build", "--images", photos, "--out", str(tmp_path / "o"), *BUILD]) == 0
    expect = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"--device auto: {expect} (" in capsys.readouterr().out
    assert pick_device("cpu") == ("cpu", None)


def test_auto_picks_a_visible_gpu(monkeypatch):
    from latentfast.cache.cli import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Test GPU")
    device, line = pick_device("auto")
    assert device == "cuda" and line == "--device auto: cuda (Test GPU; --device cpu encodes on the CPU)"


def test_device_cuda_on_a_cpu_only_torch_is_refused_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """Before: the model was loaded, then moving it failed inside torch ('Torch not compiled with CUDA')."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    model = tmp_path / "no-model-here"  # loading it would fail with a different error (no config.json)
    code = cache_main(["cache", "build", "--images", str(tmp_path), "--out", str(tmp_path / "o"),
                       "--encoder", f"diffusers:{model}", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--device cuda: torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)" in err
    assert "config.json" not in err


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


# -- object storage: verify's rate, a push without settings ------------------------------------------------
@pytest.fixture
def aws_env(monkeypatch):
    """No AWS_* variable of the machine; the instance metadata service a client asks for credentials is a
    loopback server that refuses (as outside a cloud), so nothing leaves the machine."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self):
            self.send_response(403)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"deny")

        do_GET = do_PUT = do_POST = do_HEAD = _refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield monkeypatch
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_remote_verify_reports_its_rate_from_object_storage(tmp_path, aws_env, capsys):
    """Before: `cache verify s3://...` said "GB/s, from the page cache if the file was read recently"."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    from latentfast.testing import create_bucket, s3_server, write_random_cache

    folder = write_random_cache(str(tmp_path), 9, 2, 4, 6, layouts=("padded",))["padded"]
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        aws_env.setenv(key, value)
    with s3_server() as endpoint:
        create_bucket(endpoint, "pcuts")
        assert cache_main(["cache", "push", folder, "s3://pcuts/v", "--endpoint-url", endpoint]) == 0
        capsys.readouterr()
        assert cache_main(["cache", "verify", "s3://pcuts/v", "--endpoint-url", endpoint]) == 0
        out = capsys.readouterr().out
        assert "verify OK: 9 rows" in out and "page cache" not in out and "GB/s" not in out
        assert "/s verified, fetched from object storage" in out
        local = tmp_path / "chunks"
        assert cache_main(["cache", "verify", "s3://pcuts/v", "--endpoint-url", endpoint, "--local-cache", str(local)]) == 0
        assert f"fetched from object storage or read from the local chunk cache {local}" in capsys.readouterr().out
    assert cache_main(["cache", "verify", folder]) == 0
    assert "page cache" in capsys.readouterr().out  # a local cache: the rate is the disk's or the page cache's


@pytest.mark.slow
def test_push_without_endpoint_or_credentials_names_them_in_one_line(tmp_path, aws_env, capsys):
    """Before: one long line of the client's debug output (RetryError { ... }) and no word of what to set."""
    pytest.importorskip("obstore")
    from latentfast.testing import write_random_cache

    folder = write_random_cache(str(tmp_path), 3, 2, 4, 6, layouts=("padded",))["padded"]
    assert cache_main(["cache", "push", folder, "s3://pcuts/x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Debug source" not in err and "RetryError" not in err, err
    assert "AWS_ENDPOINT_URL or --endpoint-url" in err and "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err
    assert "403 Forbidden" in err  # what the client met, in brief
    aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # an endpoint, still no credentials: only those named
    assert cache_main(["cache", "pull", "s3://pcuts/x", str(tmp_path / "back")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in err and "--endpoint-url" not in err


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
