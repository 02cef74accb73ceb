"""Regression tests of reliability round 4 (issue 35): a gzip'd ``.pt`` judged by what it inflates to,
merges of different conventions or of one cache twice refused, distributed imports whose ranks
disagree refused alike on every rank, flipped latents of another shape, non-finite record fields,
keys that are not text, ``pad_to`` past its limit, and an import rerun that sees a field's shape or
dtype change when its bytes stay the same."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from latentfast import sampling
from latentfast.cache import LatentCache, LatentCacheWriter, verify_cache
from latentfast.cache.builders.importers import import_latents
from latentfast.cache.store import fields as fieldstore
from latentfast.cache.store import format as fmt
from latentfast.cache.store import shards as shardstore
from latentfast.cache.trainers import fixtures
from latentfast.cli import main
from latentfast.errors import CacheCorruptError, CacheError, InvalidArgumentError, NonFiniteError
from latentfast.testing import random_rows, spawn_gloo, write_cache

MiB = 1 << 20


# -- 1. a gzip'd .pt is judged by the bytes it inflates to, while inflating ---------------------------

def gzip_members(*payloads: bytes) -> bytes:
    """One gzip member per payload, back to back (what ``cat a.gz b.gz`` makes; gunzip reads them all)."""
    return b"".join(gzip.compress(p) for p in payloads)


def torch_saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def inflate_peak(fn) -> tuple[BaseException | None, int]:
    """``(what fn raised, the peak bytes Python allocated while it ran)``."""
    tracemalloc.start()
    try:
        fn()
        raised = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


@pytest.mark.parametrize("shape", ["two members", "lying size field"])
def test_a_gzipped_simpletuner_pt_is_refused_once_it_inflates_past_the_limit(tmp_path, shape):
    root, images = str(tmp_path / "st"), str(tmp_path / "images")
    fixtures.write_simpletuner(root, images, n=2, compress=True, hash_filenames=False)
    victim = os.path.join(root, "vae", "img_000.pt")
    bomb = b"\0" * (64 * MiB)  # 64 KiB compressed
    if shape == "two members":  # a tiny last member: its size field is the only one read before inflating
        data = gzip_members(bomb, torch_saved(torch.zeros(16, 4, 6, dtype=torch.bfloat16)))
    else:  # one member whose size field (the last 4 bytes) says 100 bytes
        data = gzip.compress(bomb)[:-4] + struct.pack("<I", 100)
    with open(victim, "wb") as fh:
        fh.write(data)
    assert os.path.getsize(victim) < MiB
    raised, peak = inflate_peak(lambda: import_latents(root, str(tmp_path / "out"), format="simpletuner", images=images,
                                                        quiet=True, max_item_bytes=4 * MiB))
    assert isinstance(raised, CacheError), raised
    assert victim in str(raised) and "max_item_bytes=4194304" in str(raised) and "inflates" in str(raised), raised
    assert peak < 24 * MiB, f"inflated {peak} bytes before refusing (the limit is 4 MiB)"


def test_a_gzipped_pt_of_the_extension_format_is_judged_by_its_inflated_size(tmp_path):
    src = tmp_path / "pt"
    src.mkdir()
    for i in range(2):
        with open(src / f"z{i}.pt", "wb") as fh:
            fh.write(gzip.compress(torch_saved(torch.full((4, 64, 64), float(i)))))  # 64 KiB each, inflated
    import_latents(str(src), str(tmp_path / "ok"), format="pt", quiet=True, max_item_bytes=MiB)  # under the limit
    assert torch.equal(LatentCache(str(tmp_path / "ok"))[1], torch.full((4, 64, 64), 1.0).half())
    with open(src / "z1.pt", "wb") as fh:
        fh.write(gzip_members(b"\0" * (8 * MiB), torch_saved(torch.zeros(4, 8, 8))))
    with pytest.raises(CacheError, match=r"z1\.pt: a gzip'd \.pt that inflates to more than 1048576 bytes.*max_item_bytes=1048576"):
        import_latents(str(src), str(tmp_path / "bad"), format="pt", quiet=True, max_item_bytes=MiB)


# -- 2. and 4. cache merge: one convention, each key once ----------------------------------------

def st_import(tmp_path, name: str, scaled, n: int = 2, **kw) -> str:
    """A SimpleTuner folder imported as ``name``, its keys ``{name}_000``, ... (the fixture's ``img_`` renamed)."""
    root, images = str(tmp_path / f"src-{name}"), str(tmp_path / f"images-{name}")
    fixtures.write_simpletuner(root, images, n=n, compress=False, hash_filenames=False, **kw)
    for folder, _, files in [*os.walk(os.path.join(root, "vae")), *os.walk(images)]:
        for file in files:
            os.rename(os.path.join(folder, file), os.path.join(folder, file.replace("img_", f"{name}_")))
    out = str(tmp_path / name)
    import_latents(root, out, format="simpletuner", images=images, quiet=True, scaled=scaled, scaling_factor=0.5)
    return out


def test_merge_refuses_caches_of_other_latent_conventions(tmp_path, capsys):
    scaled, raw = st_import(tmp_path, "scaled", None), st_import(tmp_path, "raw", False, seed=1)
    assert LatentCache(raw).meta["latent_convention"]["latent_convention"] == "raw"
    assert main(["cache", "merge", scaled, raw, "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "latent_convention" in err and scaled in err and raw in err and "'raw'" in err and "'scaled'" in err, err
    assert not os.path.exists(shardstore.manifest_path(str(tmp_path / "m"), "train"))
    other_factor = str(tmp_path / "factor")  # scaled too, by another factor: another convention as well
    import_latents(str(tmp_path / "src-raw"), other_factor, format="simpletuner", images=str(tmp_path / "images-raw"),
                   quiet=True, scaling_factor=0.25)
    with pytest.raises(InvalidArgumentError, match=r"latent_convention.*0\.25"):
        shardstore.merge_caches([scaled, other_factor], str(tmp_path / "m2"), copy=True)
    assert not os.path.exists(tmp_path / "m2" / "shards"), "refused before anything is copied"
    again = st_import(tmp_path, "again", True, seed=2)  # scaled (the trainer's own), by the same factor
    shardstore.merge_caches([scaled, again], str(tmp_path / "m3"))
    assert len(LatentCache(str(tmp_path / "m3"))) == 4


def keyed_cache(folder, keys, seed=0) -> str:
    gen = torch.Generator().manual_seed(seed)
    with LatentCacheWriter(folder) as writer:
        for key in keys:
            writer.append(key, {"latent": torch.randn(4, 3, 5, generator=gen).half(), "text": torch.randn(2, 8, generator=gen)})
    return str(folder)


def test_merge_refuses_a_key_in_two_parts(tmp_path, capsys):
    a = keyed_cache(tmp_path / "a", ["x0", "x1", "x2"])
    assert main(["cache", "merge", a, a, "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "'x0'" in err and err.count(a) >= 2 and "twice" in err, err
    b = keyed_cache(tmp_path / "b", ["y0", "x2"], seed=1)  # one key in common, the last of a
    with pytest.raises(InvalidArgumentError, match=r"'x2'.*/a.*/b"):
        shardstore.merge_caches([a, b], str(tmp_path / "m2"), copy=True)
    assert not os.path.exists(tmp_path / "m2" / "shards"), "refused before anything is copied"
    ab = shardstore.merge_caches([a, keyed_cache(tmp_path / "c", ["y0", "y1"])], str(tmp_path / "m3"))
    with pytest.raises(InvalidArgumentError, match=r"'y0' appears twice.*/c \(row 0\) and in .*/c \(row 0\)"):
        shardstore.merge_caches([os.path.dirname(ab), str(tmp_path / "c")], str(tmp_path / "m4"))  # through a sharded source
    assert LatentCache(str(tmp_path / "m3")).keys == ["x0", "x1", "x2", "y0", "y1"]
    rows, widths = random_rows(np.random.default_rng(0), 4, 3, 2, 6)
    lines = write_cache(str(tmp_path / "lines"), rows, widths, w_max=6).cache_dir  # no keys: its rows are told apart by folder
    shardstore.merge_caches([lines, write_cache(str(tmp_path / "lines2"), rows, widths, w_max=6).cache_dir], str(tmp_path / "m5"))
    with pytest.raises(InvalidArgumentError, match=r"/lines is given twice"):
        shardstore.merge_caches([lines, str(tmp_path / "m5" / ".." / "lines")], str(tmp_path / "m6"))


# -- 3. a distributed import whose ranks disagree --------------------------------------------------

def _disagreeing_imports(rank: int, world: int, root: str):
    import torch.distributed as dist

    out, messages = {}, {}
    cases = {  # what each rank is given: rank 1 differs from the others
        "scaled": dict(source=os.path.join(root, "st"), format="simpletuner", images=os.path.join(root, "images"),
                       scaled=None if rank != 1 else False, scaling_factor=0.5),
        "contents": dict(source=os.path.join(root, "npz" if rank != 1 else "npz-other"), format="npz"),
        "key": dict(source=os.path.join(root, "npz"), format="npz", key="latents" if rank != 1 else None),
    }
    for name, case in cases.items():
        case = dict(case)
        try:
            import_latents(case.pop("source"), os.path.join(root, "out", name), quiet=True, group=dist.group.WORLD, **case)
        except Exception as exc:  # noqa: BLE001 - compared across ranks in the test
            messages[name] = f"{type(exc).__name__}: {exc}"
        out[name] = os.path.isdir(os.path.join(root, "out", name, "shards"))
    return messages, out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_given_other_arguments_or_other_files_all_fail_alike_before_writing(tmp_path):
    root = str(tmp_path)
    fixtures.write_simpletuner(os.path.join(root, "st"), os.path.join(root, "images"), n=3, compress=False, hash_filenames=False)
    for folder, offset in (("npz", 0.0), ("npz-other", 1.0)):  # the same names and sizes, other values
        os.makedirs(os.path.join(root, folder))
        for i in range(3):
            np.savez(os.path.join(root, folder, f"z{i}.npz"), latents=np.full((4, 2, 3), i + offset, dtype=np.float32))
    results = spawn_gloo(_disagreeing_imports, 3, root, timeout_s=120)
    assert all(isinstance(r, tuple) for r in results), results
    for name, what in (("scaled", "scaled"), ("contents", "source listing"), ("key", "key")):
        messages = [r[0].get(name) for r in results]
        assert messages[0] is not None and all(m == messages[0] for m in messages), (name, messages)
        assert messages[0].startswith("InvalidArgumentError: distributed import") and what in messages[0], messages[0]
        assert "rank 1" in messages[0] and "rank(s) [0, 2]" in messages[0], messages[0]
        assert not any(r[1][name] for r in results), f"{name}: a rank wrote a shard before the ranks agreed"


def test_the_source_listing_digest_sees_contents_not_mtimes(tmp_path):
    from latentfast.cache.builders.importers import source_digest

    for folder in ("a", "b"):
        os.makedirs(tmp_path / folder / "sub")
        for i in range(2):
            np.save(tmp_path / folder / "sub" / f"z{i}.npy", np.arange(6, dtype=np.float32) + i)
        (tmp_path / folder / ".hidden").write_text(folder)  # not read by an import: not in the digest
    os.utime(tmp_path / "b" / "sub" / "z1.npy", (1, 1))
    assert source_digest(str(tmp_path / "a")) == source_digest(str(tmp_path / "b")), "a copy with other mtimes is the same source"
    np.save(tmp_path / "b" / "sub" / "z1.npy", np.arange(6, dtype=np.float32) + 7)  # same name and size, other bytes
    assert source_digest(str(tmp_path / "a")) != source_digest(str(tmp_path / "b"))
    os.rename(tmp_path / "a" / "sub" / "z1.npy", tmp_path / "a" / "sub" / "z9.npy")
    np.save(tmp_path / "b" / "sub" / "z1.npy", np.arange(6, dtype=np.float32) + 1)
    assert source_digest(str(tmp_path / "a")) != source_digest(str(tmp_path / "b")), "another name"


# -- 7. a flipped latent has its latent's shape ------------------------------------------------------

def test_append_refuses_a_flipped_latent_or_a_std_of_another_shape(tmp_path):
    def record(**shapes):
        base = {"latent": (4, 3, 5), "latent_flipped": (4, 3, 5), "latent_std": (4, 3, 5), "latent_flipped_std": (4, 3, 5)}
        return {name: torch.ones(shapes.get(name, shape)).half() for name, shape in base.items()}

    for k, (name, shape) in enumerate((("latent_flipped", (4, 1, 5)), ("latent_flipped", (1, 3, 5)), ("latent_std", (4, 3, 1)),
                                       ("latent_flipped_std", (4, 1, 1)))):
        with LatentCacheWriter(tmp_path / str(k)) as writer:
            writer.append("ok", record())
            with pytest.raises(InvalidArgumentError, match=rf"field '{name}' of key 'bad' has shape \[{', '.join(map(str, shape))}\]"):
                writer.append("bad", record(**{name: shape}))
            assert "bad" not in writer


def rewrite_index(folder: str, kind: str, path: str, payload: bytes) -> None:
    """Write an index file and the CRC-32 the meta records for it (a cache as an older writer left it)."""
    with open(path, "wb") as fh:
        fh.write(payload)
    meta_path = fmt.cache_path(folder, "train", "meta")
    with open(meta_path) as fh:
        meta = json.load(fh)
    meta["files"][kind] = zlib.crc32(payload)
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def reshape_field(folder: str, name: str, item: int, shape) -> None:
    """Give item ``item`` of field ``name`` another shape of fewer bytes, its spans and CRC consistent (a
    cache written before the writer checked flipped shapes)."""
    spans_path, crc_path = (fieldstore.field_path(folder, "train", name, k) for k in ("spans", "crc"))
    spans, crc = np.load(spans_path), np.load(crc_path)
    nbytes = int(np.prod(shape)) * 2
    spans[item, 1], spans[item, 2:] = nbytes, shape
    with open(fieldstore.field_path(folder, "train", name, "data"), "rb") as fh:
        fh.seek(int(spans[item, 0]))
        crc[item] = zlib.crc32(fh.read(nbytes))
    rewrite_index(folder, f"{name}.spans", spans_path, npy(spans))
    rewrite_index(folder, f"{name}.crc32", crc_path, npy(crc))


@pytest.mark.parametrize("shape", [(4, 1, 5), (1, 3, 5)])
def test_a_flipped_latent_of_another_shape_is_refused_at_read_not_broadcast(tmp_path, shape):
    gen = torch.Generator().manual_seed(0)
    with LatentCacheWriter(tmp_path) as writer:
        for i in range(6):
            writer.append(f"k{i}", {name: torch.rand(4, 3, 5, generator=gen).half()
                                    for name in ("latent", "latent_flipped", "latent_std", "latent_flipped_std")})
    reshape_field(str(tmp_path), "latent_flipped", 2, shape)
    reshape_field(str(tmp_path), "latent_flipped_std", 4, shape)
    cache = LatentCache(tmp_path)
    assert cache.read_batch([0, 1, 3], flip=1.0, seed=0)["flipped"].all()  # the other items still read
    with pytest.raises(InvalidArgumentError, match=rf"latent_flipped.*indices\[0\] = 2.*{re.escape(str(list(shape)))}.*\[4, 3, 5\]"):
        cache.read_batch([2, 2], flip=1.0, seed=0)  # (its two mirrors agree: nothing else tells their shape is wrong)
    with pytest.raises(InvalidArgumentError, match=r"latent_flipped.*indices\[1\] = 2"):
        cache.read_batch([0, 2], flip=1.0, seed=0, sample=False)
    assert cache.read_batch([4, 4], flip=1.0, seed=0)["flipped"].all()  # its std is not read
    with pytest.raises(InvalidArgumentError, match=rf"'latent_flipped_std' of indices\[0\] = 4.*but its latent_flipped has \[4, 3, 5\]"):
        cache.read_batch([4, 4], flip=1.0, sample=True, seed=0)


# -- 8. every float field is finite, as the latent is -------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_append_refuses_a_non_finite_value_in_any_float_field(tmp_path, value, dtype):
    with LatentCacheWriter(tmp_path) as writer:
        writer.append("ok", {"latent": torch.zeros(4, 2, 2).half(), "text": torch.zeros(3, 8, dtype=dtype),
                             "latent_std": torch.ones(4, 2, 2).half(), "mask": torch.ones(3, dtype=torch.int64)})
        bad = torch.zeros(3, 8, dtype=dtype)
        bad[1, 5] = value
        with pytest.raises(NonFiniteError, match=r"field 'text' of key 'bad' holds values that are not finite"):
            writer.append("bad", {"latent": torch.zeros(4, 2, 2).half(), "text": bad,
                                  "latent_std": torch.ones(4, 2, 2).half(), "mask": torch.ones(3, dtype=torch.int64)})
        std = torch.ones(4, 2, 2).half()
        std[0, 0, 0] = value
        with pytest.raises(NonFiniteError, match=r"field 'latent_std' of key 'bad2'"):
            writer.append("bad2", {"latent": torch.zeros(4, 2, 2).half(), "text": torch.zeros(3, 8, dtype=dtype),
                                   "latent_std": std, "mask": torch.ones(3, dtype=torch.int64)})
        assert writer.keys == ["ok"]


def test_an_import_of_a_non_finite_text_embedding_is_refused_naming_the_item(tmp_path):
    fixtures.write_kohya(str(tmp_path / "k"), arch="sd", n=2)
    te = str(tmp_path / "k" / "img_001_te_outputs.npz")
    arrays = dict(np.load(te))
    name = next(n for n, a in arrays.items() if a.dtype.kind == "f" and a.size > 1)
    arrays[name] = arrays[name].copy()
    arrays[name].reshape(-1)[3] = np.nan
    np.savez(te, **arrays)
    with pytest.raises(NonFiniteError, match=r"of key 'img_001' holds values that are not finite"):
        import_latents(str(tmp_path / "k"), str(tmp_path / "out"), format="kohya", quiet=True)


def test_verify_reports_a_non_finite_field_value(tmp_path):
    with LatentCacheWriter(tmp_path) as writer:
        for i in range(3):
            writer.append(f"k{i}", {"latent": torch.zeros(4, 2, 2).half(), "text": torch.full((3, 4), float(i))})
    verify_cache(str(tmp_path))
    folder = str(tmp_path)
    path, crc_path = (fieldstore.field_path(folder, "train", "text", k) for k in ("data", "crc"))
    spans, crc = np.load(fieldstore.field_path(folder, "train", "text", "spans")), np.load(crc_path)
    raw = bytearray(open(path, "rb").read())
    start = int(spans[2, 0])
    raw[start + 4: start + 8] = struct.pack("<f", float("inf"))  # a file written before the check, its CRC made to match
    open(path, "wb").write(raw)
    crc[2] = zlib.crc32(bytes(raw[start: start + int(spans[2, 1])]))
    rewrite_index(folder, "text.crc32", crc_path, npy(crc))
    with pytest.raises(CacheCorruptError, match=r"field 'text'.*item 2's value holds values that are not finite"):
        verify_cache(str(tmp_path))


# -- 10. keys are text -----------------------------------------------------------------------------

LATIN1 = "caf\xe9".encode("latin-1")  # not UTF-8: os.fsdecode gives 'caf\udce9'


def test_a_file_name_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    src = tmp_path / "npz"
    src.mkdir()
    np.savez(src / "ok.npz", latents=np.zeros((4, 2, 2), np.float32))
    np.savez(os.fsdecode(os.path.join(os.fsencode(src), LATIN1 + b".npz")), latents=np.zeros((4, 2, 2), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"caf\\xe9\.npz.*not valid UTF-8"):
        import_latents(str(src), str(tmp_path / "out"), format="npz", quiet=True)
    kohya = tmp_path / "kohya"
    fixtures.write_kohya(str(kohya), arch="sd", n=1)
    sub = os.path.join(os.fsencode(kohya), LATIN1)  # a subfolder's name is part of the keys too
    fixtures.write_kohya(os.fsdecode(sub), arch="sd", n=1)
    with pytest.raises(InvalidArgumentError, match=r"caf\\xe9.*not valid UTF-8"):
        import_latents(str(kohya), str(tmp_path / "out2"), format="kohya", quiet=True)


def test_the_writer_refuses_a_key_that_is_not_text(tmp_path):
    with LatentCacheWriter(tmp_path) as writer:
        writer.append("ok", torch.zeros(4, 2, 2))
        for key in ("caf\udce9", "\ud800x"):
            with pytest.raises(InvalidArgumentError, match="not valid UTF-8 text"):
                writer.append(key, torch.zeros(4, 2, 2))
        assert writer.keys == ["ok"]


def test_draws_work_for_every_key_a_keys_file_can_hold(tmp_path):
    gen = torch.Generator().manual_seed(3)
    with LatentCacheWriter(tmp_path) as writer:
        for key in ("a", "b"):
            writer.append(key, {"latent": torch.randn(4, 2, 2, generator=gen).half(),
                                "latent_flipped": torch.randn(4, 2, 2, generator=gen).half(),
                                "latent_std": torch.rand(4, 2, 2, generator=gen).half(),
                                "latent_flipped_std": torch.rand(4, 2, 2, generator=gen).half()})
    keys_path = fmt.cache_path(str(tmp_path), "train", "keys")
    text = open(keys_path, encoding="utf-8").read().replace('"b"', '"caf\\udce9"')  # as an older import wrote it
    rewrite_index(str(tmp_path), "keys", keys_path, text.encode())
    meta_path = fmt.cache_path(str(tmp_path), "train", "meta")
    with open(meta_path) as fh:
        meta = json.load(fh)
    del meta["key_table"]  # an older writer's cache: its keys file is the only list of keys
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    cache = LatentCache(tmp_path)
    assert cache.keys[1] == "caf\udce9"
    batch = cache.read_batch([0, 1], flip=0.5, sample=True, seed=4)
    assert batch["latent"].shape == (2, 4, 2, 2) and torch.isfinite(batch["latent"]).all()
    assert sampling.key_hash("caf\udce9") != sampling.key_hash("caf\xe9")
    assert sampling.key_hash("café") == int.from_bytes(hashlib.blake2b(
        "café".encode(), digest_size=8, person=b"latentfast.key").digest(), "little"), "valid keys hash as before"


# -- 13. pad_to past its limit ----------------------------------------------------------------------

@pytest.fixture
def padded_cache(tmp_path):
    with LatentCacheWriter(tmp_path) as writer:
        for i in range(3):
            writer.append(f"k{i}", {"latent": torch.zeros(4, 2, 2).half(), "text": torch.ones(2 + i, 8)})
    return LatentCache(tmp_path)


@pytest.mark.parametrize("pad_to", [2 ** 63, 2 ** 70, 10 ** 12, {"text": 2 ** 40}])
def test_pad_to_past_its_limit_is_refused_naming_it(padded_cache, pad_to):
    from latentfast.cache.store.layout import MAX_PAD_TO

    with pytest.raises(InvalidArgumentError, match=rf"pad_to\['text'\] = \d+ is past the limit of {MAX_PAD_TO}"):
        padded_cache.read_batch([0, 1], fields=("latent", "text"), pad={"text": 0}, pad_to=pad_to)
    ok = padded_cache.read_batch([0, 1], fields=("latent", "text"), pad={"text": 0}, pad_to=np.int64(6))
    assert ok["text"].shape == (2, 6, 8) and ok["text"][0, 2:].eq(0).all()


@pytest.mark.parametrize("pad_to", ["9", 9.0, True, [9], {"text": "9"}, {"text": None}, {"other": 4}, -1])
def test_pad_to_of_a_wrong_type_is_refused_naming_it(padded_cache, pad_to):
    with pytest.raises(InvalidArgumentError, match="pad_to"):
        padded_cache.read_batch([0, 1], fields=("latent", "text"), pad={"text": 0}, pad_to=pad_to)


def test_pad_to_at_its_limit_is_read(padded_cache):
    from latentfast.cache.store.layout import MAX_PAD_TO

    batch = padded_cache.read_batch([2, 0], fields=("latent", "text"), pad={"text": -1}, pad_to={"text": MAX_PAD_TO})
    assert batch["text"].shape == (2, MAX_PAD_TO, 8) and batch["text"][1, 2:].eq(-1).all() and batch["text"][0, :4].eq(1).all()
    with pytest.raises(InvalidArgumentError, match=rf"= {MAX_PAD_TO + 1} is past the limit"):
        padded_cache.read_batch([2, 0], fields=("latent", "text"), pad={"text": -1}, pad_to=MAX_PAD_TO + 1)


# -- evidence: a rerun sees a field's new shape or dtype, same bytes ----------------------------------

@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_an_import_rerun_rewrites_an_item_whose_field_changes_shape_or_dtype_only(tmp_path, change):
    root, images, out = str(tmp_path / "st"), str(tmp_path / "images"), str(tmp_path / "out")
    fixtures.write_simpletuner(root, images, n=3, compress=False, hash_filenames=False)
    import_latents(root, out, format="simpletuner", images=images, quiet=True)
    before = LatentCache(out)
    i = before.keys.index("sub/img_001")
    latent_before = before.record(i)["latent"]
    if change == "shape":  # the latent [16, 5, 6] of item 1 saved as [16, 6, 5]: the same bytes
        path = os.path.join(root, "vae", "sub", "img_001.pt")
        latent = torch.load(path)
        torch.save(latent.reshape(16, 6, 5).clone(), path)
        want = lambda cache: cache.record(i)["latent"].shape == (16, 6, 5)  # noqa: E731
    else:  # every item's attention mask (int64 ones) saved as the float64 of the same bits
        for name in os.listdir(os.path.join(root, "text")):
            path = os.path.join(root, "text", name)
            embeds = torch.load(path)
            embeds["attention_mask"] = embeds["attention_mask"].view(torch.float64).clone()
            torch.save(embeds, path)
        want = lambda cache: all(cache.record(k)["text_attention_mask"].dtype == torch.float64 for k in range(3))  # noqa: E731
    stats = {}
    import_latents(root, out, format="simpletuner", images=images, quiet=True, stats=stats)
    after = LatentCache(out)
    assert not stats["unchanged"] and want(after), stats
    assert fixtures.same_bits(after.record(i)["latent"].reshape(-1), latent_before.reshape(-1)), "the same bytes"
