"""The hot read paths at full size and at their edges: batches large enough for the gather's streaming
stores (float16 batches of >= 16 MiB with lines of >= 4 KiB), lines longer than the prefetched part,
outputs that start off a 32-byte boundary, odd sizes, and every read option of ``read_batch`` (fields,
pad, pad_to, packed, sample, flip) into reused buffers full of garbage: each read must equal a fresh
read and the values written, bit for bit, padding included."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from latentfast import ops, reference
from latentfast.backends import native
from latentfast.cache import BatchBuffers, LatentCache, LatentCacheWriter, read_batch
from latentfast.cache.feed.buffers import fresh_host
from latentfast.errors import InvalidArgumentError
from latentfast.testing import poisoned_like, torch_threads, write_random_cache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STREAM_BYTES = 16 << 20  # csrc/cpu/gather_rows_kernel.cpp's kStreamBytes: the batches below are larger


def flat_rows(rng, n, channels, latent_h, w_max, layout, edge_widths=()):
    """``(rows, widths, (data, offsets, widths, pitch))``: random float16 rows laid out as the cache lays them."""
    widths = rng.integers(1, w_max + 1, size=n).astype(np.int32)
    widths[: len(edge_widths)] = edge_widths
    rows = [rng.standard_normal((channels, latent_h, int(w)), dtype=np.float32).astype(np.float16) for w in widths]
    if layout == "padded":
        block = np.zeros((n, channels, latent_h, w_max), dtype=np.float16)
        for i, row in enumerate(rows):
            block[i, :, :, : row.shape[-1]] = row
        data, pitch = block.reshape(-1), w_max
        offsets = np.arange(n, dtype=np.int64) * channels * latent_h * w_max
    else:
        data, pitch = np.concatenate([row.reshape(-1) for row in rows]), 0
        offsets = np.concatenate([[0], np.cumsum([row.size for row in rows])[:-1]]).astype(np.int64)
    return rows, widths, (torch.from_numpy(data), torch.from_numpy(offsets), torch.from_numpy(widths), pitch)


def expected_batch(rows, white, indices, W):
    out = np.empty((len(indices), *rows[0].shape[:2], W), dtype=np.float16)
    for b, i in enumerate(indices):
        w = rows[i].shape[-1]
        out[b, :, :, :w] = rows[i]
        out[b, :, :, w:] = white
    return torch.from_numpy(out)


def guarded_out(shape, dtype, shift):
    """``(out, buffer)``: a contiguous ``out`` inside a NaN-filled buffer, starting ``shift`` elements in (off
    a 32-byte boundary when ``shift`` is odd) with 64 guard elements after it."""
    numel = int(np.prod(shape))
    buffer = torch.full((shift + numel + 64,), float("nan"), dtype=dtype)
    return buffer[shift: shift + numel].view(shape), buffer


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shift", [0, 1, 7])
def test_streamed_batch_of_many_lines_matches_numpy(layout, threads, shift):
    """Rows of 6 lines of 2101 units (4202 bytes: whole streamed vectors, a tail, and a head before the
    first 32-byte boundary of each line), 700 of them with duplicates: a 17.6 MB batch."""
    rng = np.random.default_rng(5)
    edges = [2101, 1, 15, 16, 17, 2048, 2085, 2100]
    rows, widths, (data, offsets, widths_t, pitch) = flat_rows(rng, 40, 2, 3, 2101, layout, edges)
    white = rng.standard_normal((2, 3, 1)).astype(np.float16)
    indices = rng.integers(0, 40, size=700)
    shape = (700, 2, 3, 2101)
    assert np.prod(shape) * 2 >= STREAM_BYTES
    out, buffer = guarded_out(shape, torch.float16, shift)
    with torch_threads(threads):
        got = ops.gather_rows(data, offsets, widths_t, pitch, indices, channels=2, latent_h=3,
                              white=torch.from_numpy(white), dtype=torch.float16, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, expected_batch(rows, white, indices.tolist(), 2101))
    assert bool(buffer[:shift].isnan().all() and buffer[shift + out.numel():].isnan().all()), "a store ran outside out"


@pytest.mark.parametrize("shift", [0, 3])
def test_streamed_batch_of_one_long_line_per_row_matches_numpy_and_reference(shift):
    """A record field's shape: one line per item of up to 4 MiB (an odd unit count), padded to W past the
    widest; the prefetch of the next row's line stops at its first 2 KiB."""
    rng = np.random.default_rng(8)
    w_max = (1 << 21) + 7
    rows, widths, (data, offsets, widths_t, _) = flat_rows(rng, 6, 1, 1, w_max, "ragged", [w_max, 1, 33, 4097])
    white = np.array([[[-2.5]]], dtype=np.float16)
    indices = [0, 3, 1, 5, 3, 2]
    W = w_max + 3
    out, buffer = guarded_out((6, 1, 1, W), torch.float16, shift)
    got = ops.gather_rows(data, offsets, widths_t, 0, indices, channels=1, latent_h=1, white=torch.from_numpy(white),
                          width=W, dtype=torch.float16, out=out)
    assert torch.equal(got, expected_batch(rows, white, indices, W))
    ref = poisoned_like(out.shape, torch.float16)
    reference.gather_rows_into(data, offsets, widths_t, 0, torch.tensor(indices), torch.from_numpy(white), ref)
    assert torch.equal(got, ref)
    assert bool(buffer[shift + out.numel():].isnan().all())


@pytest.mark.parametrize("shift", [0, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_packed_gather_matches_numpy(shift, threads):
    """A packed field's gather of 20 MiB: ragged rows of odd unit counts back to back, into a staging
    buffer off a 32-byte boundary with guards on both sides."""
    rng = np.random.default_rng(11)
    rows, widths, (data, offsets, widths_t, _) = flat_rows(rng, 9, 1, 1, 1 << 21, "ragged", [1 << 21, 1, 3, 4095])
    indices = [0, 4, 1, 8, 8, 2, 6, 5, 7, 3, 0]
    needed = int(widths[indices].sum())
    assert needed * 2 >= STREAM_BYTES
    buffer = torch.full((shift + needed + 64,), float("nan"), dtype=torch.float16)
    with torch_threads(threads):
        packed = ops.gather_rows_packed(data, offsets, widths_t, 0, indices, channels=1, latent_h=1, out=buffer[shift:])
    assert torch.equal(packed, torch.from_numpy(np.concatenate([rows[i].reshape(-1) for i in indices])))
    assert bool(buffer[:shift].isnan().all() and buffer[shift + needed:].isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large_batches_that_cast_match_numpy(dtype):
    """A cast batch of the same size takes the plain stores (streaming is for float16 copies only)."""
    rng = np.random.default_rng(9)
    rows, widths, (data, offsets, widths_t, pitch) = flat_rows(rng, 12, 1, 2, 1 << 19, "padded", [1 << 19, 5])
    white = rng.standard_normal((1, 2, 1)).astype(np.float16)
    indices = [0, 1, 11, 4, 4, 7, 2, 9, 10, 3, 1, 0, 6, 8, 5, 5, 11]
    got = ops.gather_rows(data, offsets, widths_t, pitch, indices, channels=1, latent_h=2, white=torch.from_numpy(white),
                          dtype=dtype, out=poisoned_like((len(indices), 1, 2, 1 << 19), dtype))
    assert torch.equal(got, expected_batch(rows, white, indices, 1 << 19).to(dtype))


# ---- read_batch: records into reused buffers full of garbage --------------------------------------------
N = 24
LONGEST = 700  # every test batch holds item 0, of this length: text batches of 8 are >= 16 MiB padded


def make_records(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LONGEST, (n,), generator=g).tolist()
    lengths[0] = LONGEST
    records = []
    for i, L in enumerate(lengths):
        r = {"latent": torch.randn((4, 6, 10), generator=g).half(),
             "latent_std": torch.rand((4, 6, 10), generator=g).half(),
             "latent_flipped": torch.randn((4, 6, 10), generator=g).half(),
             "latent_flipped_std": torch.rand((4, 6, 10), generator=g).half(),
             "text": torch.randn((L, 2048), generator=g).bfloat16(),  # 4 KiB per token: a streamed batch
             "mask": torch.randint(0, 2, (L,), generator=g).to(torch.int8),  # odd byte counts
             "scores": torch.randn((L, 3), generator=g),  # float32: two units per element
             "pooled": torch.randn((7,), generator=g)}
        if i % 5 != 3:  # an optional field some items lack
            r["ids"] = torch.randint(-300, 300, (L,), generator=g).to(torch.int16)
        records.append(r)
    return records


@pytest.fixture(scope="module")
def records_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    records = make_records()
    with LatentCacheWriter(folder, optional=("ids",)) as writer:
        for i, record in enumerate(records):
            writer.append(f"k{i:03d}", record)
    return LatentCache(folder), records


BATCHES = [[0, 5, 3, 17, 9, 3, 22, 1], [11, 0, 2], [0], [8, 13, 0, 20, 4, 4, 19, 6, 23, 15]]


def padded(values, length, pad):
    """The items' values stacked, padded with ``pad`` past each one's first dimension (None: absent, all pad)."""
    rest = next(v for v in values if v is not None).shape[1:]
    dtype = next(v for v in values if v is not None).dtype
    out = torch.full((len(values), length, *rest), pad, dtype=dtype)
    for b, v in enumerate(values):
        if v is not None:
            out[b, : v.shape[0]] = v
    return out


def poison(batch: dict) -> None:
    """Fill every buffer behind a batch's tensors with 0xFF bytes (NaN in every float dtype)."""
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage()).fill_(0xFF)


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


# text -1.5 (bf16 bits that are a finite float16) is padded by the gather; ids -7 (int16 bits that read as a
# float16 NaN), mask (1 byte) and scores (4 bytes) are filled after it
PAD = {"text": -1.5, "mask": 3, "scores": 0.5, "ids": -7}


@pytest.mark.parametrize("threads", [1, 2])
def test_padded_records_into_poisoned_buffers_equal_a_fresh_read_and_the_values(records_cache, threads):
    cache, records = records_cache
    names = ("latent", "text", "mask", "scores", "pooled", "ids")
    out = BatchBuffers()
    with torch_threads(threads):
        for indices in BATCHES + BATCHES[::-1]:  # shapes grow and shrink over the same buffers
            fresh = read_batch(cache, indices, fields=names, pad=PAD)
            got = read_batch(cache, indices, fields=names, pad=PAD, out=out)
            assert_same(got, fresh)
            longest = max(records[i]["text"].shape[0] for i in indices)
            assert torch.equal(got["latent"], torch.stack([records[i]["latent"] for i in indices]))
            assert torch.equal(got["pooled"], torch.stack([records[i]["pooled"] for i in indices]))
            for name, pad in PAD.items():
                want = padded([records[i].get(name) for i in indices], longest, pad)
                assert torch.equal(got[name], want), name
            assert got["ids_present"].tolist() == [i % 5 != 3 for i in indices]
            poison(got)  # the next read gets buffers full of NaN
    assert out.allocations <= 2 * len(names) + 4  # (grown a few times, not once per batch)


def test_records_into_given_tensors_full_of_garbage(records_cache):
    cache, records = records_cache
    indices, names = BATCHES[0], ("text", "ids", "mask")
    pad = {name: PAD[name] for name in names}
    fresh = read_batch(cache, indices, fields=names, pad=pad, pad_to=LONGEST + 9)
    given = {name: poisoned_like(fresh[name].shape, fresh[name].dtype) for name in names}
    got = read_batch(cache, indices, fields=names, pad=pad, pad_to=LONGEST + 9, out=given)
    assert all(got[name].data_ptr() == given[name].data_ptr() for name in given)
    assert_same(got, fresh)
    assert torch.equal(got["text"][:, LONGEST:], torch.full((len(indices), 9, 2048), -1.5, dtype=torch.bfloat16))


def test_a_non_contiguous_given_output_is_refused_by_name(records_cache):
    cache, _ = records_cache
    fresh = read_batch(cache, [0, 1], fields=("text",), pad={"text": 0.0})
    wide = torch.empty((2, LONGEST, 4096), dtype=torch.bfloat16)[:, :, ::2]  # the right shape, strided
    assert wide.shape == fresh["text"].shape
    with pytest.raises(InvalidArgumentError, match=r"out\['text'\] must be contiguous"):
        read_batch(cache, [0, 1], fields=("text",), pad={"text": 0.0}, out={"text": wide})


def test_packed_records_into_poisoned_buffers(records_cache):
    cache, records = records_cache
    out = BatchBuffers()
    for indices in BATCHES + BATCHES[::-1]:
        fresh = read_batch(cache, indices, fields=("latent", "text", "scores"), packed=("text", "scores"))
        got = read_batch(cache, indices, fields=("latent", "text", "scores"), packed=("text", "scores"), out=out)
        assert_same(got, fresh)
        for name in ("text", "scores"):
            assert torch.equal(got[name], torch.cat([records[i][name] for i in indices]))
        poison(got)


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=str)
def test_sample_and_flip_into_poisoned_buffers(records_cache, dtype):
    cache, _ = records_cache
    out = BatchBuffers()
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, sample=True, flip=0.5, seed=3, epoch=1, dtype=dtype)
    for indices in BATCHES + BATCHES[::-1]:
        fresh = read_batch(cache, indices, **options)
        got = read_batch(cache, indices, out=out, **options)
        assert_same(got, fresh)
        poison(got)
    flipped = read_batch(cache, list(range(N)), flip=1.0, seed=3, fields=("latent",), out=out)
    assert torch.equal(flipped["latent"], read_batch(cache, list(range(N)), fields=("latent_flipped",))["latent_flipped"])


def test_latents_alone_into_poisoned_buffers(records_cache):
    cache, records = records_cache
    out = BatchBuffers()
    for dtype in (None, torch.float32, torch.bfloat16):
        for indices in BATCHES:
            fresh = read_batch(cache, indices, dtype=dtype)
            got = read_batch(cache, indices, dtype=dtype, out=out)
            assert torch.equal(got[0], fresh[0]) and torch.equal(got[1], fresh[1])
            want = torch.stack([records[i]["latent"] for i in indices])
            assert torch.equal(got[0], want if dtype is None else want.to(dtype))
            torch.empty(0, dtype=torch.uint8).set_(got[0].untyped_storage()).fill_(0xFF)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_line_cache_batch_above_the_streaming_size(tmp_path, layout):
    """A line cache with 4 KiB lines, 128 rows of 32 lines: a 17 MB padded float16 batch, streamed."""
    folder = write_random_cache(tmp_path, 64, 8, 4, 2100, seed=2, layouts=(layout,))[layout]
    cache = LatentCache(folder)
    rng = np.random.default_rng(4)
    indices = rng.integers(0, 64, size=128)
    widths = cache.widths[indices]
    W = int(widths.max())
    want = torch.stack([torch.cat([cache[int(i)], cache.white_column.expand(-1, -1, W - int(w))], dim=-1)
                        for i, w in zip(indices, widths)])
    assert want.numel() * 2 >= STREAM_BYTES
    out = poisoned_like(want.shape, torch.float16)
    latents, got_widths = read_batch(cache, indices, out=out)
    assert latents.data_ptr() == out.data_ptr() and torch.equal(latents, want)
    assert got_widths.tolist() == widths.tolist()


# ---- fresh outputs of 4 MiB and more: recycled maps (feed/buffers.fresh_host) ---------------------------
def test_fresh_host_outputs_recycle_a_dead_batchs_map_and_never_a_live_ones():
    shape = (128, 16, 8, 128)  # 4 MiB
    first = fresh_host(shape, torch.float16)
    assert first.shape == shape and first.dtype == torch.float16 and first.is_contiguous()
    address = first.data_ptr()
    view = first[3:]  # a live view holds the map
    del first
    second = fresh_host(shape, torch.float16)
    assert second.data_ptr() != address
    second_address = second.data_ptr()
    del view, second
    third = fresh_host(shape, torch.bfloat16)  # the same byte size in another dtype
    assert third.data_ptr() in (address, second_address)
    fourth, fifth = fresh_host(shape, torch.float16), fresh_host(shape, torch.float16)  # one map idle, two wanted
    assert len({third.data_ptr(), fourth.data_ptr(), fifth.data_ptr()}) == 3
    assert fresh_host((3, 5), torch.float32).shape == (3, 5)  # small outputs: plain torch.empty


def test_fresh_host_keeps_a_bounded_number_of_idle_maps():
    from latentfast.cache.feed import buffers

    outputs = [fresh_host((40 << 20,), torch.uint8) for _ in range(3)]  # 120 MiB when all are dropped
    del outputs
    assert buffers._RECYCLER.idle_bytes() <= buffers._Recycler.KEEP_BYTES


@pytest.mark.parametrize("threads", [1, 2])
def test_fresh_line_batches_over_recycled_poisoned_maps_equal_the_rows(tmp_path, threads):
    """Batches of 4 MiB and more, each read after the last one's map was filled with garbage and given back:
    every byte of the next (the padding too) is written by the gather."""
    folder = write_random_cache(tmp_path, 300, 16, 8, 128, seed=6, layouts=("padded", "ragged"))
    rng = np.random.default_rng(7)
    with torch_threads(threads):
        for layout in ("padded", "ragged"):
            cache = LatentCache(folder[layout])
            for size in (128, 128, 201, 128):
                indices = rng.integers(0, 300, size=size)
                latents, widths = read_batch(cache, indices, width=128)
                assert latents.numel() * 2 >= 4 << 20
                W = 128
                want = torch.stack([torch.cat([cache[int(i)], cache.white_column.expand(-1, -1, W - int(w))], dim=-1)
                                    for i, w in zip(indices, widths)])
                assert torch.equal(latents, want)
                torch.empty(0, dtype=torch.uint8).set_(latents.untyped_storage()).fill_(0xFF)
                del latents  # its map goes back, full of NaN, for the next batch


def shaped_cache(folder, items) -> LatentCache:
    """A shaped cache of ``items`` (latents of any shape), keys ``k000``, ``k001``, ..."""
    with LatentCacheWriter(folder) as writer:
        for i, z in enumerate(items):
            writer.append(f"k{i:03d}", {"latent": z})
    return LatentCache(folder)


def test_fresh_shaped_batches_over_recycled_poisoned_maps_equal_the_items(tmp_path):
    """64 items of [16, 64, 64] bfloat16 (8 MiB: bench_loader's shaped rows), fresh, in each dtype."""
    g = torch.Generator().manual_seed(8)
    items = [torch.randn((16, 64, 64), generator=g).bfloat16() for _ in range(80)]
    cache = shaped_cache(tmp_path / "shaped", items)
    rng = np.random.default_rng(9)
    for dtype in (None, None, torch.float32, torch.float16):
        indices = rng.choice(80, 64, replace=False)
        latents, shapes = read_batch(cache, indices, dtype=dtype)
        want = torch.stack([items[i] for i in indices])
        assert torch.equal(latents, want if dtype is None else want.to(dtype))
        assert shapes.tolist() == [[16, 64, 64]] * 64
        torch.empty(0, dtype=torch.uint8).set_(latents.untyped_storage()).fill_(0xFF)
        del latents


# ---- the gathers' thread choice (csrc/cpu/gather_rows_kernel.cpp's ThreadChoice) ---------------------------
@pytest.mark.skipif(native.LIB is None, reason="needs the native library")
def test_thread_choice_backs_off_trying_a_way_that_keeps_losing_and_returns_when_it_wins():
    n = 4096
    fast, slow = torch.full((n,), 1000, dtype=torch.int64), torch.full((n,), 20000, dtype=torch.int64)
    pool_tries = int(native.thread_choice_trace(fast, slow).sum())  # the threads 20x slower throughout
    assert 1 <= pool_tries <= 8 + n // (8 << 5)  # (tried every 8th gather without the backoff: 512 tries)
    solo_tries = int((1 - native.thread_choice_trace(slow, fast)).sum())
    assert 1 <= solo_tries <= 8 + n // (8 << 5)
    # the threads slow for the first half, then 4x faster than alone: taken again within one backed-off interval
    pool = torch.cat([slow[: n // 2], torch.full((n // 2,), 250, dtype=torch.int64)])
    used = native.thread_choice_trace(fast, pool)
    assert int(used[: n // 2].sum()) <= 8 + n // 2 // (8 << 5)
    assert bool(used[n // 2 + (8 << 5) + 200:].float().mean() > 0.85)


@pytest.mark.parametrize("dtype", [None, torch.float32], ids=str)
def test_shaped_bfloat16_batch_into_a_given_misaligned_poisoned_tensor(tmp_path, dtype):
    """A given out= of the stored dtype is gathered into directly (of another dtype: cast into); off a 32-byte
    boundary, NaN-filled, guarded: equal to the items, nothing written outside it."""
    g = torch.Generator().manual_seed(10)
    items = [torch.randn((3, 5, 7), generator=g).bfloat16() for _ in range(20)]
    cache = shaped_cache(tmp_path / "shaped", items)
    indices = [4, 19, 0, 4, 11]
    want = torch.stack([items[i] for i in indices])
    out, buffer = guarded_out((5, 3, 5, 7), torch.bfloat16 if dtype is None else dtype, shift=3)
    latents, shapes = read_batch(cache, indices, out=out, dtype=dtype)
    assert latents.data_ptr() == out.data_ptr()
    assert torch.equal(latents, want if dtype is None else want.to(dtype))
    assert shapes.tolist() == [[3, 5, 7]] * 5
    assert bool(buffer[:3].isnan().all() and buffer[3 + out.numel():].isnan().all()), "a store ran outside out"
