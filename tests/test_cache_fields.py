"""Records of named fields in a latent cache: dtypes stored bit for bit, per-item shapes, padded
batches, equal values stored once, resume after SIGKILL, DataLoader workers, old caches unchanged."""
import json
import os
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from latentfast.cache import DevicePrefetcher, LatentCache, LatentCacheWriter
from latentfast.cache.feed.loader import CacheBatchDataset
from latentfast.cache.store import fields as fieldstore
from latentfast.cache.store.fields import field_path
from latentfast.cache.store.format import cache_path
from latentfast.cache import inspect_cache
from latentfast.cli import main
from latentfast.errors import InvalidArgumentError
from latentfast.testing import kill_and_resume, write_random_cache


def random_bits(gen: torch.Generator, shape, dtype) -> torch.Tensor:
    """Every bit pattern but a float's NaN and inf (which the writer refuses), -0.0 and subnormals included
    (what a value cast anywhere would not survive)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * size,), generator=gen, dtype=torch.uint8)
    values = raw.view(dtype).reshape(shape)
    return torch.where(torch.isfinite(values), values, torch.zeros_like(values)) if dtype.is_floating_point else values


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def latent(gen, i):
    return torch.randn((4, 3, 5 + i % 2), generator=gen).half()


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool]


def build_records(folder, n=9, seed=0, **writer_kwargs):
    """Items with a fixed-shape latent, a variable-length bf16 text, a pooled f32 vector, an int64 id
    row and a bool mask of odd byte count; captions repeat every 3 items."""
    gen = torch.Generator().manual_seed(seed)
    captions = [random_bits(gen, (2 + 3 * c, 6), torch.bfloat16) for c in range(3)]
    records = []
    for i in range(n):
        c = i % 3
        records.append((f"k{i}", {"latent": torch.randn((4, 3, 5), generator=gen).half(), "text": captions[c],
                                  "pooled": torch.randn(7, generator=gen), "ids": torch.arange(3) + i,
                                  "mask": torch.rand((2 + 3 * c,), generator=gen) > 0.5}))
    with LatentCacheWriter(folder, **writer_kwargs) as writer:
        for key, record in records:
            writer.append(key, record, info={"i": key})
    return records


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype):
    gen = torch.Generator().manual_seed(1)
    values = [random_bits(gen, (1 + i % 3, 5), dtype) for i in range(7)]
    with LatentCacheWriter(tmp_path) as writer:
        for i, v in enumerate(values):
            writer.append(f"k{i}", {"latent": latent(gen, 0), "x": v})
    cache = LatentCache(tmp_path)
    assert cache.fields["x"]["dtype"] == dtype and cache.fields["x"]["ndim"] == 2
    assert cache.fields["x"]["shapes"].tolist() == [list(v.shape) for v in values]
    for i, v in enumerate(values):
        got = cache.record(i)["x"]
        assert got.dtype == dtype and got.shape == v.shape and torch.equal(bits(got), bits(v))
    batch = cache.read_batch([5, 0, 4], fields=("x",), pad={"x": 0})
    assert batch["x"].dtype == dtype and batch["x"].shape == (3, 3, 5)
    for b, i in enumerate([5, 0, 4]):
        L = values[i].shape[0]
        assert torch.equal(bits(batch["x"][b, :L]), bits(values[i]))
        assert not bits(batch["x"][b, L:]).any()  # padding 0: zero bits in every dtype
    assert batch["x_shape"].tolist() == [list(values[i].shape) for i in (5, 0, 4)]


def test_records_read_back_and_latent_stays_the_item(tmp_path):
    records = build_records(tmp_path)
    cache = LatentCache(tmp_path)
    assert sorted(cache.fields) == ["ids", "latent", "mask", "pooled", "text"]
    assert cache.fields["text"]["dtype"] == torch.bfloat16 and cache.fields["mask"]["dtype"] == torch.bool
    for i, (key, record) in enumerate(records):
        assert torch.equal(cache[i], record["latent"]) and cache.keys[i] == key and cache.info(i) == {"i": key}
        got = cache.record(i)
        assert sorted(got) == sorted(record)
        for name, value in record.items():
            assert got[name].dtype == value.dtype and torch.equal(bits(got[name]), bits(value)), name


def test_read_batch_of_fields_pads_and_reports_true_shapes(tmp_path):
    records = build_records(tmp_path)
    cache = LatentCache(tmp_path)
    index = [4, 1, 8, 1]
    batch = cache.read_batch(index, fields=("latent", "text", "pooled", "mask", "ids"),
                             pad={"text": -2.5, "mask": True}, dtype=torch.float32)
    assert sorted(batch) == sorted(["latent", "text", "pooled", "mask", "ids"] + [f"{n}_shape" for n in
                                                                                  ("latent", "text", "pooled", "mask", "ids")])
    assert batch["latent"].dtype == torch.float32 and batch["latent"].shape == (4, 4, 3, 5)
    longest = max(records[i][1]["text"].shape[0] for i in index)
    assert batch["text"].shape == (4, longest, 6) and batch["text"].dtype == torch.bfloat16
    for b, i in enumerate(index):
        r = records[i][1]
        L = r["text"].shape[0]
        assert torch.equal(batch["latent"][b], r["latent"].float())
        assert torch.equal(bits(batch["text"][b, :L]), bits(r["text"]))
        assert (batch["text"][b, L:] == -2.5).all()
        assert torch.equal(batch["mask"][b, :L], r["mask"]) and batch["mask"][b, L:].all()
        assert torch.equal(batch["pooled"][b], r["pooled"]) and torch.equal(batch["ids"][b], r["ids"])
        assert batch["text_shape"][b].tolist() == list(r["text"].shape)
    assert batch["text_shape"].dtype == torch.int64 and batch["latent_shape"].tolist() == [[4, 3, 5]] * 4
    padded = cache.read_batch(index, fields="text", pad={"text": 0.0}, pad_to=20)
    assert padded["text"].shape == (4, 20, 6)
    for b, i in enumerate(index):
        L = records[i][1]["text"].shape[0]
        assert torch.equal(bits(padded["text"][b, :L]), bits(records[i][1]["text"])) and not bits(padded["text"][b, L:]).any()
    # without fields: exactly what it returned before
    latents, shapes = cache.read_batch(index)
    assert torch.equal(latents, batch["latent"].half()) and torch.equal(shapes, batch["latent_shape"])


def test_unpadded_field_of_several_shapes_names_them(tmp_path):
    build_records(tmp_path)
    cache = LatentCache(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"field 'text'.*2 shapes: \[2, 6\] \(indices\[0\] = 0\), \[5, 6\] \(indices\[1\] = 1\)"):
        cache.read_batch([0, 1, 3], fields=("text",))
    with pytest.raises(InvalidArgumentError, match=r"pad_to\['text'\] = 3 is shorter than indices\[1\] = 1"):
        cache.read_batch([0, 1], fields=("text",), pad={"text": 0.0}, pad_to=3)
    with pytest.raises(InvalidArgumentError, match="fields must name distinct fields"):
        cache.read_batch([0], fields=("caption",))
    with pytest.raises(InvalidArgumentError, match=r"pad\['ids'\] = 0.5 is not a value"):
        cache.read_batch([0], fields=("ids",), pad={"ids": 0.5})
    with pytest.raises(IndexError):
        cache.read_batch([0, 9], fields=("text",), pad={"text": 0.0})


def test_writer_refuses_changed_dtype_ndim_fields_and_cast_latent(tmp_path):
    gen = torch.Generator().manual_seed(0)
    with LatentCacheWriter(tmp_path) as writer:
        writer.append("a", {"latent": latent(gen, 0), "text": torch.zeros(3, 8, dtype=torch.bfloat16)})
        with pytest.raises(InvalidArgumentError, match=r"field 'text' of key 'b' is float32 2-D .* declared it bfloat16 2-D \(first item 'a'\)"):
            writer.append("b", {"latent": latent(gen, 0), "text": torch.zeros(3, 8)})
        with pytest.raises(InvalidArgumentError, match=r"field 'text' of key 'b' is bfloat16 3-D"):
            writer.append("b", {"latent": latent(gen, 0), "text": torch.zeros(1, 3, 8, dtype=torch.bfloat16)})
        with pytest.raises(InvalidArgumentError, match=r"has the fields \[\], but this cache's records have \['text'\]"):
            writer.append("b", {"latent": latent(gen, 0)})
        with pytest.raises(InvalidArgumentError, match="latent of key 'b' is float32, but this cache's latents are float16.*no silent cast"):
            writer.append("b", {"latent": latent(gen, 0).float(), "text": torch.zeros(3, 8, dtype=torch.bfloat16)})
        with pytest.raises(InvalidArgumentError, match="append a dict"):
            writer.append("b", latent(gen, 0))
        writer.append("b", {"latent": latent(gen, 0), "text": torch.ones(5, 8, dtype=torch.bfloat16)})
    assert len(LatentCache(tmp_path)) == 2  # the refused appends wrote nothing


def test_equal_values_are_stored_once(tmp_path):
    records = build_records(tmp_path, n=12)
    cache = LatentCache(tmp_path)
    text = [r["text"] for _, r in records]
    distinct = {bytes(bits(t).numpy()) for t in text}
    assert len(distinct) == 3
    stored = sum(len(b) for b in distinct)
    assert os.path.getsize(field_path(tmp_path, "train", "text", "data")) == stored
    assert cache.meta["fields"]["text"]["logical_bytes"] == sum(t.numel() * 2 for t in text)
    info = inspect_cache(tmp_path)
    assert info["fields"]["text"]["stored_bytes"] == stored and info["fields"]["text"]["logical_bytes"] == 4 * stored
    pooled = os.path.getsize(field_path(tmp_path, "train", "pooled", "data"))
    assert pooled == 12 * 7 * 4  # all different: all stored


def test_a_hash_collision_never_merges_different_values(tmp_path, monkeypatch):
    monkeypatch.setattr(fieldstore, "value_hash", lambda payload: b"\0" * 16)  # every value a candidate of every other
    records = build_records(tmp_path, n=9)
    cache = LatentCache(tmp_path)
    for i, (_, record) in enumerate(records):
        for name, value in record.items():
            assert torch.equal(bits(cache.record(i)[name]), bits(value)), (i, name)
    sizes = [bits(r["text"]).numel() for _, r in records[:3]]
    assert os.path.getsize(field_path(tmp_path, "train", "text", "data")) == sum(sizes)  # equal ones still shared


def test_inspect_cli_prints_logical_and_stored_bytes(tmp_path, capsys):
    build_records(tmp_path, n=6)
    assert main(["cache", "inspect", str(tmp_path)]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.split()[:1] == ["text"])
    text = LatentCache(tmp_path).meta["fields"]["text"]
    assert text["logical_bytes"] == 2 * text["stored_bytes"]
    assert f"{text['logical_bytes']:,}" in line and f"{text['stored_bytes']:,}" in line and "bfloat16" in line


def test_old_caches_open_as_single_field_caches(tmp_path):
    folders = write_random_cache(str(tmp_path), 10, 4, 3, 9, seed=3)
    for folder in folders.values():
        check_single_field(LatentCache(folder))


def check_single_field(cache):
    assert list(cache.fields) == ["latent"] and cache.fields["latent"]["dtype"] == torch.float16
    assert torch.equal(cache.record(2)["latent"], cache[2])
    batch = cache.read_batch([1, 5], fields=("latent",))
    latents, widths = cache.read_batch([1, 5])
    assert torch.equal(batch["latent"], latents) and batch["latent_shape"][:, 2].tolist() == widths.tolist()


def test_corrupted_field_value_is_caught_by_verify_rows(tmp_path):
    build_records(tmp_path, n=6)
    path = field_path(tmp_path, "train", "text", "data")
    with open(path, "r+b") as fh:
        fh.seek(3)
        byte = fh.read(1)
        fh.seek(3)
        fh.write(bytes([byte[0] ^ 0xFF]))
    cache = LatentCache(tmp_path, verify_rows=True)
    with pytest.raises(Exception, match="field 'text'.*item 0's value fails its CRC-32"):
        cache.read_batch([0], fields=("text",), pad={"text": 0.0})
    cache.read_batch([1], fields=("text",), pad={"text": 0.0})  # another value: fine


RECORD_SCRIPT = """
import sys
import torch
from latentfast.cache import LatentCacheWriter
from latentfast.testing import hold_when
folder = sys.argv[1]
gen = torch.Generator().manual_seed(0)
captions = [torch.randn((3 + c, 16), generator=gen).bfloat16() for c in range(4)]
items = [(f"k{i:03d}", {"latent": torch.randn((4, 3, 5), generator=gen).half(), "text": captions[i % 4],
                        "ids": torch.arange(i % 5 + 1)}) for i in range(60)]
written = 0
with LatentCacheWriter(folder, flush_every=2) as writer:
    for key, record in items:
        if key in writer:
            continue
        writer.append(key, record)
        written += 1
        hold_when(written == int(sys.argv[2]))  # the test kills it here, on its first run
print("written", written)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only: three Python processes under whatever load the machine has
def test_sigkill_mid_build_with_fields_resumes_to_the_same_bytes(tmp_path):
    folder, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    logged, written = kill_and_resume(RECORD_SCRIPT, folder, ref)
    assert logged > 0 and written <= 60 - logged  # the logged records were not written again
    for kind in ("data", "shapes", "offsets", "keys", "checksums", "meta"):
        assert open(cache_path(folder, "train", kind), "rb").read() == open(cache_path(ref, "train", kind), "rb").read(), kind
    for name in ("text", "ids"):
        for kind in ("data", "spans", "crc"):
            a, b = field_path(folder, "train", name, kind), field_path(ref, "train", name, kind)
            assert open(a, "rb").read() == open(b, "rb").read(), (name, kind)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_and_prefetcher_read_records(tmp_path, context):
    build_records(tmp_path, n=12)
    cache = LatentCache(tmp_path)
    dataset = CacheBatchDataset(cache, fields=("latent", "text", "mask"), pad={"text": 0.0, "mask": False})
    batches = [[0, 1, 2], [5, 3], [11, 7, 8, 4]]
    single = [dataset[b] for b in batches]
    loader = DataLoader(dataset, batch_size=None, sampler=batches, num_workers=2, multiprocessing_context=context)
    workers = list(DevicePrefetcher(loader, "cpu"))
    assert len(workers) == len(single)
    for a, b in zip(single, workers):
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])), k


@pytest.mark.parametrize("cold", [True, "auto", False])
def test_field_batches_through_the_cold_read_path(tmp_path, cold):
    from latentfast.cache.feed import coldread

    records = build_records(tmp_path, n=9)
    cache = LatentCache(tmp_path)
    coldread.evict(field_path(tmp_path, "train", "text", "data"))
    batch = cache.read_batch([8, 2, 5], fields=("text", "pooled"), pad={"text": 0.0}, cold=cold)
    for b, i in enumerate([8, 2, 5]):
        L = records[i][1]["text"].shape[0]
        assert torch.equal(bits(batch["text"][b, :L]), bits(records[i][1]["text"]))
        assert torch.equal(batch["pooled"][b], records[i][1]["pooled"])


def test_row_spans_of_shared_values_end_where_the_value_ends():
    from latentfast.cache.feed.coldread import PAGE, row_spans

    starts = np.asarray([0, 0, 3 * PAGE], dtype=np.int64) // 2  # items 0 and 1 share one value
    ends = np.asarray([PAGE, PAGE, 4 * PAGE], dtype=np.int64) // 2
    offsets, lengths = row_spans(starts, np.asarray([1, 2]), row_ends=ends)
    assert offsets.tolist() == [0, 3 * PAGE] and lengths.tolist() == [PAGE, PAGE]


def test_verify_cache_checks_every_field_value(tmp_path):
    from latentfast.cache import verify_cache
    from latentfast.errors import CacheCorruptError

    build_records(tmp_path, n=6)
    assert verify_cache(tmp_path)["rows"] == 6
    path = field_path(tmp_path, "train", "pooled", "data")
    with open(path, "r+b") as fh:
        fh.seek(7 * 4 * 4 + 1)  # item 4's pooled vector
        fh.write(b"\x55")
    with pytest.raises(CacheCorruptError, match="field 'pooled'.*item 4's value fails its CRC-32"):
        verify_cache(tmp_path)


def test_one_compiled_gather_per_field_per_batch(tmp_path, monkeypatch):
    """_gather_cpu makes one gather_rows_into call; a batch of records makes one _gather_cpu call per field."""
    from latentfast.cache.feed import gather

    build_records(tmp_path, n=9)
    cache = LatentCache(tmp_path)
    calls = []
    real = gather._gather_cpu

    def counted(table, *args):
        calls.append(table.index.numel())
        return real(table, *args)

    monkeypatch.setattr(gather, "_gather_cpu", counted)
    cache.read_batch(list(range(9)), fields=("latent", "text", "pooled", "mask"), pad={"text": 0.0, "mask": False})
    assert calls == [9, 9, 9, 9]


def test_prefetch_brings_in_the_fields_pages_of_the_items_asked_for(tmp_path):
    from latentfast.cache.feed import coldread

    gen = torch.Generator().manual_seed(5)
    texts = [torch.randn((8, 1024), generator=gen).bfloat16() for _ in range(40)]  # 16 KiB each
    with LatentCacheWriter(tmp_path) as writer:
        for i, t in enumerate(texts):
            writer.append(f"k{i}", {"latent": latent(gen, 0), "text": t})
    cache = LatentCache(tmp_path)
    path = field_path(tmp_path, "train", "text", "data")
    if coldread.evict(path) is None:
        pytest.skip("the OS cannot evict or report page residency here")
    field = cache.field_items["text"]
    wanted, elsewhere = np.array([3, 17]), np.array([30, 35])
    cache.prefetch(wanted)
    coldread.wait_for_prefetches()
    handle = coldread.DataFile(path)
    try:
        deadline = time.monotonic() + 300  # advice queues the reads: they land shortly after (a hang guard)
        while time.monotonic() < deadline and handle.missing(*coldread.row_spans(field.row_starts, wanted, row_ends=field.row_ends)).any():
            time.sleep(0.01)
        assert not handle.missing(*coldread.row_spans(field.row_starts, wanted, row_ends=field.row_ends)).any()
        assert handle.missing(*coldread.row_spans(field.row_starts, elsewhere, row_ends=field.row_ends)).all()
    finally:
        handle.close()


def test_finish_finds_a_damaged_field_value_drops_it_and_the_rerun_rewrites_it(tmp_path):
    from latentfast.errors import CacheCorruptError

    gen = torch.Generator().manual_seed(2)
    records = [{"latent": latent(gen, 0), "text": torch.randn((3 + i, 4), generator=gen).bfloat16()} for i in range(4)]
    writer = LatentCacheWriter(tmp_path)
    for i, r in enumerate(records):
        writer.append(f"k{i}", r)
    writer.flush()
    offset = json.loads(open(cache_path(tmp_path, "train", "progress"), "rb").read().splitlines()[3])["f"]["text"]["o"]  # (item 2's log entry of the field)
    with open(fieldstore.fmt.partial_path(field_path(tmp_path, "train", "text", "data")), "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes([fh.read(1)[0] ^ 1]))
    with pytest.raises(CacheCorruptError, match=r"item 2 \(key 'k2'\) on disk differs"):
        writer.finish()
    assert writer.keys == ["k0", "k1"]
    for i in (2, 3):
        writer.append(f"k{i}", records[i])
    writer.finish()
    cache = LatentCache(tmp_path)
    for i, r in enumerate(records):
        assert torch.equal(bits(cache.record(i)["text"]), bits(r["text"])) and torch.equal(cache[i], r["latent"])


def test_empty_batches_and_empty_values(tmp_path):
    gen = torch.Generator().manual_seed(3)
    with LatentCacheWriter(tmp_path) as writer:
        for i in range(3):
            writer.append(f"k{i}", {"latent": latent(gen, 0), "text": torch.ones((i, 4), dtype=torch.bfloat16)})
    cache = LatentCache(tmp_path)
    assert cache.record(0)["text"].shape == (0, 4)
    empty = cache.read_batch([], fields=("latent", "text"), pad={"text": 0.0})
    assert empty["text"].shape == (0, 0, 0) and empty["text_shape"].shape == (0, 2)  # as a shaped cache's empty batch
    batch = cache.read_batch([0, 2, 1], fields=("text",), pad={"text": 7.0})
    assert batch["text"].shape == (3, 2, 4) and (batch["text"][0] == 7).all() and (batch["text"][2, 1] == 7).all()
    assert (batch["text"][1] == 1).all() and (batch["text"][2, 0] == 1).all()
    assert cache.read_batch([0], fields=("text",))["text"].shape == (1, 0, 4)


def test_packed_fields_come_back_to_back_with_their_true_shapes(tmp_path, monkeypatch):
    records = build_records(tmp_path, n=9)
    cache = LatentCache(tmp_path)
    order = [8, 0, 4, 4, 2]
    calls = []
    real = torch.ops.latentfast.gather_rows_packed_into.default
    monkeypatch.setattr(torch.ops.latentfast.gather_rows_packed_into, "default", lambda *a: calls.append(a[4].numel()) or real(*a))
    batch = cache.read_batch(order, fields=("latent", "text", "pooled"), packed=("text",))
    assert calls == [5]  # one packed gather for the field, whatever its items' lengths
    want = torch.cat([records[i][1]["text"] for i in order])
    assert batch["text"].dtype == torch.bfloat16 and torch.equal(bits(batch["text"]), bits(want))
    assert batch["text_shape"].tolist() == [list(records[i][1]["text"].shape) for i in order]
    padded = cache.read_batch(order, fields=("text",), pad={"text": 0.0})
    for b, L in enumerate(batch["text_shape"][:, 0].tolist()):
        start = int(batch["text_shape"][:b, 0].sum())
        assert torch.equal(bits(batch["text"][start:start + L]), bits(padded["text"][b, :L]))
    assert cache.read_batch([], fields=("text",), packed="text")["text"].shape == (0, 0)  # (as a padded empty batch)
    with pytest.raises(InvalidArgumentError, match="odd byte count"):
        cache.read_batch([0, 1], fields=("mask",), packed="mask")  # bools of odd counts: 1-byte values
    with pytest.raises(InvalidArgumentError, match="packed must name requested fields"):
        cache.read_batch([0], fields=("text",), pad={"text": 0.0}, packed="text")
    with pytest.raises(InvalidArgumentError, match="packed must name requested fields"):
        cache.read_batch([0], fields=("latent",), packed="latent")
