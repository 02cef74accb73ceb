"""Batch gather ops and read_batch: parity with the reference and with rows rebuilt by numpy, every
backend, both layouts, every dtype, odd shapes, duplicates, unsorted and non-contiguous indices,
poisoned outputs, opcheck, and every error path."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from latentfast.testing import random_rows, write_cache
from latentfast.testing import poisoned_like, runnable_backends, torch_threads

from latentfast import ops, reference
from latentfast.cache.feed import device as device_path
from latentfast.cache.feed.gather import read_batch
from latentfast.errors import IndexOutOfRangeError, InvalidArgumentError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def flat_source(rows, widths, w_max, layout):
    """(data, row_offsets, widths, pitch) for ``rows`` laid out in memory as the cache lays them on disk."""
    channels, latent_h = rows[0].shape[:2]
    if layout == "padded":
        block = np.zeros((len(rows), channels, latent_h, w_max), dtype=np.float16)
        for i, row in enumerate(rows):
            block[i, :, :, : row.shape[-1]] = row
        offsets = np.arange(len(rows), dtype=np.int64) * channels * latent_h * w_max
        return torch.from_numpy(block.reshape(-1)), torch.from_numpy(offsets), torch.from_numpy(widths), w_max
    sizes = np.array([row.size for row in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    data = np.concatenate([row.reshape(-1) for row in rows])
    return torch.from_numpy(data), torch.from_numpy(offsets), torch.from_numpy(widths), 0


def expected_batch(rows, white, indices, W, dtype):
    """The padded batch rebuilt independently with numpy."""
    out = []
    for i in indices:
        row = rows[i]
        pad = np.repeat(white.reshape(row.shape[0], row.shape[1], 1), W - row.shape[-1], axis=2)
        out.append(np.concatenate([row, pad], axis=2))
    return torch.from_numpy(np.stack(out)).to(dtype)


def gather_samples():
    """(label, rows, white, source args, indices, width) over layouts and odd geometries."""
    rng = np.random.default_rng(1234)
    geometries = [(1, 1, 1, 5), (3, 5, 17, 40), (4, 8, 33, 64), (2, 3, 7, 9)]  # C, h, w_max, N
    for channels, latent_h, w_max, n in geometries:
        rows, widths = random_rows(rng, n, channels, latent_h, w_max)
        white = rng.standard_normal((channels, latent_h, 1)).astype(np.float16)
        for layout in ("padded", "ragged"):
            source = flat_source(rows, widths, w_max, layout)
            unsorted_dupes = rng.integers(0, n, size=11).tolist() + [n - 1, 0, n - 1]
            strided = torch.arange(n - 1, -1, -1, dtype=torch.int64)[::2]  # non-contiguous, descending
            for indices, width in ((unsorted_dupes, None), (strided, w_max + 3), ([n - 1], None)):
                label = f"{layout}-C{channels}h{latent_h}w{w_max}-B{len(indices)}-W{width}"
                yield label, rows, white, source, indices, width


SAMPLES = list(gather_samples())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into"))
@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_gather_rows_matches_numpy_and_reference(sample, backend, dtype):
    _, rows, white, (data, offsets, widths, pitch), indices, width = sample
    index_list = torch.as_tensor(indices).tolist()
    channels, latent_h = rows[0].shape[:2]
    W = width if width is not None else max(rows[i].shape[-1] for i in index_list)
    out = poisoned_like((len(index_list), channels, latent_h, W), dtype)
    got = ops.gather_rows(data, offsets, widths, pitch, indices, channels=channels, latent_h=latent_h,
                          white=torch.from_numpy(white), width=width, dtype=dtype, out=out, backend=backend)
    assert got.data_ptr() == out.data_ptr()
    expected = expected_batch(rows, white, index_list, W, dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    ref = poisoned_like(out.shape, dtype)
    reference.gather_rows_into(data, offsets, widths, pitch, torch.as_tensor(index_list), torch.from_numpy(white), ref)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_packed_into"))
@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_packed_gather_then_expand_equals_padded_gather(sample, backend):
    _, rows, white, (data, offsets, widths, pitch), indices, width = sample
    index_list = torch.as_tensor(indices).tolist()
    channels, latent_h = rows[0].shape[:2]
    staging = poisoned_like((40_000,), torch.float16)  # longer than needed, like a ring slot
    packed = ops.gather_rows_packed(data, offsets, widths, pitch, indices, channels=channels, latent_h=latent_h,
                                    out=staging, backend=backend)
    expected = np.concatenate([rows[i].reshape(-1) for i in index_list])
    torch.testing.assert_close(packed, torch.from_numpy(expected), rtol=0, atol=0)
    selected = widths[torch.as_tensor(index_list)]
    sizes = selected.to(torch.int64) * channels * latent_h
    starts = torch.cumsum(sizes, 0) - sizes
    for dtype in DTYPES:
        for expand_backend in runnable_backends("expand_rows_into"):
            W = width if width is not None else int(selected.max())
            out = poisoned_like((len(index_list), channels, latent_h, W), dtype)
            ops.expand_rows(packed, starts, selected, torch.from_numpy(white), channels=channels,
                            latent_h=latent_h, width=width, dtype=dtype, out=out, backend=expand_backend)
            torch.testing.assert_close(out, expected_batch(rows, white, index_list, W, dtype), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_read_batch_on_files(tmp_path, layout):
    rng = np.random.default_rng(7)
    rows, widths = random_rows(rng, 30, 4, 3, 21)
    white = rng.standard_normal((4, 3, 1)).astype(np.float16)
    cache = write_cache(str(tmp_path), rows, widths, w_max=21, layout=layout, white=white)
    indices = np.array([29, 3, 3, 0, 17])
    for dtype in (None, torch.bfloat16, torch.float32):
        latents, got_widths = read_batch(cache, indices, dtype=dtype)
        assert got_widths.dtype == torch.int32 and got_widths.tolist() == widths[indices].tolist()
        W = int(widths[indices].max())
        expected = expected_batch(rows, white, indices.tolist(), W, dtype or torch.float16)
        torch.testing.assert_close(latents, expected, rtol=0, atol=0)
        for b, i in enumerate(indices):
            assert torch.equal(latents[b, :, :, : widths[i]], cache[int(i)].to(dtype or torch.float16))
    out = poisoned_like((2, 4, 3, 25), torch.float32)
    latents, _ = read_batch(cache, [1, 2], dtype=torch.float32, width=25, out=out)
    assert latents is out
    torch.testing.assert_close(out, expected_batch(rows, white, [1, 2], 25, torch.float32), rtol=0, atol=0)
    empty, empty_widths = read_batch(cache, [])
    assert empty.shape == (0, 4, 3, 0) and empty_widths.numel() == 0


def _opcheck_args(layout, dtype):
    rng = np.random.default_rng(3)
    rows, widths = random_rows(rng, 9, 2, 3, 11)
    data, offsets, widths_t, pitch = flat_source(rows, widths, 11, layout)
    indices = torch.tensor([8, 0, 8, 4], dtype=torch.int64)
    white = torch.from_numpy(rng.standard_normal(6).astype(np.float16))
    return data, offsets, widths_t, pitch, indices, white, torch.empty((4, 2, 3, 13), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_opcheck(layout, dtype):
    data, offsets, widths, pitch, indices, white, out = _opcheck_args(layout, dtype)
    torch.library.opcheck(torch.ops.latentfast.gather_rows_into.default,
                          (data, offsets, widths, pitch, indices, white, out))
    packed = torch.empty(4 * 6 * 11, dtype=torch.float16)
    torch.library.opcheck(torch.ops.latentfast.gather_rows_packed_into.default,
                          (data, offsets, widths, pitch, indices, 2, 3, packed))
    selected = widths[indices]
    sizes = selected.to(torch.int64) * 6
    torch.library.opcheck(torch.ops.latentfast.expand_rows_into.default,
                          (packed, torch.cumsum(sizes, 0) - sizes, selected, white, out))


# ---- errors -------------------------------------------------------------------------------------
@pytest.fixture
def small_cache(tmp_path):
    rng = np.random.default_rng(5)
    rows, widths = random_rows(rng, 6, 2, 2, 8)
    widths[2] = 8  # a full-width row for the no-white-column case
    rows[2] = rng.standard_normal((2, 2, 8)).astype(np.float16)
    return write_cache(str(tmp_path / "with_white"), rows, widths, w_max=8, white=np.ones((2, 2, 1))), \
        write_cache(str(tmp_path / "no_white"), rows, widths, w_max=8, layout="ragged")


@pytest.mark.parametrize("bad", [6, -1, 10**12])
def test_read_batch_bad_index_names_it(small_cache, bad):
    cache, _ = small_cache
    with pytest.raises(IndexError, match=rf"indices\[2\] = {bad} is out of range"):
        read_batch(cache, [0, 1, bad, 3])


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into"))
def test_kernel_checks_indices_before_copying(backend):
    data, offsets, widths, pitch, _, white, out = _opcheck_args("padded", torch.float16)
    out.fill_(7.0)
    fn = torch.ops.latentfast.gather_rows_into.default if backend == "cpp" else reference.gather_rows_into
    with pytest.raises(IndexError, match=r"indices\[3\] = 9 is out of range"):
        fn(data, offsets, widths, pitch, torch.tensor([0, 1, 2, 9]), white, out)
    assert bool((out == 7.0).all()), "nothing may be written before every index is checked"


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into"))
def test_kernel_rejects_rows_outside_data(backend):
    data, offsets, widths, pitch, indices, white, out = _opcheck_args("ragged", torch.float32)
    fn = torch.ops.latentfast.gather_rows_into.default if backend == "cpp" else reference.gather_rows_into
    with pytest.raises((RuntimeError, ValueError), match="outside the data"):
        fn(data[:-1], offsets, widths, pitch, indices, white, out)  # the last row now runs past the end
    bad_offsets = offsets.clone()
    bad_offsets[4] = -3
    with pytest.raises((RuntimeError, ValueError), match="outside the data"):
        fn(data, bad_offsets, widths, pitch, indices, white, out)
    with pytest.raises((RuntimeError, ValueError), match="width"):
        fn(data, offsets, widths, pitch, indices, white, torch.empty(4, 2, 3, 3))  # W narrower than the rows


def test_read_batch_argument_errors(small_cache):
    cache, no_white = small_cache
    with pytest.raises(ValueError, match="width must be an int >= the batch's widest row"):
        read_batch(cache, [2], width=3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        read_batch(cache, [0], dtype=torch.int32)
    with pytest.raises(TypeError, match="indices must be a 1-D sequence of ints"):
        read_batch(cache, [0.5])
    with pytest.raises(TypeError, match="indices must be a 1-D sequence of ints"):
        read_batch(cache, [[0, 1]])
    with pytest.raises(ValueError, match="out must have shape"):
        read_batch(cache, [0, 2], out=torch.empty(1, 2, 2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="no white column"):
        read_batch(no_white, [0, 2])
    latents, _ = read_batch(no_white, [2, 2])  # nothing to pad: no white column needed
    assert torch.equal(latents[0], no_white[2])
    with pytest.raises(ValueError, match="device must be a CPU or CUDA device"):
        read_batch(cache, [0], device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available here"):
            read_batch(cache, [0], device="cuda")


def test_public_op_argument_errors():
    data, offsets, widths, pitch, indices, white, _ = _opcheck_args("padded", torch.float16)
    kwargs = dict(channels=2, latent_h=3)
    with pytest.raises(ValueError, match=r"data must be a contiguous 1-D (torch\.)?float16"):
        ops.gather_rows(data.float(), offsets, widths, pitch, indices, white=white, **kwargs)
    with pytest.raises(ValueError, match=r"row_offsets must be a contiguous 1-D (torch\.)?int64"):
        ops.gather_rows(data, offsets.int(), widths, pitch, indices, white=white, **kwargs)
    with pytest.raises(ValueError, match="widths has 8 rows but row_offsets has 9"):
        ops.gather_rows(data, offsets, widths[:-1], pitch, [0], white=white, **kwargs)
    with pytest.raises(ValueError, match="pitch must be an int >= 0"):
        ops.gather_rows(data, offsets, widths, -1, indices, white=white, **kwargs)
    with pytest.raises(ValueError, match="white must be a tensor of C\\*h = 6 values"):
        ops.gather_rows(data, offsets, widths, pitch, indices, white=white[:5], **kwargs)
    with pytest.raises(ValueError, match="out must be a contiguous 1-D float16 CPU tensor of >= "):
        ops.gather_rows_packed(data, offsets, widths, pitch, indices, out=torch.empty(3, dtype=torch.float16),
                               **kwargs)
    packed = torch.zeros(30, dtype=torch.float16)
    with pytest.raises(ValueError, match="inside packed's 30 elements"):
        ops.expand_rows(packed, torch.tensor([0, 20]), torch.tensor([2, 2], dtype=torch.int32), white, **kwargs)
    with pytest.raises(ValueError, match="packed_offsets must be a contiguous 1-D torch.int64"):
        ops.expand_rows(packed, torch.tensor([0, 20], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32),
                        white, **kwargs)


# ---- the CUDA path's host side, checked on the CPU ------------------------------------------------------
@pytest.mark.parametrize("backend", runnable_backends("gather_rows_packed_into"))
@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_staging_math_matches_the_reference(sample, backend):
    """What the pinned ring stages (packed rows, their starts, their widths), expanded, is the padded batch;
    the starts are the exclusive prefix sum of C*h*w_i computed independently."""
    _, rows, white, source, indices, width = sample
    index = torch.as_tensor(indices, dtype=torch.int64).contiguous()
    index_list = index.tolist()
    channels, latent_h = rows[0].shape[:2]
    selected = source[2][index]
    slot = (poisoned_like((50_000,), torch.float16), torch.full((64,), -7, dtype=torch.int64),
            torch.full((64,), -7, dtype=torch.int32))  # larger than needed, like a ring slot
    packed, offsets, widths = device_path.stage_rows(source, index, selected, channels, latent_h, *slot, backend=backend)
    sizes = np.array([rows[i].size for i in index_list], dtype=np.int64)
    assert offsets.tolist() == np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    assert widths.tolist() == [rows[i].shape[-1] for i in index_list]
    assert offsets.data_ptr() == slot[1].data_ptr() and widths.data_ptr() == slot[2].data_ptr()
    W = width if width is not None else int(selected.max())
    for expand_backend in runnable_backends("expand_rows_into"):
        out = poisoned_like((len(index_list), channels, latent_h, W), torch.float32)
        ops.expand_rows(packed, offsets, widths, torch.from_numpy(white), channels=channels, latent_h=latent_h,
                        width=W, dtype=torch.float32, out=out, backend=expand_backend)
        torch.testing.assert_close(out, expected_batch(rows, white, index_list, W, torch.float32), rtol=0, atol=0)


def test_ring_grows_once_when_caches_of_different_row_sizes_alternate():
    """Two caches (wide rows, few lines / narrow rows, many lines) and batch sizes alternating: after the
    ring has grown to serve both, it is never reallocated again."""
    requests = []
    for step in range(40):
        lines, w_max, B = ((64, 512, 16), (4, 24, 200))[step % 2]  # one needs more elements, the other more rows
        widths = np.random.default_rng(step).integers(1, w_max + 1, size=B)
        requests.append((lines * int(widths.sum()), B, lines * w_max * max(B, device_path.DEFAULT_RING_ROWS)))
    ring, allocations = None, 0
    for elements, rows, worst in requests:
        size = device_path.ring_size(ring, elements, rows, worst)
        if size is not None:
            assert ring is None or (size[0] >= ring[0] and size[1] >= ring[1]), "a ring shrank"
            ring, allocations = size, allocations + 1
        assert elements <= ring[0] and rows <= ring[1]
    assert allocations <= 2, f"the ring was reallocated {allocations} times"


def test_widths_and_width_arguments_are_integers_never_truncated(small_cache):
    cache, _ = small_cache
    expected, _ = read_batch(cache, [0, 2], width=9)
    got, _ = read_batch(cache, [0, 2], width=np.int64(9))  # numpy ints are ints
    assert torch.equal(got, expected)
    for bad in (9.0, True, "9"):
        with pytest.raises(TypeError, match="width must be an int"):
            read_batch(cache, [0, 2], width=bad)
    with pytest.raises(ValueError, match="width must be an int >= the batch's widest row"):
        read_batch(cache, [0, 2], width=np.int32(3))

    class Int64Widths:  # a cache whose widths index is int64, with one width past int32
        def __init__(self, widths):
            self.widths = widths

        def __getattr__(self, name):
            return getattr(cache, name)

        def __len__(self):
            return len(cache)

    wide = np.asarray(cache.widths, dtype=np.int64).copy()
    assert torch.equal(read_batch(Int64Widths(wide), [0, 2], width=9)[0], expected)
    wide[3] = 2**32 + 1  # would be width 1 after an int32 cast
    with pytest.raises(ValueError, match=r"cache.widths\[3\] = 4294967297 is outside \[0, 2\*\*31 - 1\]"):
        read_batch(Int64Widths(wide), [0, 3])
    with pytest.raises(TypeError, match="cache.widths must hold integers"):
        read_batch(Int64Widths(wide.astype(np.float64)), [0, 3])


def test_device_argument_is_read_like_every_device_argument(small_cache):
    cache, _ = small_cache
    expected, _ = read_batch(cache, [1, 0])
    for device in ("cpu", torch.device("cpu")):
        assert torch.equal(read_batch(cache, [1, 0], device=device)[0], expected)
    with pytest.raises(ValueError, match="device must name a device"):
        read_batch(cache, [0], device="gpu:0")
    with pytest.raises(TypeError, match="device must be a str, int or torch.device"):
        read_batch(cache, [0], device=1.5)
    if not torch.cuda.is_available():
        from latentfast.errors import DeviceUnavailableError

        for device in ("cuda", 0, "cuda:1"):
            with pytest.raises(DeviceUnavailableError, match="CUDA is not available here"):
                read_batch(cache, [0], device=device)


@pytest.mark.gpu
def test_read_batch_cuda_matches_cpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(11)
    rows, widths = random_rows(rng, 40, 4, 4, 32)
    white = rng.standard_normal((4, 4, 1)).astype(np.float16)
    for layout in ("padded", "ragged"):
        cache = write_cache(str(tmp_path / layout), rows, widths, w_max=32, layout=layout, white=white)
        for step in range(8):  # more batches than ring slots: slots are reused
            indices = rng.integers(0, 40, size=5 + step)
            for dtype in DTYPES:
                expected, _ = read_batch(cache, indices, dtype=dtype)
                got, got_widths = read_batch(cache, indices, device="cuda", dtype=dtype)
                assert got.is_cuda and got.dtype == dtype
                torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
                assert got_widths.tolist() == widths[indices].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into"))
def test_cast_of_every_float16_value(backend, dtype):
    """All 65536 float16 bit patterns (subnormals, inf, NaN, rounding ties) cast like torch casts them."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    data = every.reshape(-1).contiguous()
    widths = torch.tensor([1024] * 64, dtype=torch.int32)
    offsets = torch.arange(64, dtype=torch.int64) * 1024
    out = poisoned_like((64, 1, 1, 1030), dtype)
    white = torch.tensor([float("nan")], dtype=torch.float16)
    ops.gather_rows(data, offsets, widths, 1024, torch.arange(64), channels=1, latent_h=1, white=white, width=1030,
                    dtype=dtype, out=out, backend=backend)
    expected = every.reshape(64, 1, 1, 1024).to(dtype)
    torch.testing.assert_close(out[..., :1024], expected, rtol=0, atol=0, equal_nan=True)
    assert bool(out[..., 1024:].isnan().all())


# ---- the vectorised row copy and the trimmed read_batch path ------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("threads", [1, 2])
def test_gather_rows_vector_edges_stay_inside_out(layout, dtype, threads):
    """Widths and W around the 16-element vector (tails done by overlapping moves, padding stored
    before the real columns), a batch large enough to be split between threads, and a guard after
    ``out`` that must stay untouched."""
    rng = np.random.default_rng(21)
    edge_widths = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48]
    widths = np.array([edge_widths[i % len(edge_widths)] for i in range(700)], dtype=np.int32)
    rows = [rng.standard_normal((2, 3, int(w)), dtype=np.float32).astype(np.float16) for w in widths]
    white = rng.standard_normal((2, 3, 1)).astype(np.float16)
    data, offsets, widths_t, pitch = flat_source(rows, widths, 48, layout)
    indices = rng.permutation(700)
    with torch_threads(threads):
        for W in (48, 49, 64):
            for batch in (indices, indices[:3], np.flatnonzero(widths < 16)[:5]):
                shape = (len(batch), 2, 3, W)
                buffer = torch.full((int(np.prod(shape)) + 64,), 7.0, dtype=dtype)
                out = buffer[: int(np.prod(shape))].view(shape)
                ops.gather_rows(data, offsets, widths_t, pitch, batch, channels=2, latent_h=3,
                                white=torch.from_numpy(white), width=W, dtype=dtype, out=out)
                torch.testing.assert_close(out, expected_batch(rows, white, batch.tolist(), W, dtype), rtol=0, atol=0)
                assert bool((buffer[out.numel():] == 7.0).all()), "a store ran past the end of out"
        for batch in (indices, np.flatnonzero(widths < 16)[:5]):  # the packed staging of the GPU path
            needed = 6 * int(widths[batch].sum())
            staging = torch.full((needed + 64,), 7.0, dtype=torch.float16)
            packed = ops.gather_rows_packed(data, offsets, widths_t, pitch, batch, channels=2, latent_h=3, out=staging)
            expected = np.concatenate([rows[i].reshape(-1) for i in batch])
            torch.testing.assert_close(packed, torch.from_numpy(expected), rtol=0, atol=0)
            assert bool((staging[needed:] == 7.0).all()), "a store ran past the packed rows"


def test_read_batch_accepts_every_index_form(small_cache):
    cache, _ = small_cache
    expected, expected_widths = read_batch(cache, [4, 0, 4, 2])
    forms = [np.array([4, 0, 4, 2], dtype=np.int32), np.array([4, 9, 0, 9, 4, 9, 2])[::2],
             torch.tensor([4, 0, 4, 2]), torch.tensor([4, 9, 0, 9, 4, 9, 2])[::2],  # non-contiguous
             torch.tensor([4, 0, 4, 2], dtype=torch.int16), (4, 0, 4, 2)]
    for indices in forms:
        latents, widths = read_batch(cache, indices)
        assert torch.equal(latents, expected) and torch.equal(widths, expected_widths), type(indices)


@pytest.mark.parametrize("bad", [6, -1])
def test_read_batch_bad_index_wins_over_other_errors(small_cache, bad):
    """A bad index is reported as such even when the widths read for it would raise something else."""
    cache, no_white = small_cache
    with pytest.raises(IndexError, match=rf"indices\[1\] = {bad} is out of range"):
        read_batch(cache, [0, bad], width=1)  # width=1 is narrower than row 0
    with pytest.raises(IndexError, match=rf"indices\[1\] = {bad} is out of range"):
        read_batch(no_white, [2, bad, 0])  # would need padding, and there is no white column
    with pytest.raises(IndexError, match=rf"indices\[0\] = {bad} is out of range"):
        read_batch(cache, torch.tensor([bad, 1]))
    with pytest.raises(IndexError, match=rf"indices\[0\] = {bad} is out of range"):
        read_batch(cache, [bad, 1], out=torch.empty(1, 2, 2, 8, dtype=torch.float16))  # out of the wrong shape


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into"))
def test_read_batch_every_backend_checks_indices(small_cache, backend):
    """read_batch leaves the index check to the kernel: every backend's kernel must make it."""
    cache, _ = small_cache
    expected, _ = read_batch(cache, [5, 1, 5])
    got, _ = read_batch(cache, np.array([5, 1, 5]), backend=backend)
    assert torch.equal(got, expected)
    for bad in (6, -2):
        with pytest.raises(IndexError, match=rf"indices\[1\] = {bad} is out of range"):
            read_batch(cache, np.array([5, bad, 1]), backend=backend)


@pytest.mark.gpu
def test_read_batch_on_another_device_runs_there(tmp_path):
    """From a process whose current device is cuda:0, read_batch(device="cuda:1") copies and expands
    on cuda:1 (its streams), leaves the current device alone and gives the CPU path's bytes."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    rng = np.random.default_rng(12)
    rows, widths = random_rows(rng, 64, 4, 4, 40)
    cache = write_cache(str(tmp_path), rows, widths, w_max=40, layout="ragged", white=np.ones((4, 4, 1)))
    torch.cuda.set_device(0)
    for step in range(8):
        indices = rng.integers(0, 64, size=9 + step)
        expected, _ = read_batch(cache, indices, dtype=torch.bfloat16)
        got, _ = read_batch(cache, indices, device="cuda:1", dtype=torch.bfloat16)
        assert got.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
        torch.cuda.synchronize(1)  # only cuda:1's work is waited for: a launch on cuda:0 would race here
        assert torch.equal(got.cpu(), expected)


@pytest.mark.gpu
def test_ring_is_not_reallocated_when_caches_alternate_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(13)
    caches = []
    for k, (channels, latent_h, w_max) in enumerate(((2, 2, 200), (8, 8, 12))):
        rows, widths = random_rows(rng, 50, channels, latent_h, w_max)
        caches.append(write_cache(str(tmp_path / str(k)), rows, widths, w_max=w_max, white=np.zeros((channels, latent_h, 1))))
    rings = set()
    for step in range(12):
        cache = caches[step % 2]
        got, _ = read_batch(cache, np.arange(10 + step), device="cuda")
        assert torch.equal(got.cpu(), read_batch(cache, np.arange(10 + step))[0])
        rings.add(id(device_path._RINGS[(os.getpid(), str(torch.device("cuda", torch.cuda.current_device())))]))
    assert len(rings) <= 2


# ---- op level: the expand kernel against numpy, overlaps, argument forms, meta tensors -----------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", runnable_backends("expand_rows_into"))
@pytest.mark.parametrize("seed", [0, 1])
def test_expand_rows_matches_numpy(seed, backend, dtype):
    """Fresh random rows of odd widths (0 included), unsorted rows with a duplicate, packed as a slice
    starting at an odd element of a larger buffer, offsets and widths as slices too, a poisoned out."""
    rng = np.random.default_rng(seed + 100)
    channels, latent_h, w_max, n = (3, 5, 19, 7) if seed == 0 else (1, 2, 40, 4)
    rows, widths = random_rows(rng, n, channels, latent_h, w_max, min_width=0)
    white = rng.standard_normal((channels, latent_h, 1)).astype(np.float16)
    order = list(rng.permutation(n)) + [0]
    flat = np.concatenate([rows[i].reshape(-1) for i in order])
    buffer = torch.from_numpy(np.concatenate([rng.standard_normal(5).astype(np.float16), flat]))
    packed = buffer[5:]
    sizes = np.array([rows[i].size for i in order], dtype=np.int64)
    offsets = torch.from_numpy(np.concatenate([[99], np.cumsum(sizes) - sizes]))[1:]
    selected = torch.from_numpy(np.concatenate([[7], widths[order]]).astype(np.int32))[1:]
    W = w_max + 2
    out = poisoned_like((len(order), channels, latent_h, W), dtype)
    ops.expand_rows(packed, offsets, selected, torch.from_numpy(white), channels=channels, latent_h=latent_h,
                    width=W, dtype=dtype, out=out, backend=backend)
    torch.testing.assert_close(out, expected_batch(rows, white, order, W, dtype), rtol=0, atol=0)


@pytest.mark.parametrize("backend", runnable_backends("expand_rows_into"))
def test_expand_rows_without_white_column(backend):
    packed = torch.arange(12, dtype=torch.float16)
    offsets, widths = torch.tensor([0, 6]), torch.tensor([2, 1], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=r"row 1 \(width 1\) needs padding to W=2 but no white column"):
        ops.expand_rows(packed, offsets, widths, None, channels=1, latent_h=3, backend=backend)
    full = ops.expand_rows(packed, offsets, torch.tensor([2, 2], dtype=torch.int32), None, channels=1, latent_h=3,
                           backend=backend)  # nothing to pad: no white column needed
    assert torch.equal(full, torch.stack([packed[:6], packed[6:]]).reshape(2, 1, 3, 2))


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_into"))
def test_gather_out_over_data_is_refused(backend):
    data, offsets, widths, pitch, indices, white, _ = _opcheck_args("padded", torch.float16)
    before = data.clone()
    out = data[: 4 * 2 * 3 * 13].view(4, 2, 3, 13)
    with pytest.raises(InvalidArgumentError, match="out overlaps data in memory"):
        ops.gather_rows(data, offsets, widths, pitch, indices, channels=2, latent_h=3, white=white, width=13,
                        out=out, backend=backend)
    staging = data[50:]
    with pytest.raises(InvalidArgumentError, match="out overlaps data in memory"):
        ops.gather_rows_packed(data, offsets, widths, pitch, indices, channels=2, latent_h=3, out=staging,
                               backend=backend)
    assert torch.equal(data, before), "data was written"


@pytest.mark.parametrize("backend", runnable_backends("expand_rows_into"))
def test_expand_out_over_packed_is_refused(backend):
    buffer = torch.randn(200).half()
    packed, out = buffer[:24], buffer[20:44].view(2, 1, 3, 4)
    with pytest.raises(InvalidArgumentError, match="out overlaps packed in memory"):
        ops.expand_rows(packed, torch.tensor([0, 12]), torch.tensor([4, 4], dtype=torch.int32), None, channels=1,
                        latent_h=3, dtype=torch.float16, out=out, backend=backend)


def test_index_values_are_reported_as_given():
    data, offsets, widths, pitch, _, white, _ = _opcheck_args("padded", torch.float16)
    for bad in (np.array([1, 2**64 - 1], dtype=np.uint64), torch.tensor([1, 2**63 - 1]), [1, 2**63 - 1]):
        big = int(bad[1])
        with pytest.raises(IndexOutOfRangeError, match=rf"indices\[1\] = {big} is out of range"):
            ops.gather_rows(data, offsets, widths, pitch, bad, channels=2, latent_h=3, white=white)
    with pytest.raises(IndexOutOfRangeError, match=r"indices\[0\] = 18446744073709551615 is out of range"):
        ops.gather_rows_packed(data, offsets, widths, pitch, np.array([2**64 - 1], dtype=np.uint64), channels=2,
                               latent_h=3)


def test_numpy_integers_are_ints():
    data, offsets, widths, pitch, indices, white, _ = _opcheck_args("ragged", torch.float32)
    as_np = dict(channels=np.int64(2), latent_h=np.int32(3))
    want = ops.gather_rows(data, offsets, widths, pitch, indices, channels=2, latent_h=3, white=white, width=13)
    got = ops.gather_rows(data, offsets, widths, np.int64(pitch), indices, white=white, width=np.int16(13), **as_np)
    assert torch.equal(got, want)
    packed = ops.gather_rows_packed(data, offsets, widths, np.uint8(pitch), indices, **as_np)
    selected = widths[indices]
    sizes = selected.to(torch.int64) * 6
    expanded = ops.expand_rows(packed, torch.cumsum(sizes, 0) - sizes, selected, white, width=np.int64(13), **as_np)
    assert torch.equal(expanded, want)
    for bad in (2.0, True, "3"):
        with pytest.raises(TypeError, match="channels must be an int"):
            ops.gather_rows(data, offsets, widths, pitch, indices, channels=bad, latent_h=3, white=white)


def test_meta_tensors():
    # gather reads values on the host: a meta tensor is refused naming it; expand gives shapes only
    data, offsets, widths, pitch, indices, white, _ = _opcheck_args("padded", torch.float16)
    for name, args in (("data", (data.to("meta"), offsets, widths)), ("widths", (data, offsets, widths.to("meta")))):
        with pytest.raises(InvalidArgumentError, match=f"{name} must be a CPU tensor .*got meta"):
            ops.gather_rows(*args, pitch, indices, channels=2, latent_h=3, white=white)
        with pytest.raises(InvalidArgumentError, match=f"{name} must be a CPU tensor .*got meta"):
            ops.gather_rows_packed(*args, pitch, indices, channels=2, latent_h=3)
    with pytest.raises(InvalidArgumentError, match="indices is a meta tensor"):
        ops.gather_rows(data, offsets, widths, pitch, indices.to("meta"), channels=2, latent_h=3, white=white)
    meta = [t.to("meta") for t in (torch.zeros(24, dtype=torch.float16), torch.tensor([0, 12]),
                                   torch.tensor([4, 4], dtype=torch.int32))]
    out = ops.expand_rows(*meta, None, channels=1, latent_h=3, width=4, dtype=torch.float32)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 1, 3, 4) and out.dtype == torch.float32
    with pytest.raises(InvalidArgumentError, match="width must be given when widths is a meta tensor"):
        ops.expand_rows(*meta, None, channels=1, latent_h=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_rows_cuda_matches_numpy(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(3)
    rows, widths = random_rows(rng, 9, 4, 3, 37, min_width=0)
    white = rng.standard_normal((4, 3, 1)).astype(np.float16)
    order = list(rng.permutation(9)) + [2]
    packed = torch.from_numpy(np.concatenate([rows[i].reshape(-1) for i in order]))
    sizes = torch.tensor([rows[i].size for i in order], dtype=torch.int64)
    offsets = torch.cumsum(sizes, 0) - sizes
    selected = torch.from_numpy(widths[order].astype(np.int32))
    for backend in runnable_backends("expand_rows_into", "cuda"):
        out = poisoned_like((len(order), 4, 3, 40), dtype, device="cuda")
        ops.expand_rows(packed.cuda(), offsets.cuda(), selected.cuda(), torch.from_numpy(white).cuda(), channels=4,
                        latent_h=3, width=40, dtype=dtype, out=out, backend=backend)
        torch.testing.assert_close(out.cpu(), expected_batch(rows, white, order, 40, dtype), rtol=0, atol=0,
                                   msg=lambda m: f"{backend}: {m}")
