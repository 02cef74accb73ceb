"""Crash safety: a build killed with SIGKILL (a real subprocess) never opens as complete, and
rerunning the same command resumes it to a cache byte-identical to an uninterrupted build.
Crashes inside the final renames are simulated at every filesystem step."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from latentfast.cache import IncompleteCacheError, LatentCache, cache_path
from latentfast.testing import progress_lines, run_until_held
from latentfast.toy import ToyVAE
from test_cache import build, cache_files, make_lines

# The same command each time (the fourth argument: hold before encode call N, see hold_when; the
# white-column probe is call 1), so the kill lands after a known number of batches however loaded the
# machine is.
BUILD_SCRIPT = """
import sys
from latentfast.cache import build_latent_cache
from latentfast.testing import hold_when
from latentfast.toy import ToyVAE

class CountingToyVAE(ToyVAE):
    calls = 0
    def encode(self, images):
        CountingToyVAE.calls += 1
        hold_when(CountingToyVAE.calls == int(sys.argv[4]))
        return super().encode(images)

manifest, out, layout = sys.argv[1:4]
build_latent_cache(CountingToyVAE(), manifest, out, line_height=16, max_line_width=96, batch_size=2, layout=layout, quiet=True)
print("encode calls", CountingToyVAE.calls)
"""


def _run_and_kill(cmd, progress_path: str, marker: str, batches: int) -> int:
    """Runs the build until it has logged ``batches`` more batches and holds before the next; kills it."""
    logged = max(progress_lines(progress_path) - 1, 0)
    run_until_held(cmd + [str(1 + batches + 1)], marker, progress=progress_path, min_lines=1 + logged + batches)
    return progress_lines(progress_path) - 1


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only
@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_sigkill_and_resume_is_byte_identical(tmp_path, layout):
    manifest = make_lines(str(tmp_path), n=30, seed=7)
    batches = 15
    out = str(tmp_path / "out")
    progress = cache_path(out, "train", "progress")
    cmd = [sys.executable, "-c", BUILD_SCRIPT, manifest, out, layout]
    marker = str(tmp_path / "held")

    done = _run_and_kill(cmd, progress, marker, batches=2)
    assert done == 2
    with pytest.raises(IncompleteCacheError, match="resume"):
        LatentCache(out)
    done_again = _run_and_kill(cmd, progress, marker, batches=4)  # killed again, later
    assert done_again == done + 4
    with pytest.raises(IncompleteCacheError):
        LatentCache(out)

    finished = subprocess.run(cmd + ["0"], capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr
    # Only the batches not yet logged are encoded again (plus the white-column probe).
    assert f"encode calls {1 + batches - done_again}" in finished.stdout
    assert not os.path.exists(progress)

    reference = str(tmp_path / "reference")
    build(manifest, reference, batch_size=2, layout=layout)
    assert cache_files(out) == cache_files(reference)
    assert len(LatentCache(out)) == 30


class _Crash(Exception):
    pass


@pytest.mark.parametrize("start_from", ["empty", "old padded cache"])
def test_crash_at_every_step_of_finalize(tmp_path, monkeypatch, start_from):
    """Interrupt the final renames/removals at each step in turn: the folder either refuses to
    open (incomplete) or holds a complete, consistent cache, and a rerun finishes it."""
    manifest = make_lines(str(tmp_path), n=10, seed=3)
    refs = {layout: str(tmp_path / f"ref-{layout}") for layout in ("padded", "ragged")}
    for layout, folder in refs.items():
        build(manifest, folder, layout=layout)
    real_replace, real_remove = os.replace, os.remove
    step = 0
    while True:
        step += 1
        out = str(tmp_path / f"out{step}")
        if start_from != "empty":
            shutil.copytree(refs["padded"], out)
        calls = 0

        def failing(real):
            def call(*args):
                nonlocal calls
                calls += 1
                if calls == step:
                    raise _Crash
                return real(*args)
            return call

        monkeypatch.setattr(os, "replace", failing(real_replace))
        monkeypatch.setattr(os, "remove", failing(real_remove))
        try:
            build(manifest, out, layout="ragged")
            crashed = False
        except _Crash:
            crashed = True
        monkeypatch.setattr(os, "replace", real_replace)
        monkeypatch.setattr(os, "remove", real_remove)
        if not crashed:
            break  # every step has been interrupted once
        try:
            cache = LatentCache(out)
        except IncompleteCacheError:
            pass
        else:  # a complete cache: the old one untouched, or the new one finished
            wanted = {os.path.basename(cache_path(out, "train", k)) for k in ("data", "widths", "meta", "white", "checksums")}
            if cache.layout == "ragged":
                wanted.add(os.path.basename(cache_path(out, "train", "offsets")))
            have = {k: v for k, v in cache_files(out).items() if k in wanted}
            assert have == {k: v for k, v in cache_files(refs[cache.layout]).items() if k in wanted}
        build(manifest, out, layout="ragged")
        assert cache_files(out) == cache_files(refs["ragged"])
    assert step > 6


class _FailAfter(ToyVAE):
    """Raises (a stand-in crash) once ``batches`` line batches have been encoded."""

    def __init__(self, batches: int):
        super().__init__()
        self.left = batches + 1  # + the white-column probe
        self.calls = 0

    def encode(self, images):
        self.calls += 1
        self.left -= 1
        if self.left < 0:
            raise _Crash
        return super().encode(images)


def test_resume_repairs_its_log_and_restarts_on_lost_data(tmp_path):
    manifest = make_lines(str(tmp_path), n=12, seed=4)  # 6 batches of 2
    reference = str(tmp_path / "reference")
    build(manifest, reference, batch_size=2)
    out = str(tmp_path / "out")
    progress = cache_path(out, "train", "progress")

    with pytest.raises(_Crash):
        build(manifest, out, batch_size=2, encoder=_FailAfter(3))
    with open(progress, "ab") as fh:
        fh.write(b"4")  # a torn append: dropped, not trusted
    with pytest.raises(_Crash):
        build(manifest, out, batch_size=2, encoder=_FailAfter(1))
    assert progress_lines(progress) - 1 == 4

    os.truncate(cache_path(out, "train", "data") + ".partial", 100)  # the data file lost: start over
    with pytest.raises(_Crash):
        build(manifest, out, batch_size=2, encoder=_FailAfter(1))
    assert progress_lines(progress) - 1 == 1  # the old batches are forgotten, not claimed for new data

    encoder, stats = _FailAfter(100), {}
    build(manifest, out, batch_size=2, encoder=encoder, stats=stats)
    assert stats["resumed"] and encoder.calls == 1 + 5
    assert cache_files(out) == cache_files(reference)

    stale = str(tmp_path / "stale")  # a log from another build (other batch size) is not resumed
    with pytest.raises(_Crash):
        build(manifest, stale, batch_size=3, encoder=_FailAfter(2))
    encoder, stats = _FailAfter(100), {}
    build(manifest, stale, batch_size=2, encoder=encoder, stats=stats)
    assert not stats["resumed"] and encoder.calls == 1 + 6
    assert cache_files(stale) == cache_files(reference)
