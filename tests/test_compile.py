"""The public op functions trace under ``torch.compile(fullgraph=True)`` on every backend available here.

The backend is an argument of the op, so forcing one changes nothing in the graph: the op's
dispatch-key kernel picks the implementation when the graph runs. The Triton cases run under
Triton's interpreter through tests/test_triton_interpreter.py (this module is listed there).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from latentfast import ops
from latentfast.testing import random_rows, runnable_backends


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("backend", runnable_backends("normalize_uint8_into", "cpu"))
def test_normalize_uint8_fullgraph(backend):
    x = torch.randint(0, 256, (2, 3, 6, 5, 7), dtype=torch.uint8)[..., ::1]

    def f(t):
        views = ops.normalize_uint8(t, num_views=3, dtype=torch.float32, backend=backend)
        return torch.stack(views)

    torch.testing.assert_close(_compile(f)(x), f(x), rtol=0, atol=0)
    expected = torch.stack([x[:, :, 2 * v : 2 * v + 2].double() / 127.5 - 1 for v in range(3)])
    torch.testing.assert_close(_compile(f)(x).double(), expected, rtol=0, atol=1e-7)


def _cache_source(seed=0, n=9, channels=3, latent_h=2, w_max=11):
    rng = np.random.default_rng(seed)
    rows, widths = random_rows(rng, n, channels, latent_h, w_max)
    data = torch.from_numpy(np.concatenate([r.reshape(-1) for r in rows]))
    sizes = torch.from_numpy(widths.astype(np.int64)) * channels * latent_h
    offsets = torch.cumsum(sizes, 0) - sizes
    white = torch.from_numpy(rng.standard_normal((channels, latent_h, 1)).astype(np.float16))
    return rows, data, offsets, torch.from_numpy(widths), white


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into", "cpu"))
def test_gather_rows_fullgraph(backend):
    rows, data, offsets, widths, white = _cache_source()
    index = torch.tensor([4, 0, 8, 4])
    W = 12

    def f(i):
        return ops.gather_rows(data, offsets, widths, 0, i, channels=3, latent_h=2, white=white, width=W,
                               dtype=torch.float32, backend=backend)

    got = _compile(f)(index)
    expected = torch.stack([
        torch.cat([torch.from_numpy(rows[i]), white.expand(3, 2, W - rows[i].shape[-1])], dim=-1) for i in index.tolist()
    ]).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("expand_rows_into", "cpu"))
def test_expand_rows_fullgraph(backend):
    rows, data, offsets, widths, white = _cache_source(seed=1)
    W = 11

    def f(packed):
        return ops.expand_rows(packed, offsets, widths, white, channels=3, latent_h=2, width=W, dtype=torch.float32,
                               backend=backend)

    got = _compile(f)(data)
    for b, row in enumerate(rows):
        w = row.shape[-1]
        torch.testing.assert_close(got[b, :, :, :w], torch.from_numpy(row).float(), rtol=0, atol=0)
        torch.testing.assert_close(got[b, :, :, w:], white.float().expand(3, 2, W - w), rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_packed_into", "cpu"))
def test_gather_rows_packed_fullgraph(backend):
    rows, data, offsets, widths, _ = _cache_source(seed=2)
    index = torch.tensor([3, 1, 1])

    def f(i):
        return ops.gather_rows_packed(data, offsets, widths, 0, i, channels=3, latent_h=2, backend=backend) * 2

    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # the packed length is a value (a sum of widths)
        got = _compile(f)(index)
    expected = torch.cat([torch.from_numpy(rows[i]).reshape(-1) for i in index.tolist()]) * 2
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("read_spans_into", "cpu"))
def test_read_spans_fullgraph(backend, tmp_path):
    import os

    payload = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    path = tmp_path / "data.bin"
    payload.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets, lengths = torch.tensor([4093, 0, 1000]), torch.tensor([7, 100, 3000])

        def f(o, n):
            return ops.read_spans(fd, o, n, threads=2, backend=backend).to(torch.int32) + 1

        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # the total length is a value
            got = _compile(f)(offsets, lengths)
    finally:
        os.close(fd)
    expected = np.concatenate([payload[4093:4100], payload[0:100], payload[1000:4000]]).astype(np.int32) + 1
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("scatter_cotangents_into", "cpu"))
def test_scatter_cotangents_fullgraph(backend):
    from latentfast.replay import scatter_cotangents

    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(5, 3, 2, generator=g), torch.randn(5, 7, 4, generator=g)[:, ::2]]  # one strided branch

    def f(g0, g1):
        result = scatter_cotangents([g0, g1], [2, 3], scale=3.0, backend=backend)
        return [block for m in range(2) for block in (*result.local[m], *result.scaled[m])]

    got = _compile(f)(*grads)
    rows = [slice(0, 2), slice(2, 5)]
    expected = [block for r in rows for block in (*(x[r] for x in grads), *(x[r] * 3.0 for x in grads))]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("sample_latents_into", "cpu"))
def test_sample_latents_fullgraph(backend):
    from latentfast.sampling import item_seeds, sample_latents_reference
    from latentfast.testing import assert_sampled_like_reference

    g = torch.Generator().manual_seed(5)
    mean, std = torch.randn(3, 4, 5, 7, generator=g), torch.rand(3, 4, 5, 7, generator=g).to(torch.bfloat16)
    seeds = item_seeds(["a", "b", "c"], 7, 2)

    def f(m, s, k):
        return ops.sample_latents(m * 2, s, k, backend=backend) + 1

    got = _compile(f)(mean, std, seeds)
    assert_sampled_like_reference(got - 1, mean * 2, std, seeds)
    if backend != "torch":  # the traced graph runs the same kernel as the eager call
        torch.testing.assert_close(got, f(mean, std, seeds), rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, sample_latents_reference(mean * 2, std, seeds) + 1, rtol=0, atol=0)
