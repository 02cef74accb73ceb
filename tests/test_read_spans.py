"""ops.read_spans (latentfast::read_spans_into): byte spans of a real file, every backend against the
reference and the reference against plain slicing of the file's bytes; odd spans (empty, duplicated,
overlapping, at the end), thread counts, a poisoned longer ``out``, opcheck, the same errors on every
backend, and the worker pool in a forked child (subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from latentfast import ops, reference
from latentfast.errors import InvalidArgumentError
from latentfast.testing import runnable_backends

BACKENDS = runnable_backends("read_spans_into")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("spans") / "bytes.bin"
    payload = np.random.default_rng(0).integers(0, 256, size=3 * 2**20 + 123, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    yield fd, payload
    os.close(fd)


def span_samples(size):
    rng = np.random.default_rng(1)
    yield "one", [0], [4096]
    yield "empty-and-end", [5, size - 17, 100, size], [0, 17, 0, 0]
    offsets = rng.integers(0, size - 70_000, size=64)
    yield "random-64", offsets.tolist(), rng.integers(1, 70_000, size=64).tolist()
    yield "duplicates-overlaps", [10, 10, 15, 0], [100, 100, 3000, 20]
    yield "big", [0, 2**20], [2**20 + 5, 2**21]


@pytest.mark.parametrize("threads", [1, 3, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_read_spans_match_the_file(data_file, backend, threads):
    fd, payload = data_file
    for label, offsets, lengths in span_samples(len(payload)):
        expected = b"".join(payload[o : o + n] for o, n in zip(offsets, lengths))
        out = torch.full((len(expected) + 99,), 0x5A, dtype=torch.uint8)
        got = ops.read_spans(fd, np.array(offsets), torch.tensor(lengths), threads=threads, out=out, backend=backend)
        assert got.data_ptr() == out.data_ptr() and got.numel() == len(expected), label
        assert bytes(got.numpy()) == expected, label
        assert bool((out[len(expected) :] == 0x5A).all()), f"{label}: a read ran past the spans"
        ref = torch.full_like(out, 0x11)
        reference.read_spans_into(fd, torch.tensor(offsets), torch.tensor(lengths), 1, ref)
        assert torch.equal(ref, torch.cat([got, ref[len(expected) :]])), label


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_spans_errors_are_the_same_on_every_backend(data_file, backend):
    fd, payload = data_file
    size = len(payload)
    with pytest.raises(InvalidArgumentError, match=r"span 1 = \[.*\) runs past the end of the file"):
        ops.read_spans(fd, [0, size - 10], [10, 11], backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"span 0 = \(offset -1, length 4\) is not a byte range"):
        ops.read_spans(fd, [-1], [4], backend=backend)
    with pytest.raises(InvalidArgumentError, match="out holds 8 bytes"):
        torch.ops.latentfast.read_spans_into(fd, torch.tensor([0, 0]), torch.tensor([5, 5]), 2,
                                             torch.empty(8, dtype=torch.uint8), backend)
    with pytest.raises(InvalidArgumentError, match="offsets has 2 spans but lengths has 1"):
        ops.read_spans(fd, [0, 1], [1], backend=backend)
    with pytest.raises(InvalidArgumentError, match=r"threads must be in \[1, 256\]"):
        ops.read_spans(fd, [0], [1], threads=1000, backend=backend)
    with pytest.raises(InvalidArgumentError, match="out must be a contiguous 1-D uint8 CPU tensor of >= 4 bytes"):
        ops.read_spans(fd, [0], [4], out=torch.empty(4, dtype=torch.int16), backend=backend)
    with pytest.raises(TypeError, match="offsets must be a 1-D sequence of ints"):
        ops.read_spans(fd, [0.5], [4], backend=backend)
    with pytest.raises(ValueError, match="fd must be an int >= 0"):
        ops.read_spans(-1, [0], [4], backend=backend)
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    with pytest.raises(RuntimeError, match="pread of span 0 failed"):
        ops.read_spans(closed, [0], [4], backend=backend)


def test_opcheck(data_file):
    fd, _ = data_file
    args = (fd, torch.tensor([0, 9000, 5]), torch.tensor([100, 4096, 7]), 4, torch.empty(5000, dtype=torch.uint8))
    torch.library.opcheck(torch.ops.latentfast.read_spans_into.default, args)


@pytest.mark.slow
def test_pool_works_in_a_forked_child(data_file, tmp_path):
    """The parent's pool exists (and is busy in another thread) when it forks; the child reads with its
    own pool instead of waiting forever for threads it does not have."""
    fd, payload = data_file
    path = tmp_path / "b.bin"
    path.write_bytes(payload[:100_000])
    script = textwrap.dedent(f"""
        import os, threading, torch
        from latentfast import ops
        fd = os.open({str(path)!r}, os.O_RDONLY)
        first = ops.read_spans(fd, [0], [50_000], threads=8)
        busy = threading.Thread(target=lambda: [ops.read_spans(fd, [0] * 64, [1000] * 64, threads=8) for _ in range(200)])
        busy.start()
        pid = os.fork()
        if pid == 0:
            got = ops.read_spans(fd, [10, 90_000], [5, 10_000], threads=4)
            os._exit(0 if bytes(got.numpy()) == open({str(path)!r}, 'rb').read()[10:15] + open({str(path)!r}, 'rb').read()[90_000:] else 3)
        busy.join()
        _, status = os.waitpid(pid, 0)
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
