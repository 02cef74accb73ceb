"""Whatever is wrong with the native library, ``import latentfast`` works, every op runs on the
reference, and one warning names what failed and the command that fixes it.

Each case copies the package into a temporary folder, puts a broken ``_native.so`` there (or none)
and imports that copy in a child process (a library that crashes the loader must not take the test
runner with it)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

import latentfast
from latentfast.backends import native

PACKAGE = pathlib.Path(latentfast.__file__).resolve().parent
COMPILER = shutil.which("cc") or shutil.which("gcc")

# Every op through the public op (backend "auto"), each result compared with a formula written here.
SMOKE = """
import os, tempfile, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import latentfast
    from latentfast import backends
ours = [str(w.message) for w in caught if "latentfast" in str(w.message)]
assert len(ours) == 1, ours
print("WARNING", ours[0])
assert latentfast.__file__.startswith(os.environ["EXPECTED_ROOT"]), latentfast.__file__
for op in latentfast._ops.SCHEMAS:
    assert backends.resolve(op, "cpu") == "torch", op
ops = torch.ops.latentfast
torch.manual_seed(0)

x = torch.randint(0, 256, (2, 3, 4, 5, 6), dtype=torch.uint8)
views = [torch.empty(2, 3, 2, 5, 6) for _ in range(2)]
ops.normalize_uint8_into(x, views)
assert torch.equal(torch.cat(views, dim=2), x.float() / 127.5 - 1)

C, h, w_max, widths = 2, 3, 5, [5, 3, 4, 2]
data = torch.randn(len(widths) * C * h * w_max).half()
offsets = torch.arange(len(widths), dtype=torch.int64) * C * h * w_max
width_t = torch.tensor(widths, dtype=torch.int32)
indices, white = torch.tensor([2, 0, 3]), torch.randn(C * h).half()
rows = [data[int(offsets[i]):][:C * h * w_max].view(C, h, w_max)[..., :widths[i]] for i in indices.tolist()]
expected = torch.stack([torch.cat([r, white.view(C, h, 1).expand(C, h, 5 - r.shape[-1])], -1) for r in rows])
out = torch.empty(3, C, h, 5, dtype=torch.float16)
ops.gather_rows_into(data, offsets, width_t, w_max, indices, white, out)
assert torch.equal(out, expected)
packed = torch.empty(sum(r.numel() for r in rows), dtype=torch.float16)
ops.gather_rows_packed_into(data, offsets, width_t, w_max, indices, C, h, packed)
assert torch.equal(packed, torch.cat([r.reshape(-1) for r in rows]))
starts = torch.tensor([0, rows[0].numel(), rows[0].numel() + rows[1].numel()])
expanded = torch.empty(3, C, h, 5)
ops.expand_rows_into(packed, starts, width_t[indices], white, expanded)
assert torch.equal(expanded, expected.float())

payload = os.urandom(4096)
with tempfile.TemporaryFile() as fh:
    fh.write(payload)
    fh.flush()
    spans = torch.empty(300, dtype=torch.uint8)
    ops.read_spans_into(fh.fileno(), torch.tensor([100, 3000]), torch.tensor([200, 100]), 2, spans)
assert spans.numpy().tobytes() == payload[100:300] + payload[3000:3100]

grads = [torch.randn(3, 4, 2), torch.randn(3, 1, 5)[:, :, ::2]]
arena = torch.empty(2 * 3 * (8 + 3))
ops.scatter_cotangents_into(grads, [1, 2], [1.0, -2.0], arena)
blocks = [g[m] * s for m in (slice(0, 1), slice(1, 3)) for g in grads for s in (1.0, -2.0)]
assert torch.equal(arena, torch.cat([b.reshape(-1) for b in blocks]))
print("DESCRIBE", latentfast.describe().splitlines()[1])
print("OK")
"""


def _stub(tmp_path: pathlib.Path, source: str, *link: str) -> pathlib.Path:
    """A shared library compiled from C ``source`` (the test is skipped without a C compiler)."""
    if COMPILER is None:
        pytest.skip("no C compiler to build a stub library")
    c_file = tmp_path / "stub.c"
    c_file.write_text(source)
    so = tmp_path / "stub.so"
    subprocess.run([COMPILER, "-shared", "-fPIC", str(c_file), "-o", str(so), *link], check=True, cwd=tmp_path)
    return so


def _real_library() -> bytes:
    if native.LOAD_ERROR is not None:
        pytest.skip(f"the native library is not built here: {native.LOAD_ERROR}")
    return pathlib.Path(native.PATH).read_bytes()


def _with_missing_dependency(tmp_path):  # as a library built against another torch (libc10_cuda.so)
    dep = _stub(tmp_path, "int c10_cuda_symbol(void) { return 1; }")
    dep.rename(tmp_path / "libc10_cuda_stub.so")
    lib = _stub(tmp_path, "int c10_cuda_symbol(void); int latentfast_abi_version(void) { return c10_cuda_symbol(); }",
                f"-L{tmp_path}", "-lc10_cuda_stub")
    (tmp_path / "libc10_cuda_stub.so").unlink()
    return lib.read_bytes()


def _wrong_architecture(_tmp_path):
    blob = bytearray(_real_library())
    blob[18:20] = (183 if os.uname().machine != "aarch64" else 62).to_bytes(2, "little")  # e_machine
    return bytes(blob)


CASES = {  # case -> (the library's bytes or None for no file, what the warning must say)
    "missing": (lambda _: None, "is missing"),
    "corrupt": (lambda _: b"\x00garbage" * 512, "is not a shared library"),
    "empty": (lambda _: b"", "is not a shared library"),
    "truncated": (lambda _: _real_library()[: len(_real_library()) // 2], "is truncated"),
    "wrong_architecture": (_wrong_architecture, "was built for"),
    "missing_dependency": (_with_missing_dependency, "could not be loaded (libc10_cuda_stub.so"),
    "stale_abi": (lambda tmp: _stub(tmp, "int latentfast_abi_version(void) { return 0; }").read_bytes(),
                  "has ABI version 0"),
    "missing_symbol": (lambda tmp: _stub(tmp, f"int latentfast_abi_version(void) {{ return {native.ABI_VERSION}; }}")
                       .read_bytes(), "lacks a symbol"),
}


def _package_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "site"
    skip = shutil.ignore_patterns("_native.so", "__pycache__")
    shutil.copytree(PACKAGE, root / "latentfast", ignore=skip)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_native_library_never_breaks_import(case, tmp_path):
    make, message = CASES[case]
    root = _package_copy(tmp_path)
    blob = make(tmp_path)
    if blob is not None:
        (root / "latentfast" / "_native.so").write_bytes(blob)
    env = {k: v for k, v in os.environ.items() if k not in ("LATENTFAST_DISABLE_C", "LATENTFAST_BACKEND")}
    env.update(PYTHONPATH=str(root), EXPECTED_ROOT=str(root))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SMOKE)], capture_output=True, text=True, env=env,
                          cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("OK"), proc.stdout
    warning = next(line for line in proc.stdout.splitlines() if line.startswith("WARNING"))
    assert message in warning and "Fix: " in warning and "pip install" in warning, warning
    assert "NOT loaded" in proc.stdout, proc.stdout


def test_the_library_links_no_torch_and_no_python():
    """One build serves every torch and Python: the library needs the C runtime only."""
    if native.LOAD_ERROR is not None:
        pytest.skip(f"the native library is not built here: {native.LOAD_ERROR}")
    if shutil.which("ldd") is None:
        pytest.skip("no ldd")
    needed = subprocess.run(["ldd", native.PATH], capture_output=True, text=True, check=True).stdout
    for forbidden in ("libtorch", "libc10", "libpython", "libgomp", "libstdc++"):
        assert forbidden not in needed, needed
