"""One cache over many shards: the several-source gather kernel against the reference (every backend,
odd sizes, non-contiguous indices, poisoned outputs, checks before any write), a sharded cache read
exactly as the same items in one cache (lines, shaped, records), and `cache merge`."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from latentfast.testing import poisoned_like, random_rows, runnable_backends, write_cache

from latentfast import reference
from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.store import shards as shardstore
from latentfast.cache import inspect_cache, verify_cache
from latentfast.cli import main
from latentfast.errors import CacheCorruptError, IndexOutOfRangeError, InvalidArgumentError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def multi_source(rng, sizes, channels, latent_h, w_max, layout):
    """Rows split over ``len(sizes)`` flat sources: (rows in global order, data list, row_sources, offsets, widths, pitch).
    Global row i lives in a shuffled (source, position), so offsets are not monotone."""
    n = sum(sizes)
    rows, widths = random_rows(rng, n, channels, latent_h, w_max)
    place = rng.permutation(n)
    sources = np.searchsorted(np.cumsum(sizes), place, side="right").astype(np.int32)
    data, offsets = [], np.zeros(n, np.int64)
    for s in range(len(sizes)):
        mine = np.flatnonzero(sources == s)
        mine = mine[np.argsort(place[mine])]
        pieces, at = [np.full(3, np.float16(np.nan), np.float16)], 3  # a poisoned head: offsets never 0
        for i in mine:
            row = rows[i]
            if layout == "padded":
                row = np.concatenate([row, np.full((channels, latent_h, w_max - row.shape[-1]), np.float16(np.nan), np.float16)], 2)
            offsets[i] = at
            pieces.append(row.reshape(-1))
            at += row.size
        data.append(torch.from_numpy(np.concatenate(pieces)))
    return rows, data, torch.from_numpy(sources), torch.from_numpy(offsets), torch.from_numpy(widths), (w_max if layout == "padded" else 0)


def expected_batch(rows, white, indices, W, dtype):
    out = [np.concatenate([rows[i], np.repeat(white, W - rows[i].shape[-1], axis=2)], axis=2) for i in indices]
    return torch.from_numpy(np.stack(out)).to(dtype)


def samples():
    rng = np.random.default_rng(25)
    for sizes, (C, h, w_max) in (([1], (1, 1, 1)), ([3, 1, 5], (3, 5, 17)), ([7, 2], (4, 8, 33)), ([1, 1, 1, 4], (2, 3, 7))):
        for layout in ("padded", "ragged"):
            rows, *source = multi_source(rng, sizes, C, h, w_max, layout)
            n = len(rows)
            white = rng.standard_normal((C, h, 1)).astype(np.float16)
            dupes = rng.integers(0, n, size=13).tolist() + [n - 1, 0]
            strided = torch.arange(n - 1, -1, -1, dtype=torch.int64)[::2]  # non-contiguous, descending
            for indices, width in ((dupes, None), (strided, w_max + 3)):
                yield f"{layout}-{len(sizes)}src-C{C}h{h}w{w_max}-B{len(indices)}-W{width}", rows, white, source, indices, width


SAMPLES = list(samples())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", runnable_backends("gather_rows_multi_into"))
@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_multi_gather_matches_numpy_and_reference(sample, backend, dtype):
    _, rows, white, (data, sources, offsets, widths, pitch), indices, width = sample
    index_list = torch.as_tensor(indices).tolist()
    C, h = rows[0].shape[:2]
    W = width or max(rows[i].shape[-1] for i in index_list)
    index = torch.as_tensor(indices).contiguous()
    out = poisoned_like((len(index_list), C, h, W), dtype)
    torch.ops.latentfast.gather_rows_multi_into(data, sources, offsets, widths, pitch, index, torch.from_numpy(white), out, backend)
    torch.testing.assert_close(out, expected_batch(rows, white, index_list, W, dtype), rtol=0, atol=0)
    ref = poisoned_like(out.shape, dtype)
    reference.gather_rows_multi_into(data, sources, offsets, widths, pitch, index, torch.from_numpy(white), ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _small(layout="ragged"):
    rng = np.random.default_rng(3)
    rows, data, sources, offsets, widths, pitch = multi_source(rng, [4, 5], 2, 3, 11, layout)
    white = torch.from_numpy(rng.standard_normal((2, 3, 1)).astype(np.float16))
    return data, sources, offsets, widths, pitch, white, torch.full((4, 2, 3, 11), 7.0)


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_multi_into"))
def test_multi_gather_checks_everything_before_writing(backend):
    data, sources, offsets, widths, pitch, white, out = _small()
    fn = torch.ops.latentfast_compiled.gather_rows_multi_into.default if backend == "cpp" else reference.gather_rows_multi_into
    with pytest.raises(IndexError, match=r"indices\[3\] = 9 is out of range"):
        fn(data, sources, offsets, widths, pitch, torch.tensor([0, 1, 2, 9]), white, out)
    bad = sources.clone()
    bad[5] = 2
    with pytest.raises(ValueError, match="row 5 names source 2, outside the 2 data tensors"):
        fn(data, bad, offsets, widths, pitch, torch.tensor([0, 1, 2, 5]), white, out)
    last = int(torch.argmax(offsets + widths.long() * 6 * (sources == 1)))  # the row reaching furthest into source 1
    with pytest.raises(ValueError, match="outside the data"):
        fn([data[0], data[1][:-1]], sources, offsets, widths, pitch, torch.tensor([0, 1, 2, last]), white, out)
    assert bool((out == 7.0).all()), "nothing may be written before every row is checked"


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_multi_into"))
def test_multi_gather_argument_errors_name_the_argument(backend):
    data, sources, offsets, widths, pitch, white, out = _small()
    index = torch.tensor([0, 1, 2, 3])

    def op(*args):
        torch.ops.latentfast.gather_rows_multi_into(*args, backend)

    with pytest.raises(InvalidArgumentError, match=r"data\[1\] must be a contiguous 1-D (torch\.)?float16"):
        op([data[0], data[1].float()], sources, offsets, widths, pitch, index, white, out)
    with pytest.raises(InvalidArgumentError, match=r"row_sources must be a contiguous 1-D (torch\.)?int32"):
        op(data, sources.long(), offsets, widths, pitch, index, white, out)
    with pytest.raises(InvalidArgumentError, match="row_sources (has 8 rows but row_offsets has 9|must be .* of 9 rows)"):
        op(data, sources[:-1], offsets, widths, pitch, index, white, out)
    shared = torch.zeros(400, dtype=torch.float16)  # data[1] and out share memory
    shared[:data[1].numel()] = data[1]
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        op([data[0], shared[:data[1].numel()]], sources, offsets, widths, pitch, index, white, shared[100:364].view(4, 2, 3, 11))


def test_multi_gather_opcheck():
    data, sources, offsets, widths, pitch, white, out = _small("padded")
    torch.library.opcheck(torch.ops.latentfast.gather_rows_multi_into.default,
                          (data, sources, offsets, widths, pitch, torch.tensor([8, 0, 8, 4]), white, out.half()))


# ---- sharded caches ------------------------------------------------------------------------------
def write_records(folder, records, split="train"):
    with LatentCacheWriter(folder, split) as writer:
        for key, record in records:
            writer.append(key, record, info={"key": key})
    return folder


def make_records(n, seed=0, shaped_latents=False):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lat = torch.randn((4, 3, 6) if shaped_latents else (4, 3, 2 + i % 5), generator=gen).half()
        out.append((f"item{i:03d}", {"latent": lat, "text": torch.randn((1 + i % 4, 5), generator=gen).bfloat16(),
                                     "pooled": torch.randn(7, generator=gen), "ids": torch.arange(3) + i}))
    return out


def sharded_and_single(tmp_path, records, parts, order=None):
    """The same records as one cache and as a manifest over ``parts`` shards (``order``: a permutation of the
    records that the shards hold in shuffled places)."""
    single = write_records(str(tmp_path / "single"), records)
    n = len(records)
    order = np.arange(n) if order is None else order
    cuts = np.array_split(order, parts)
    dirs = [write_records(str(tmp_path / "shards" / f"s{k}"), [records[i] for i in sorted(cut.tolist())]) for k, cut in enumerate(cuts)]
    where = {}
    for k, cut in enumerate(cuts):
        for row, i in enumerate(sorted(cut.tolist())):
            where[i] = (k, row)
    shardstore.write_manifest(str(tmp_path / "sharded"), "train", dirs, np.asarray([where[i] for i in range(n)], np.int64))
    return LatentCache(single), LatentCache(str(tmp_path / "sharded"))


def assert_same_batches(one, many, batches, **kwargs):
    for batch in batches:
        a, b = one.read_batch(batch, **kwargs), many.read_batch(batch, **kwargs)
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for name in a:
                assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8) if a[name].dtype.is_floating_point else a[name],
                                                                     b[name].view(torch.uint8) if b[name].dtype.is_floating_point else b[name]), name
        else:
            for x, y in zip(a, b):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_sharded_cache_reads_as_the_single_cache(tmp_path):
    records = make_records(23, shaped_latents=True)
    one, many = sharded_and_single(tmp_path, records, 3, order=np.random.default_rng(0).permutation(23))
    assert type(many) is shardstore.ShardedCache and isinstance(many, LatentCache)
    assert len(many) == len(one) == 23 and many.keys == one.keys
    assert np.array_equal(many.shapes, one.shapes) and np.array_equal(many.widths, one.widths)
    assert many.fields.keys() == one.fields.keys()
    for name in one.fields:
        assert many.fields[name]["dtype"] == one.fields[name]["dtype"]
        assert np.array_equal(many.fields[name]["shapes"], one.fields[name]["shapes"])
    for i in (0, 7, 22, -1):
        assert torch.equal(many[i], one[i]) and many.info(i) == one.info(i)
        ra, rb = one.record(i), many.record(i)
        assert ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)
    assert many.index("item017") == one.index("item017") == 17
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 23, 9).tolist() for _ in range(4)] + [[22, 0, 0], []]
    for dtype in DTYPES:
        assert_same_batches(one, many, batches, dtype=dtype, return_keys=True)
    assert_same_batches(one, many, batches[:4], fields=["latent", "text", "pooled", "ids"], pad={"text": 0})
    assert_same_batches(one, many, batches[:2], fields=["text", "ids"], pad={"text": -1.5}, pad_to=9)
    assert_same_batches(one, many, batches[:3], fields=["latent", "text", "ids"], packed=("text",))
    out_a, out_b = poisoned_like((3, 4, 3, 6), torch.float32), poisoned_like((3, 4, 3, 6), torch.float32)
    one.read_batch([1, 5, 9], dtype=torch.float32, out=out_a)
    got = many.read_batch([1, 5, 9], dtype=torch.float32, out=out_b)
    assert got[0].data_ptr() == out_b.data_ptr() and torch.equal(out_a, out_b)
    with pytest.raises(IndexOutOfRangeError, match="23"):
        many.read_batch([0, 23])
    with pytest.raises(IndexOutOfRangeError):
        many[23]
    from latentfast.cache.feed.sampler import item_chunks

    chunks, whole = item_chunks(many, 256), item_chunks(one, 256)  # 4x3x6 f16 items: 144 bytes each
    for k in range(3):  # within a shard, items share chunks as in a file of their own; never across shards
        rows = np.flatnonzero(many.order[:, 0] == k)
        assert np.array_equal(chunks[rows], item_chunks(many.shards[k], 256)[many.order[rows, 1]] + chunks[rows].min())
    assert len(set(chunks[many.order[:, 0] == 0]) & set(chunks[many.order[:, 0] == 1])) == 0 and len(whole) == 23
    again = __import__("pickle").loads(__import__("pickle").dumps(many))  # what a DataLoader worker gets
    assert_same_batches(one, again, batches[:2], fields=["latent", "ids"])


def open_data_files(root) -> set[str]:
    """The data files under ``root`` this process holds a descriptor of (a map's included)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        if target.startswith(str(root)) and target.endswith(".dat"):
            held.add(os.path.relpath(target, root))
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_sharded_cache_opens_its_shards_and_maps_their_files_on_first_use(tmp_path):
    records = make_records(24, shaped_latents=True)
    one, _ = sharded_and_single(tmp_path, records, 4)  # shards s0..s3 of items 0-5, 6-11, 12-17, 18-23
    many = LatentCache(str(tmp_path / "sharded"))
    shards = tmp_path / "shards"
    assert [s.cache_dir for s in many.opened_shards()] == [os.path.join(str(shards), "s0")]  # the first: meta, white column
    assert open_data_files(shards) == set()
    fields = {"fields": ["latent", "text", "pooled"], "pad": {"text": 0}}
    assert_same_batches(one, many, [[12, 17, 13]], **fields)  # shard s2 only
    assert {os.path.dirname(p) for p in open_data_files(shards)} == {"s2"}
    assert_same_batches(one, many, [[0, 23, 14]], **fields)
    assert {os.path.dirname(p) for p in open_data_files(shards)} == {"s0", "s2", "s3"}  # never s1: nothing read there
    # every shard's meta is read when the cache opens: one rebuilt since the manifest is refused then, first or not
    write_records(str(shards / "s3"), records[18:20])
    with pytest.raises(CacheCorruptError, match="s3 changed after the manifest"):
        LatentCache(str(tmp_path / "sharded"))


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_sharded_line_caches_pad_with_the_white_column(tmp_path, layout):
    rng = np.random.default_rng(4)
    rows, widths = random_rows(rng, 19, 3, 2, 13)
    white = rng.standard_normal((3, 2, 1)).astype(np.float16)
    one = write_cache(str(tmp_path / "one"), rows, widths, w_max=13, layout=layout, white=white)
    parts = [write_cache(str(tmp_path / f"p{k}"), rows[a:b], widths[a:b], w_max=13, layout=layout, white=white).cache_dir
             for k, (a, b) in enumerate(((0, 7), (7, 8), (8, 19)))]
    shardstore.merge_caches(parts, str(tmp_path / "m"))
    many = LatentCache(str(tmp_path / "m"))
    assert many.layout == layout and np.array_equal(many.widths, one.widths) and many.keys == one.keys
    batches = [rng.integers(0, 19, 10).tolist(), [18, 7, 0], [7]]
    for dtype in DTYPES:
        assert_same_batches(one, many, batches, dtype=dtype)
        assert_same_batches(one, many, batches[:1], dtype=dtype, width=20)
    out = poisoned_like((3, 3, 2, 15), torch.bfloat16)
    assert many.read_batch([18, 7, 0], dtype=torch.bfloat16, width=15, out=out)[0] is out
    assert torch.equal(out, one.read_batch([18, 7, 0], dtype=torch.bfloat16, width=15)[0])
    a, b = inspect_cache(str(tmp_path / "one")), inspect_cache(str(tmp_path / "m"))
    assert (a["histogram"], a["padding_waste_pct"], a["padded_layout_bytes"], a["data_bytes"]) == \
           (b["histogram"], b["padding_waste_pct"], b["padded_layout_bytes"], b["data_bytes"])
    assert main(["cache", "inspect", str(tmp_path / "m")]) == 0 and main(["cache", "verify", str(tmp_path / "m")]) == 0
    other = write_cache(str(tmp_path / "other"), rows[:3], widths[:3], w_max=13, layout=layout, white=white + 1)
    with pytest.raises(InvalidArgumentError, match="white column"):
        shardstore.merge_caches([parts[0], other.cache_dir], str(tmp_path / "m2"))


def test_a_batch_over_shards_is_one_gather_per_field(tmp_path, monkeypatch):
    records = make_records(12, shaped_latents=True)
    one, many = sharded_and_single(tmp_path, records, 4)
    calls = []
    real = torch.ops.latentfast.gather_rows_multi_into.default
    monkeypatch.setattr(torch.ops.latentfast.gather_rows_multi_into, "default", lambda *a: calls.append(len(a[0])) or real(*a))
    batch = many.read_batch([0, 4, 8, 11], fields=["latent", "pooled", "ids"])
    assert calls == [4, 4, 4], "one call per field, each over all four shards"
    want = one.read_batch([0, 4, 8, 11], fields=["latent", "pooled", "ids"])
    assert all(torch.equal(batch[k], want[k]) for k in want)


def test_verify_rows_and_verify_find_a_damaged_shard(tmp_path):
    records = make_records(10, shaped_latents=True)
    one, many = sharded_and_single(tmp_path, records, 2)
    result = verify_cache(str(tmp_path / "sharded"))
    assert result["rows"] == 10 and result["shards"] == 2 and result["bytes"] == verify_cache(str(tmp_path / "single"))["bytes"]
    info = inspect_cache(str(tmp_path / "sharded"))
    assert info["n"] == 10 and len(info["shards"]) == 2 and info["shape_counts"] == inspect_cache(str(tmp_path / "single"))["shape_counts"]
    data = os.path.join(str(tmp_path / "shards" / "s1"), "train.latents.f16.dat")
    raw = bytearray(open(data, "rb").read())
    raw[10] ^= 0x40
    with open(data, "r+b") as fh:  # in place: same size, so the reader's checks are the checksums'
        fh.write(raw)
    with pytest.raises(CacheCorruptError, match="s1"):
        verify_cache(str(tmp_path / "sharded"))
    with pytest.raises(CacheCorruptError, match="CRC-32"):
        LatentCache(str(tmp_path / "sharded"), verify_rows=True).read_batch([0, 5])


def test_a_shard_rebuilt_after_the_manifest_is_refused(tmp_path):
    records = make_records(6)
    sharded_and_single(tmp_path, records, 2)
    write_records(str(tmp_path / "shards" / "s0"), records[:2])  # rebuilt with fewer items
    with pytest.raises(CacheCorruptError, match="changed after the manifest"):
        LatentCache(str(tmp_path / "sharded"))
    manifest = shardstore.manifest_path(str(tmp_path / "sharded"), "train")
    with open(manifest, "w") as fh:
        json.dump({"format": "latentfast-shards"}, fh)
    with pytest.raises(CacheCorruptError, match="manifest"):
        LatentCache(str(tmp_path / "sharded"))


def test_merge_joins_caches_without_copying_and_with_copy(tmp_path, capsys):
    records = make_records(14, shaped_latents=True)
    a = write_records(str(tmp_path / "a"), records[:5])
    b = write_records(str(tmp_path / "b"), records[5:])
    whole = LatentCache(write_records(str(tmp_path / "whole"), records))
    assert main(["cache", "merge", a, b, "--out", str(tmp_path / "m")]) == 0
    merged = LatentCache(str(tmp_path / "m"))
    assert merged.keys == whole.keys
    assert not any(name.endswith(".dat") for _, _, files in os.walk(tmp_path / "m") for name in files), "references, no copies"
    assert_same_batches(whole, merged, [[0, 13, 6, 5, 4]], fields=["latent", "text", "ids"], pad={"text": 0})
    more = write_records(str(tmp_path / "more"), [(f"more-{k}", r) for k, r in records[:5]])  # a's records under other keys
    assert main(["cache", "merge", str(tmp_path / "m"), more, "--out", str(tmp_path / "c"), "--copy"]) == 0
    copied = LatentCache(str(tmp_path / "c"))
    assert copied.keys == whole.keys + [f"more-{k}" for k in whole.keys[:5]]
    assert all(os.path.commonpath([d, str(tmp_path / "c")]) == str(tmp_path / "c") for d in copied.shard_dirs)
    assert torch.equal(copied[16], whole[2])
    assert "sharded cache written" in capsys.readouterr().out


def test_merge_refuses_other_encoders_and_fields(tmp_path, capsys):
    records = make_records(4)
    a = write_records(str(tmp_path / "a"), records)
    with LatentCacheWriter(str(tmp_path / "other"), encoder={"name": "another-vae"}) as writer:
        for key, record in records:
            writer.append(key, record)
    plain = str(tmp_path / "plain")
    with LatentCacheWriter(plain) as writer:
        for key, record in records:
            writer.append(key, record["latent"])
    assert main(["cache", "merge", a, str(tmp_path / "other"), "--out", str(tmp_path / "m")]) == 1
    assert "encoder" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="fields"):
        shardstore.merge_caches([a, plain], str(tmp_path / "m2"))
    assert not os.path.exists(shardstore.manifest_path(str(tmp_path / "m2"), "train"))


def test_sharded_read_batch_on_cuda_matches_cpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    records = make_records(12, shaped_latents=True)
    one, many = sharded_and_single(tmp_path, records, 3, order=np.random.default_rng(2).permutation(12))
    for dtype in DTYPES:
        want = one.read_batch([11, 0, 5, 5], dtype=dtype)[0]
        got = many.read_batch([11, 0, 5, 5], device="cuda", dtype=dtype)[0]
        assert got.is_cuda and got.dtype == dtype and torch.equal(got.cpu(), want)
        out = torch.empty((4, 4, 3, 6), dtype=dtype, device="cuda")
        assert many.read_batch([11, 0, 5, 5], device="cuda", dtype=dtype, out=out)[0].data_ptr() == out.data_ptr()
        assert torch.equal(out.cpu(), want)
    batch = many.read_batch([1, 2, 3], device="cuda", fields=["latent", "text", "pooled"], pad={"text": 0})
    want = one.read_batch([1, 2, 3], fields=["latent", "text", "pooled"], pad={"text": 0})
    assert all(torch.equal(batch[k].cpu(), want[k]) for k in want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_sharded_caches_of_latents_in_their_own_dtype(tmp_path, dtype):
    gen = torch.Generator().manual_seed(9)
    records = [(f"k{i}", {"latent": torch.randn((2, 3, 5), generator=gen).to(dtype)}) for i in range(9)]
    one = LatentCache(write_records(str(tmp_path / "one"), records))
    parts = [write_records(str(tmp_path / f"p{k}"), records[a:b]) for k, (a, b) in enumerate(((0, 4), (4, 9)))]
    shardstore.merge_caches(parts, str(tmp_path / "m"))
    many = LatentCache(str(tmp_path / "m"))
    assert many.dtype == one.dtype == dtype and torch.equal(many[6], one[6])
    assert_same_batches(one, many, [[8, 0, 4, 3]], dtype=dtype)
    assert_same_batches(one, many, [[8, 0, 4, 3]], fields=["latent"])


def test_sampled_and_flipped_reads_of_a_sharded_cache(tmp_path):
    gen = torch.Generator().manual_seed(5)
    records = [(f"k{i}", {"latent": torch.randn((2, 3, 4), generator=gen).half(),
                          "latent_std": torch.rand((2, 3, 4), generator=gen).half(),
                          "latent_flipped": torch.randn((2, 3, 4), generator=gen).half()}) for i in range(10)]
    one, many = sharded_and_single(tmp_path, records, 3, order=np.random.default_rng(3).permutation(10))
    for kwargs in ({"sample": True, "seed": 3}, {"flip": 0.5, "seed": 1, "epoch": 2}):
        assert_same_batches(one, many, [[9, 0, 4, 4, 7]], fields=["latent"], **kwargs)
