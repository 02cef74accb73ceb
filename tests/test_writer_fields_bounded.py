"""The writer's record fields with bounded memory (issue 33): per field, spans, CRCs and presence in
tables of the build folder and the distinct values in a mapped hash table, not Python lists and dicts.

The finished files are checked against the digests of what the writer of ``main`` before the change
wrote for the same appends (:mod:`fields_scenarios`), through ``append`` one by one, ``append_many`` of
record batches, a SIGKILL and a resume, and a damaged value dropped and rewritten; the writer's heap
(tracemalloc's peak) against the item count.
"""
from __future__ import annotations

import json
import os
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import torch

import fields_scenarios
from fields_scenarios import SCENARIOS, write_one_by_one
from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.store import durable
from latentfast.cache.store import format as fmt
from latentfast.cache.store.building import Column, HashRuns
from latentfast.cache.store.fields import entry_text, field_path
from latentfast.cache.store.writer import record_lines
from latentfast.errors import CacheCorruptError, InvalidArgumentError, NonFiniteError
from latentfast.testing import run_until_held

HERE = os.path.dirname(os.path.abspath(__file__))

MAIN_DIGESTS = {  # sha256 (first 16 hex digits) of each file, written by `main`'s writer at b42a54e (fields_scenarios.py)
    "optional_any": {
        "field.extra.crc32.npy": "81091ad2037e5aac",
        "field.extra.dat": "5dcd48203ad71540",
        "field.extra.present.npy": "f5d3cf9536c7c0b3",
        "field.extra.spans.npy": "3debd74f202a9361",
        "field.ids.crc32.npy": "b38ea1ce8a3ece4a",
        "field.ids.dat": "5e3d43d78d9543e2",
        "field.ids.spans.npy": "a26a2d9b88e842f4",
        "field.pooled.crc32.npy": "8e43859524cf5ac5",
        "field.pooled.dat": "57aeff2713e773f4",
        "field.pooled.present.npy": "c21b996573022ab4",
        "field.pooled.spans.npy": "d36db0e8bfd0a018",
        "latents.crc32.npy": "94308b67ab029d07",
        "latents.f16.dat": "1a176c227777be51",
        "latents.index.crc32.npy": "65531cbde11e81a1",
        "latents.keys.bin": "d810d36f0336bd97",
        "latents.keys.crc32.npy": "adb20fc43c84f257",
        "latents.keys.hash.npy": "2512e1e9cd7b8959",
        "latents.keys.json": "8e37a097a7926d29",
        "latents.keys.offsets.npy": "f096f9c4bd8a37a4",
        "latents.keys.rows.npy": "79cd70659864e402",
        "latents.meta.json": "c778d8e51cdc6726",
        "latents.offsets.npy": "bb96361a0b4e0f0d",
        "latents.shapes.npy": "97c4459a5d3a39c5",
    },
    "optional_named": {
        "field.caption.crc32.npy": "e6ea5ed93d9873bb",
        "field.caption.dat": "4f1031607cf03b7d",
        "field.caption.present.npy": "7911fe0f5a388557",
        "field.caption.spans.npy": "d2187be0056c0b15",
        "field.score.crc32.npy": "27ae38135e17a024",
        "field.score.dat": "2e56f28a9e0f9491",
        "field.score.spans.npy": "7b87bd57b5b3471d",
        "latents.crc32.npy": "070b7053d06d3273",
        "latents.f16.dat": "91b946cc2c38eabb",
        "latents.index.crc32.npy": "1b81faebfbb204d8",
        "latents.keys.bin": "6ac864c89a2ea763",
        "latents.keys.crc32.npy": "2fd0d8f50248a7cb",
        "latents.keys.hash.npy": "80694cb52cc0ad9e",
        "latents.keys.json": "4d74ae69241613d4",
        "latents.keys.offsets.npy": "771f46f1d60c86c0",
        "latents.keys.rows.npy": "7a80df3eb21acab2",
        "latents.meta.json": "3c655ce3a41e31f5",
        "latents.offsets.npy": "6a1d64a4567f19ec",
        "latents.shapes.npy": "7d5921b5a2a9743c",
    },
    "tiny": {
        "field.mask.crc32.npy": "388a3dba22973eb5",
        "field.mask.dat": "5662f032aa2d83d8",
        "field.mask.spans.npy": "2ac79024fcce7af9",
        "field.pooled.crc32.npy": "983840506fdb8ea4",
        "field.pooled.dat": "4e7146d1290c9897",
        "field.pooled.spans.npy": "fe5a6cf064d4080b",
        "latents.crc32.npy": "47d62af153ec3ba0",
        "latents.f16.dat": "02521226a2964066",
        "latents.hashes.npy": "affd9a25eb847e37",
        "latents.index.crc32.npy": "a0b54bb75ed4bb0a",
        "latents.keys.bin": "ed94215820fd88a2",
        "latents.keys.crc32.npy": "4976a6ec9089d961",
        "latents.keys.hash.npy": "3aa145598e71d507",
        "latents.keys.json": "ca8116425eb08c0f",
        "latents.keys.offsets.npy": "cabb7dd696a05e65",
        "latents.keys.rows.npy": "0eb16a655b02b5a7",
        "latents.meta.json": "b9026b48c21a7570",
        "latents.offsets.npy": "8e4f297ea4df9e75",
        "latents.shapes.npy": "c06e061fa6c7bb19",
    },
    "two_fields": {
        "field.mask.crc32.npy": "08d6a26655310998",
        "field.mask.dat": "60c2c9027db7f2c2",
        "field.mask.spans.npy": "0249c9842961a85c",
        "field.text.crc32.npy": "c93a3dc192431ec6",
        "field.text.dat": "f3d5de7b88cb8500",
        "field.text.spans.npy": "97c1eabf11aaec80",
        "latents.crc32.npy": "2932edd2551b94db",
        "latents.f16.dat": "e08b19609cfd98d9",
        "latents.hashes.npy": "a23352238faf81dd",
        "latents.index.crc32.npy": "85e1d066fdc83888",
        "latents.info.json": "992ba070cb7d23d0",
        "latents.keys.bin": "3cf79e46b286eb97",
        "latents.keys.crc32.npy": "7a7288cb92faf15a",
        "latents.keys.hash.npy": "f7fdfc8bc256181c",
        "latents.keys.json": "713728cf2934e75a",
        "latents.keys.offsets.npy": "dfcd7618b1940670",
        "latents.keys.rows.npy": "2645bb99e985a430",
        "latents.meta.json": "96cdf0ece2fe4273",
        "latents.offsets.npy": "6e3a2fe5583ae6fc",
        "latents.shapes.npy": "efa56b102eb2a18a",
    },
}


def digests(folder) -> dict[str, str]:
    """The first 16 hex digits of each file's sha256, by name without the split (nothing else may be left)."""
    found = {name.removeprefix("train."): digest[:16] for name, digest in fields_scenarios.digests(folder).items()}
    assert all(not n.startswith(".") and not n.endswith((".partial", ".progress")) for n in found), sorted(found)
    return found


def raw_bytes(value) -> bytes:
    return torch.as_tensor(value).reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_values_stored_once(folder, items) -> None:
    """Each field's data file holds each distinct value once (padded to even bytes), whatever items share it."""
    for name, entry in LatentCache(folder).meta["fields"].items():
        distinct = {raw_bytes(record[name]) for _, record, _, _ in items if name in record}
        assert entry["stored_bytes"] == sum(len(b) + len(b) % 2 for b in distinct) == os.path.getsize(field_path(folder, "train", name, "data"))


def batch_of(run, rng):
    """``append_many``'s record batch of ``run`` (items of one latent shape): a field stacked where every item
    has a value of one shape (and not by chance), else a list of values with None where an item lacks it."""
    names = list(dict.fromkeys(n for _, record, _, _ in run for n in record))
    batch = {}
    for name in names:
        values = [record.get(name) for _, record, _, _ in run]
        stackable = all(v is not None and tuple(v.shape) == tuple(values[0].shape) for v in values)
        if name == "latent" or (stackable and rng.random() < 0.7):
            batch[name] = torch.stack(values) if isinstance(values[0], torch.Tensor) else np.stack(values)
        else:
            batch[name] = values
    return batch


def write_in_batches(folder, options, items, seed=0, flush_every=7, writer=None):
    """``items`` through ``append_many`` in runs of 1..200 items of one latent shape (an item with info
    through ``append``)."""
    rng = np.random.default_rng(seed)
    if writer is None:
        writer = LatentCacheWriter(folder, flush_every=flush_every, **options)
    i = 0
    while i < len(items):
        key, record, source, info = items[i]
        if info is not None:
            writer.append(key, record, source_hash=source, info=info)
            i += 1
            continue
        run, size = [items[i]], int(rng.integers(1, 200))
        while len(run) < size and i + len(run) < len(items) and items[i + len(run)][3] is None \
                and tuple(items[i + len(run)][1]["latent"].shape) == tuple(record["latent"].shape):
            run.append(items[i + len(run)])
        writer.append_many([k for k, _, _, _ in run], batch_of(run, rng), source_hashes=[s for _, _, s, _ in run])
        i += len(run)
    return writer


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_append_writes_what_the_writer_before_wrote(tmp_path, scenario):
    options, items = SCENARIOS[scenario]()
    write_one_by_one(tmp_path, options, items)
    assert digests(tmp_path) == MAIN_DIGESTS[scenario]
    assert_values_stored_once(tmp_path, items)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_append_many_of_records_writes_what_append_wrote(tmp_path, scenario):
    options, items = SCENARIOS[scenario]()
    write_in_batches(tmp_path, options, items).finish()
    assert digests(tmp_path) == MAIN_DIGESTS[scenario]
    cache = LatentCache(tmp_path)
    for i in (0, len(items) // 2, len(items) - 1):
        got, want = cache.record(i), items[i][1]
        assert set(got) == set(want)
        for name, value in want.items():
            assert got[name].dtype == torch.as_tensor(value).dtype and raw_bytes(got[name]) == raw_bytes(value), (i, name)


def test_record_lines_are_the_encoders_lines():
    entries = {"mask": {"c": 7, "d": "bool", "n": 5, "o": 10, "s": [5], "x": "ab" * 16},
               "score": {"c": 0, "d": "float64", "n": 8, "o": 0, "s": [], "x": "00" * 16},
               "text": {"c": 2**32 - 1, "d": "bfloat16", "n": 0, "o": 4, "s": [0, 3], "x": "ff" * 16}}
    for name, e in entries.items():
        assert entry_text(e["o"], e["n"], json.dumps(e["s"]), e["c"], e["d"], e["x"]) == durable._LOG_ENCODER.encode(e)
    keys, crcs, hashes = ["a", "é\"\\\n", "\U0001f600", "k"], [0, 1, 12345, 2**32 - 1], [None, "00" * 16, None, "ab" * 16]
    have = [("mask", "score", "text"), ("text",), (), ("mask", "score")]
    fields = {name: [f'"{name}": {durable._LOG_ENCODER.encode(entries[name])}' if name in h else None for h in have]
              for name in ("text", "mask", "score")}
    for dtype in ("float16", "bfloat16"):
        records = [{"c": c, "k": k, "s": [4, 1, 2], **({} if dtype == "float16" else {"d": dtype}), **({} if h is None else {"h": h}),
                    **({"f": {n: entries[n] for n in names}} if names else {})} for k, c, h, names in zip(keys, crcs, hashes, have)]
        assert record_lines(keys, [4, 1, 2], dtype, crcs, hashes, fields).encode() == durable.log_bytes(b"", records)


_KILLED_BUILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    import fields_scenarios, test_writer_fields_bounded as t
    from latentfast.cache import LatentCacheWriter
    from latentfast.testing import hold_when
    folder, scenario = sys.argv[1], sys.argv[2]
    options, items = fields_scenarios.SCENARIOS[scenario]()
    writer = LatentCacheWriter(folder, flush_every=32, **options)
    t.write_in_batches(folder, options, items[: len(items) // 3], writer=writer)
    for key, record, source, info in items[len(items) // 3: 2 * len(items) // 3]:  # one by one
        writer.append(key, record, source_hash=source, info=info)
    hold_when(True)  # (killed here: the items after the last flush are in the data files, not in the log)
""")


@pytest.mark.parametrize("scenario", ["tiny", "two_fields", "optional_any"])
def test_resume_after_sigkill_finishes_the_same_cache(tmp_path, scenario):
    folder = tmp_path / "c"
    run_until_held([sys.executable, "-c", _KILLED_BUILD, str(folder), scenario, HERE], str(tmp_path / "held"),
                   progress=fmt.cache_path(folder, "train", "progress"))
    options, items = SCENARIOS[scenario]()
    appended = 2 * len(items) // 3
    writer = LatentCacheWriter(folder, flush_every=32, **options)
    assert writer.resumed and appended - 32 < len(writer) <= appended  # (those after the last flush are lost)
    assert items[len(writer) - 1][0] in writer and items[len(writer)][0] not in writer
    write_in_batches(folder, options, items[len(writer):], seed=1, writer=writer).finish()
    assert digests(folder) == MAIN_DIGESTS[scenario]
    assert_values_stored_once(folder, items)  # equal values stored once, before the kill and after it


def test_a_cut_drops_the_fields_values_after_it_and_a_field_first_seen_after_it(tmp_path):
    """A damaged latent before ``extra``'s first item (item 50): ``extra`` goes with the cut; a damaged
    ``pooled`` value later: the values it and the items after it stored go. Each rerun writes the same cache."""
    options, items = SCENARIOS["optional_any"]()
    writer = write_in_batches(tmp_path, options, items[:120])
    writer.flush()
    data = fmt.partial_path(fmt.cache_path(tmp_path, "train", "data"))
    with open(data, "r+b") as fh:  # item 30's latent (bfloat16 [4, 2, 2]: 32 bytes an item)
        fh.seek(30 * 32 + 3)
        fh.write(bytes([fh.read(1)[0] ^ 4]))
    with pytest.raises(CacheCorruptError, match=r"item 30 \(key 'k30'\) on disk differs"):
        writer.finish()
    assert len(writer) == 30 and not os.path.exists(fmt.partial_path(field_path(tmp_path, "train", "extra", "data")))
    write_in_batches(tmp_path, options, items[30:], writer=writer)
    writer.flush()
    logged = [json.loads(line).get("f", {}).get("pooled") for line in open(fmt.cache_path(tmp_path, "train", "progress"), "rb").read().splitlines()[1:]]
    offsets = [e and e["o"] for e in logged]
    owner = next(k for k, e in enumerate(logged) if k > 100 and e and e["o"] not in offsets[:k])  # the item that stored a value
    offset = logged[owner]["o"]
    with open(fmt.partial_path(field_path(tmp_path, "train", "pooled", "data")), "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes([fh.read(1)[0] ^ 1]))
    with pytest.raises(CacheCorruptError, match=rf"item {owner} \(key 'k{owner}'\) on disk differs"):
        writer.finish()
    assert len(writer) == owner
    for key, record, source, info in items[owner:]:
        writer.append(key, record, source_hash=source, info=info)
    writer.finish()
    assert digests(tmp_path) == MAIN_DIGESTS["optional_any"]


def test_batches_of_records_are_checked_before_anything_is_written(tmp_path):
    z = np.zeros((3, 4, 1, 2), np.float16)
    writer = LatentCacheWriter(tmp_path, optional=("text",))
    with pytest.raises(InvalidArgumentError, match="no 'latent' field"):
        writer.append_many(["a", "b", "c"], {"pooled": np.zeros((3, 2), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"field 'pooled' must be a \[B, \*shape\].*B = len\(keys\) = 3"):
        writer.append_many(["a", "b", "c"], {"latent": z, "pooled": np.zeros((2, 2), np.float32)})
    with pytest.raises(InvalidArgumentError, match="field 'pooled' of a batch of 3 records must be"):
        writer.append_many(["a", "b", "c"], {"latent": z, "pooled": [np.zeros(2, np.float32)]})
    bad = np.zeros((3, 2), np.float32)
    bad[2, 1] = np.nan
    with pytest.raises(NonFiniteError, match="field 'pooled' of key 'c'"):
        writer.append_many(["a", "b", "c"], {"latent": z, "pooled": bad})
    with pytest.raises(InvalidArgumentError, match=r"key 'b' has the fields \[\].*\['pooled'\] are not optional"):
        writer.append_many(["a", "b", "c"], {"latent": z, "pooled": [np.zeros(2, np.float32), None, np.ones(2, np.float32)]})
    with pytest.raises(InvalidArgumentError, match="field 'latent_flipped' of key 'a' has shape"):
        writer.append_many(["a", "b", "c"], {"latent": z, "latent_flipped": np.zeros((3, 4, 1, 3), np.float16)})
    with pytest.raises(InvalidArgumentError, match=r"field 'text' of key 'b' is int32 1-D.*declared it int16 1-D \(first item 'a'\)"):
        writer.append_many(["a", "b", "c"], {"latent": z, "text": [np.zeros(2, np.int16), np.zeros(3, np.int32), None]})
    assert len(writer) == 0 and not [n for n in os.listdir(tmp_path) if n.startswith("train.field.")]  # nothing written
    writer.append_many(["a", "b", "c"], {"latent": z, "pooled": np.ones((3, 2), np.float32), "text": [None, np.zeros(2, np.int16), None]})
    with pytest.raises(InvalidArgumentError, match="records of the fields .*append_many a dict of their batches"):
        writer.append_many(["d"], np.zeros((1, 4, 1, 2), np.float16))
    with pytest.raises(InvalidArgumentError, match=r"\['pooled'\] are not optional"):
        writer.append_many(["d"], {"latent": z[:1]})
    with pytest.raises(InvalidArgumentError, match=r"field 'pooled' of key 'd' is float64 1-D.*declared it float32"):
        writer.append_many(["d"], {"latent": z[:1], "pooled": np.ones((1, 2), np.float64)})
    assert len(writer) == 3
    writer.finish()
    cache = LatentCache(tmp_path)
    assert cache.record(1)["text"].tolist() == [0, 0] and "text" not in cache.record(0) and cache.record(2)["pooled"].tolist() == [1, 1]


def test_hash_runs_retain_keeps_the_items_below_the_cut(tmp_path):
    slots = HashRuns(str(tmp_path / "slots"), memory_slots=64, chunk=7, stride=4, fence_max=8)
    rng = np.random.default_rng(5)
    hashes = rng.integers(0, 2**64, 2000, dtype=np.uint64)
    hashes[500:600] = hashes[3]  # equal hashes across the cut
    slots.add(hashes, np.arange(2000))
    slots.retain(1234)
    assert slots.count == 1234
    which, found = slots.find(hashes)
    assert sorted(zip(which.tolist(), found.tolist())) == sorted(
        (i, j) for i in range(2000) for j in ([k for k in range(1234) if hashes[k] == hashes[i]] if i in range(500, 600) or i == 3
                                              else [i] if i < 1234 else []))
    slots.add_one(int(hashes[1500]), 1500)
    assert slots.find_one(int(hashes[1500])) == [1500]
    slots.close()


def test_column_reads_staged_rows_without_writing_them(tmp_path):
    column = Column(str(tmp_path / "c"), np.int64, 2)
    rows = np.arange(40, dtype=np.int64).reshape(20, 2)
    column.append(rows[:10], 10)
    column.write_out()
    column.append(rows[10:], 10)
    assert np.array_equal(column.read(12, 15), rows[12:15]) and os.path.getsize(tmp_path / "c") == 10 * 16  # staged: read, not written
    assert np.array_equal(column.read(8, 13), rows[8:13]) and os.path.getsize(tmp_path / "c") == 20 * 16
    column.close()


def _heap(folder, n, fields=True, batch=4096) -> tuple[int, int]:
    """``(heap held after the appends less that after the first batch, tracemalloc's peak through finish)``
    of writing ``n`` tiny items by batches: records of two fields, or (``fields`` False) plain latents."""
    rng = np.random.default_rng(0)
    z = np.zeros((batch, 4, 1, 1), np.float16)
    tracemalloc.start()
    try:
        with LatentCacheWriter(folder, flush_every=batch) as writer:
            for s in range(0, n, batch):
                count = min(batch, n - s)
                pooled = rng.integers(-99, 99, (count, 4)).astype(np.float32)  # all but distinct
                mask = (np.arange(s, s + count) % 3).astype(np.uint8)[:, None].repeat(3, axis=1)  # 3 distinct values
                writer.append_many([f"item{i:09d}" for i in range(s, s + count)],
                                   {"latent": z[:count], "pooled": pooled, "mask": mask} if fields else z[:count])
                if s == 0:
                    held = tracemalloc.get_traced_memory()[0]
            held = tracemalloc.get_traced_memory()[0] - held
        return held, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_writer_heap_with_fields_does_not_grow_with_the_item_count(tmp_path, monkeypatch):
    """The heap the writer holds after appending 10^4 and 10^5 records of two fields is the same, and the
    fields add a fixed amount to its peak (through ``finish``) over plain items: the writer before kept a
    dict per item and field and a key per distinct value (~1.4 KiB an item of two fields: 142 MiB at 10^5
    in ``bench_fields --writer``; a dict per item put back in a list fails the first check, +36 MiB)."""
    monkeypatch.setattr("latentfast.cache.store.building.STAGE_BYTES", 1 << 16)  # the tables' staging: 64 KiB each
    small_held, _ = _heap(tmp_path / "small", 10_000)
    large_held, large_peak = _heap(tmp_path / "large", 100_000)
    _, plain_peak = _heap(tmp_path / "plain", 100_000, fields=False)
    assert abs(large_held - small_held) < 512 * 2**10, (small_held, large_held)
    assert large_peak - plain_peak < 4 * 2**20, (plain_peak, large_peak)
    assert len(LatentCache(tmp_path / "large")) == 100_000
