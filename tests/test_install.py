"""The wheel: built without torch, tagged for any Python, holding every package and the native library.

A wheel that left out a sub-package (latentfast.backends once) imports fine from a checkout and fails
in every real installation, so the wheel's contents are compared with the source tree."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parent.parent
checkout_only = pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="not a source checkout (tests copied away)")


@checkout_only
def test_the_build_requires_no_torch():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if r.lower().startswith("torch")], requires


@pytest.mark.slow
@checkout_only
def test_wheel_holds_every_package_and_the_native_library(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("latentfast-*.whl")
    assert "-py3-none-" in wheel.name, wheel.name  # the library depends on no Python version or ABI
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "latentfast/_native.so" in names, sorted(names)
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "latentfast").rglob("*.py")}
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
