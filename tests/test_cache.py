"""Latent cache: seed-format compatibility, both layouts, stamps, validation errors, verify,
builder semantics and determinism, pickling and worker safety. Real PNGs, real files."""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from latentfast.cache import (
    CacheCorruptError,
    ImageError,
    IncompleteCacheError,
    LatentCache,
    build_latent_cache,
    cache_meta_for,
    cache_path,
    verify_cache,
)
from latentfast.cache.store import format as fmt
from latentfast.toy import ToyVAE

LINE_HEIGHT = 16
MAX_WIDTH = 96


def make_lines(folder, n=24, seed=0, widths=None, height=LINE_HEIGHT, max_px=128):
    """Write ``n`` random RGB line PNGs and a manifest with relative paths; return the manifest."""
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "img"), exist_ok=True)
    widths = widths if widths is not None else rng.integers(5, max_px, size=n).tolist()
    with open(os.path.join(folder, "lines.jsonl"), "w") as fh:
        for i, w in enumerate(widths):
            pixels = rng.integers(0, 256, size=(height, int(w), 3), dtype=np.uint8)
            mode = "L" if i % 5 == 4 else "RGB"  # some grayscale lines exercise the RGB convert
            img = Image.fromarray(pixels[:, :, 0] if mode == "L" else pixels, mode)
            img.save(os.path.join(folder, "img", f"{i:03d}.png"))
            fh.write(json.dumps({"image": f"img/{i:03d}.png"}) + "\n")
    return os.path.join(folder, "lines.jsonl")


def build(manifest, out, **kw):
    kw.setdefault("line_height", LINE_HEIGHT)
    kw.setdefault("max_line_width", MAX_WIDTH)
    kw.setdefault("batch_size", 4)
    kw.setdefault("quiet", True)
    return build_latent_cache(kw.pop("encoder", ToyVAE()), manifest, out, **kw)


def cache_files(out, split="train"):
    return {name: open(os.path.join(out, name), "rb").read() for name in sorted(os.listdir(out)) if name.startswith(split + ".")}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_lines(str(tmp_path_factory.mktemp("lines")))


@pytest.fixture(scope="module")
def padded(manifest, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("padded"))
    build(manifest, out)
    return out


@pytest.fixture(scope="module")
def ragged(manifest, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ragged"))
    build(manifest, out, layout="ragged")
    return out


def write_seed_cache(folder, rows, widths, w_max, split="train", **meta_overrides):
    """A cache written the way the original training code writes it: plain numpy + json."""
    n, (C, h) = len(rows), rows[0].shape[:2]
    mm = np.memmap(os.path.join(folder, f"{split}.latents.f16.dat"), dtype=np.float16, mode="w+", shape=(n, C, h, w_max))
    for i, (row, w) in enumerate(zip(rows, widths)):
        mm[i, :, :, :w] = row[:, :, :w]
    mm.flush()
    del mm
    np.save(os.path.join(folder, f"{split}.latents.widths.npy"), np.asarray(widths, dtype=np.int32))
    meta = dict(n=n, channels=C, latent_h=h, w_max=w_max, pretrained="some/vae", subfolder="vae",
                line_height=8 * h, max_line_width=8 * w_max, downscale_factor=8)
    meta.update(meta_overrides)
    with open(os.path.join(folder, f"{split}.latents.meta.json"), "w") as fh:
        fh.write(json.dumps(meta, separators=(",", ":")))
    return meta


# -- format compatibility -------------------------------------------------------------------

def test_seed_written_cache_opens_and_reads_identically(tmp_path):
    rng = np.random.default_rng(1)
    widths = [3, 7, 1, 12, 12, 5]
    rows = [rng.standard_normal((4, 2, 12)).astype(np.float16) for _ in widths]
    meta = write_seed_cache(str(tmp_path), rows, widths, w_max=12)
    cache = LatentCache(str(tmp_path), "train", expected=meta)
    assert len(cache) == 6 and cache.layout == "padded" and cache.white_column is None
    assert (cache.channels, cache.latent_h, cache.w_max) == (4, 2, 12)
    for i, (row, w) in enumerate(zip(rows, widths)):
        got = cache[i]
        assert got.dtype == torch.float16 and tuple(got.shape) == (4, 2, w)
        assert np.array_equal(got.numpy(), row[:, :, :w])
    assert np.array_equal(cache[-1].numpy(), cache[5].numpy())
    with pytest.raises(IndexError, match="out of range"):
        cache[6]
    white = torch.randn(4, 2, 1).half()
    assert torch.equal(LatentCache(str(tmp_path), white_column=white).white_column, white)
    with pytest.raises(ValueError, match=r"white_column must have shape \[C, h, 1\] = \[4, 2, 1\]"):
        LatentCache(str(tmp_path), white_column=torch.zeros(4, 2, 2))


def test_our_padded_cache_reads_with_a_nine_field_reader(padded):
    """A reader that knows only the original format (nine fields, padded memmap) still works."""
    with open(cache_path(padded, "train", "meta")) as fh:
        meta = json.load(fh)
    seed = {k: meta[k] for k in fmt.SEED_FIELDS}
    mm = np.memmap(cache_path(padded, "train", "data"), dtype=np.float16, mode="r",
                   shape=(seed["n"], seed["channels"], seed["latent_h"], seed["w_max"]))
    widths = np.load(cache_path(padded, "train", "widths"))
    cache = LatentCache(padded)
    for i in range(seed["n"]):
        assert np.array_equal(np.asarray(mm[i, :, :, : widths[i]]), cache[i].numpy())
    assert not np.asarray(mm[np.arange(seed["n"])[widths < seed["w_max"]], :, :, -1]).any()  # padding is zero


def test_layouts_give_identical_rows_and_ragged_stores_no_padding(padded, ragged):
    a, b = LatentCache(padded), LatentCache(ragged)
    assert (a.layout, b.layout) == ("padded", "ragged")
    assert len(a) == len(b) == 24 and np.array_equal(a.widths, b.widths)
    assert torch.equal(a.white_column, b.white_column)
    for i in range(len(a)):
        assert torch.equal(a[i], b[i])
    data_bytes = os.path.getsize(cache_path(ragged, "train", "data"))
    assert data_bytes == 2 * a.channels * a.latent_h * int(a.widths.sum())
    offsets = np.load(cache_path(ragged, "train", "offsets"))
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] * 2 == data_bytes


def test_gather_source_addresses_every_row(padded, ragged):
    for folder in (padded, ragged):
        cache = LatentCache(folder)
        data, row_offsets, widths, pitch = cache.gather_source()
        assert data.dtype == torch.float16 and data.ndim == 1 and row_offsets.dtype == torch.int64 and widths.dtype == torch.int32
        C, h = cache.channels, cache.latent_h
        for i in (0, 7, len(cache) - 1):
            w = int(widths[i])
            p = pitch or w
            lines = [data[int(row_offsets[i]) + (c * h + y) * p:][:w] for c in range(C) for y in range(h)]
            assert torch.equal(torch.stack(lines).reshape(C, h, w), cache[i])
        assert pitch == (cache.w_max if folder == padded else 0)


# -- stamp check ------------------------------------------------------------------------------

def test_stamp_match_and_mismatch_names_each_field(padded):
    good = cache_meta_for(ToyVAE(), line_height=LINE_HEIGHT, max_line_width=MAX_WIDTH, n=24)
    LatentCache(padded, expected=good)
    bad = cache_meta_for(ToyVAE(seed=3), line_height=LINE_HEIGHT, max_line_width=2 * MAX_WIDTH)
    with pytest.raises(ValueError) as info:
        LatentCache(padded, expected=bad)
    msg = str(info.value)
    assert "pretrained: cache has 'latentfast.toy.ToyVAE(seed=0,hidden=16)', expected 'latentfast.toy.ToyVAE(seed=3,hidden=16)'" in msg
    assert f"max_line_width: cache has {MAX_WIDTH}, expected {2 * MAX_WIDTH}" in msg
    assert f"w_max: cache has {MAX_WIDTH // 8}, expected {MAX_WIDTH // 4}" in msg
    assert "encoder: cache has" in msg and "latent_h" not in msg
    assert "latentfast cache build --manifest" in msg and f"--out {padded}" in msg and f"--max-line-width {2 * MAX_WIDTH}" in msg


# -- validation on open -----------------------------------------------------------------------

def _seed_cache(tmp_path, n=5, w_max=6):
    rows = [np.full((2, 1, w_max), i, dtype=np.float16) for i in range(n)]
    write_seed_cache(str(tmp_path), rows, [w_max] * n, w_max=w_max)
    return str(tmp_path)


def test_data_file_shorter_or_longer_than_meta(tmp_path):
    folder = _seed_cache(tmp_path)
    dat = cache_path(folder, "train", "data")
    with open(dat, "ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(ValueError, match=r"train.latents.f16.dat is longer than the meta implies: expected 120 bytes .* found 122"):
        LatentCache(folder)
    os.truncate(dat, 100)
    with pytest.raises(ValueError, match=r"train.latents.f16.dat is shorter than the meta implies: expected 120 bytes .* found 100"):
        LatentCache(folder)


@pytest.mark.parametrize("bad_width", [0, 7, -1])
def test_widths_outside_range(tmp_path, bad_width):
    folder = _seed_cache(tmp_path)
    widths = np.array([6, 6, bad_width, 6, 6], dtype=np.int32)
    np.save(cache_path(folder, "train", "widths"), widths)
    with pytest.raises(ValueError, match=rf"widths.npy: row 2 has width {bad_width}, outside \[1, w_max=6\]"):
        LatentCache(folder)


def test_row_count_mismatch_and_missing_files(tmp_path):
    folder = _seed_cache(tmp_path)
    np.save(cache_path(folder, "train", "widths"), np.array([6, 6, 6], dtype=np.int32))
    with pytest.raises(ValueError, match=r"widths.npy has 3 rows but the meta says n=5"):
        LatentCache(folder)
    os.remove(cache_path(folder, "train", "widths"))
    with pytest.raises(FileNotFoundError, match=r"widths file .*train.latents.widths.npy does not exist"):
        LatentCache(folder)
    np.save(cache_path(folder, "train", "widths"), np.full(5, 6, dtype=np.int32))
    os.remove(cache_path(folder, "train", "data"))
    with pytest.raises(FileNotFoundError, match=r"data file .*train.latents.f16.dat does not exist"):
        LatentCache(folder)
    with pytest.raises(FileNotFoundError, match=r"meta .*val.latents.meta.json does not exist"):
        LatentCache(folder, "val")


def test_bad_meta(tmp_path):
    folder = _seed_cache(tmp_path)
    meta_path = cache_path(folder, "train", "meta")
    meta = json.load(open(meta_path))
    for change, pattern in (({"layout": "diagonal"}, "layout must be one of"), ({"dtype": "bfloat16"}, "dtype must be 'float16'"),
                            ({"w_max": 0}, "w_max must be a positive integer"), ({"channels": None}, "channels must be")):
        json.dump({**meta, **change}, open(meta_path, "w"))
        with pytest.raises(ValueError, match=pattern):
            LatentCache(folder)
    json.dump({k: v for k, v in meta.items() if k != "pretrained"}, open(meta_path, "w"))
    with pytest.raises(ValueError, match=r"lacks the fields \['pretrained'\]"):
        LatentCache(folder)


def test_ragged_offsets_must_match_widths(ragged, tmp_path):
    import shutil

    folder = str(tmp_path / "copy")
    shutil.copytree(ragged, folder)
    offsets = np.load(cache_path(folder, "train", "offsets"))
    offsets[3] += 1
    np.save(cache_path(folder, "train", "offsets"), offsets)
    with pytest.raises(ValueError, match="offsets .* disagree with the widths"):
        LatentCache(folder)
    np.save(cache_path(folder, "train", "offsets"), offsets[:-1])
    with pytest.raises(ValueError, match=r"must have n \+ 1 = 25 entries"):
        LatentCache(folder)


def test_incomplete_build_is_refused(padded, tmp_path):
    import shutil

    folder = str(tmp_path / "copy")
    shutil.copytree(padded, folder)
    meta_path = cache_path(folder, "train", "meta")
    meta = json.load(open(meta_path))
    json.dump({**meta, "complete": False}, open(meta_path, "w"))
    with pytest.raises(IncompleteCacheError, match="no completion mark.*Re-run the same `latentfast cache build` command to resume"):
        LatentCache(folder)
    os.remove(meta_path)
    open(cache_path(folder, "train", "progress"), "w").write("{}\n")
    with pytest.raises(IncompleteCacheError, match="incomplete: its build was interrupted.*resume"):
        LatentCache(folder)


# -- verify -----------------------------------------------------------------------------------

def test_verify_catches_a_flipped_byte_and_names_its_block(manifest, tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "CHECKSUM_BLOCK_BYTES", 1024)  # several blocks in a small cache
    for layout in ("padded", "ragged"):
        out = str(tmp_path / layout)
        build(manifest, out, layout=layout)
        report = verify_cache(out)
        assert report["checksummed"] and report["rows"] == 24 and report["blocks"] > 2
        cache = LatentCache(out)
        block_rows = cache.meta["checksum"]["block_rows"]
        row = 2 * block_rows + 1
        with open(cache_path(out, "train", "data"), "r+b") as fh:
            pos = int(cache.row_starts[row]) * 2 + 1
            fh.seek(pos)
            byte = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(CacheCorruptError, match=rf"block 2 \(rows {2 * block_rows}..{3 * block_rows - 1}\) fails its CRC-32"):
            verify_cache(out)


def test_verify_finds_nonfinite_rows_in_a_cache_without_checksums(tmp_path):
    folder = _seed_cache(tmp_path, n=9)
    assert verify_cache(folder)["checksummed"] is False
    mm = np.memmap(cache_path(folder, "train", "data"), dtype=np.float16, mode="r+", shape=(9, 2, 1, 6))
    mm[6, 1, 0, 4] = np.inf
    mm.flush()
    del mm
    with pytest.raises(CacheCorruptError, match=r"row 6 \(block 0\) holds a non-finite value"):
        verify_cache(folder)


def test_first_nonfinite():
    x = np.zeros(1000, dtype=np.float16)
    assert fmt.first_nonfinite(x) == -1
    x[[900, 517]] = [np.nan, -np.inf]
    assert fmt.first_nonfinite(x) == 517
    x[:] = np.finfo(np.float16).max
    assert fmt.first_nonfinite(x) == -1


# -- builder semantics ------------------------------------------------------------------------

def test_builder_matches_the_encoder_line_by_line(tmp_path):
    """batch_size=1 and widths that are multiples of 8: each row is exactly the encoder's latent
    of its own line; a line wider than max_line_width is LANCZOS-resized first."""
    widths = [16, 40, 96, 8, 200]
    manifest = make_lines(str(tmp_path), widths=widths)
    out = str(tmp_path / "out")
    vae = ToyVAE(latent_channels=3, seed=5)
    build(manifest, out, encoder=vae, batch_size=1)
    cache = LatentCache(out)
    assert cache.widths.tolist() == [2, 5, 12, 1, 12]
    for i in range(len(widths)):
        img = Image.open(tmp_path / "img" / f"{i:03d}.png").convert("RGB")
        if img.width > MAX_WIDTH:
            img = img.resize((MAX_WIDTH, LINE_HEIGHT), Image.LANCZOS)
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div(255).sub(0.5).div(0.5)
        want = vae.encode(x[None])[0].half()
        assert torch.equal(cache[i], want)
    white = vae.encode(torch.ones(1, 3, LINE_HEIGHT, 8))[0, :, :, :1].half()
    assert torch.equal(cache.white_column, white)


def test_width_sorted_batches_and_latent_width_formula(tmp_path):
    widths = [30, 5, 77, 31, 64, 6, 90, 29]
    manifest = make_lines(str(tmp_path), widths=widths)
    out = str(tmp_path / "out")
    calls = []

    class Recording(ToyVAE):
        def encode(self, images):
            calls.append(tuple(images.shape))
            return super().encode(images)

    build(manifest, out, encoder=Recording(), batch_size=3)
    # white column probe, then sorted batches {5,6,29} {30,31,64} {77,90}, padded to multiples of 8
    assert calls == [(1, 3, 16, 64), (3, 3, 16, 32), (3, 3, 16, 64), (2, 3, 16, 96)]
    # latent widths worked out by hand: round(w * zw / wmax) with zw = 4, 8, 12 for wmax = 29, 64, 90
    # {5: 0.69 -> 1, 6: 0.83 -> 1, 29: 4}  {30: 3.75 -> 4, 31: 3.875 -> 4, 64: 8}  {77: 10.27 -> 10, 90: 12}
    assert LatentCache(out).widths.tolist() == [4, 1, 10, 4, 8, 1, 12, 4]


def test_builder_is_deterministic(manifest, padded, tmp_path):
    out = str(tmp_path / "again")
    build(manifest, out)
    assert cache_files(out) == cache_files(padded)
    before = os.stat(cache_path(out, "train", "meta")).st_mtime_ns
    build(manifest, out)  # a finished build is not redone
    assert os.stat(cache_path(out, "train", "meta")).st_mtime_ns == before


def test_rebuild_with_other_settings_replaces_the_cache(manifest, padded, ragged, tmp_path):
    import shutil

    out = str(tmp_path / "copy")
    shutil.copytree(padded, out)
    build(manifest, out, layout="ragged")
    assert cache_files(out) == cache_files(ragged)
    build(manifest, out)
    assert cache_files(out) == cache_files(padded)


def test_folder_source_and_split(tmp_path):
    make_lines(str(tmp_path), n=6)
    out = str(tmp_path / "out")
    build(str(tmp_path / "img"), out, split="val")
    cache = LatentCache(out, "val")
    assert len(cache) == 6 and cache.meta["source"] == str(tmp_path / "img")


def test_missing_and_corrupt_images_name_the_manifest_line(tmp_path):
    manifest = make_lines(str(tmp_path), n=6)
    with open(tmp_path / "img" / "002.png", "wb") as fh:
        fh.write(b"not a png at all")
    with open(manifest, "a") as fh:
        fh.write(json.dumps({"image": "img/nope.png"}) + "\n")
    with pytest.raises(ImageError, match=r"manifest line 3 \(.*img/002.png\): cannot read image"):
        build(manifest, str(tmp_path / "out"))
    out = str(tmp_path / "skip")
    build(manifest, out, skip_bad_images=True)
    cache = LatentCache(out)
    assert len(cache) == 5
    assert [(s["line"], os.path.basename(s["path"])) for s in cache.meta["skipped"]] == [(3, "002.png"), (7, "nope.png")]


def test_wrong_height_and_bad_arguments(tmp_path):
    manifest = make_lines(str(tmp_path), n=3, height=LINE_HEIGHT + 8, max_px=40)
    with pytest.raises(ImageError, match=r"manifest line 1 .* height must be line_height=16"):
        build(manifest, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="layout must be one of"):
        build(manifest, str(tmp_path / "out"), layout="sparse")
    with pytest.raises(ValueError, match="line_height must be a positive multiple of the downscale factor 8, got 12"):
        build(manifest, str(tmp_path / "out"), line_height=12)
    with open(manifest, "a") as fh:
        fh.write("{not json}\n")
    with pytest.raises(ValueError, match=r"lines.jsonl line 4: expected a JSON object with an 'image' path"):
        build(manifest, str(tmp_path / "out"), line_height=24)


# -- pickling and worker safety ---------------------------------------------------------------

def _rows_in_child(cache, indices):
    return [cache[i] for i in indices]


def test_pickle_carries_no_data(manifest, tmp_path):
    for layout in ("padded", "ragged"):
        folder = str(tmp_path / layout)
        build(manifest, folder, layout=layout, encoder=ToyVAE(latent_channels=32))  # ~40 KB of latents
        cache = LatentCache(folder)
        cache[0]
        cache.gather_source()  # the memmap is open now
        blob = pickle.dumps(cache)
        data_bytes = os.path.getsize(cache_path(folder, "train", "data"))
        assert len(blob) < cache.widths.nbytes + 4096 < data_bytes / 3
        clone = pickle.loads(blob)
        assert clone.items._mm is None and clone.items._data is None
        assert all(torch.equal(clone[i], cache[i]) for i in range(len(cache)))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_reads_in_spawned_processes(ragged):
    cache = LatentCache(ragged)
    cache[0]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        parts = pool.starmap(_rows_in_child, [(cache, range(0, 12)), (cache, range(12, 24))])
    got = parts[0] + parts[1]
    assert all(torch.equal(got[i], cache[i]) for i in range(24))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_forked_dataloader_workers(padded):
    cache = LatentCache(padded)
    cache.gather_source()  # opened in the parent before the fork
    loader = torch.utils.data.DataLoader(cache, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    assert len(got) == 24 and all(torch.equal(got[i], cache[i]) for i in range(24))
