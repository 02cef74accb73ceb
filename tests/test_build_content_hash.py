"""The sources' content hashes of an image or video build: a new cache hashes with SHA-256 (cut to 16
bytes, stamped in its meta), each image read once (the decode worker hashes the bytes its decoder
decodes); a cache or an interrupted build made before the stamp (BLAKE2b-128) keeps being compared
with BLAKE2b, so rebuilding or resuming it re-encodes nothing that did not change."""
from __future__ import annotations

import builtins
import hashlib
import os

import numpy as np
import pytest
from PIL import Image

from latentfast.cache import LatentCache
from latentfast.cache.builders import images as images_module
from latentfast.cache.builders import media
from latentfast.cache.builders.images import build_image_cache, build_video_cache
from latentfast.cache.store.durable import LEGACY_CONTENT_HASH, content_hash
from latentfast.errors import InvalidArgumentError
from latentfast.testing import photo_like
from latentfast.toy import ToyVAE

from test_cache_build_pipeline import FailingVAE
from test_cache_images import CountingVAE, make_images

BUCKETS = [(32, 32), (32, 48), (48, 32)]


def stored_hashes(out) -> dict[str, bytes]:
    cache = LatentCache(out)
    return {key: cache.content_hashes()[i].tobytes() for i, key in enumerate(cache.keys)}


def expected(path, algorithm, *, draft=False) -> bytes:
    """What a build stores for an image file, written out from hashlib."""
    data = os.path.basename(path).encode() + b"\0" + open(path, "rb").read()
    if algorithm == "blake2b-128":
        digest = hashlib.blake2b(data, digest_size=16).digest()
    else:
        digest = hashlib.sha256(data).digest()[:16]
    return hashlib.blake2b(digest + b"\0jpeg-draft", digest_size=16).digest() if draft else digest


def sources(folder, rng) -> dict[str, bool]:
    """PNGs and JPEGs, one of them drafted (its bucket shrinks it 4x); ``{file name: drafted}``."""
    os.makedirs(folder)
    Image.fromarray(photo_like(rng, 192, 128)).save(os.path.join(folder, "big.jpg"), quality=90)
    Image.fromarray(photo_like(rng, 64, 48)).save(os.path.join(folder, "small.jpg"), quality=90)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (40 + i, 56, 3), dtype=np.uint8)).save(os.path.join(folder, f"p{i}.png"))
    return {name: name == "big.jpg" for name in os.listdir(folder)}


def test_content_hash_algorithms_and_bytes_already_read(tmp_path):
    path = tmp_path / "a.bin"
    payload = np.random.default_rng(0).bytes(3 << 20)  # several read chunks
    path.write_bytes(payload)
    assert content_hash(path) == hashlib.blake2b(b"a.bin\0" + payload, digest_size=16).digest()  # the default: as before
    sha = content_hash(path, algorithm="sha256-128")
    assert sha == hashlib.sha256(b"a.bin\0" + payload).digest()[:16]
    assert content_hash(path, algorithm="sha256-128", data=payload) == sha
    assert content_hash(path, algorithm="sha256-128", data=payload[:-1]) != sha
    with pytest.raises(InvalidArgumentError, match="algorithm must be one of.*'md5'"):
        content_hash(path, algorithm="md5")
    with pytest.raises(InvalidArgumentError, match="one file; 2 paths"):
        content_hash([path, path], data=payload)


def test_a_new_cache_stores_sha256_hashes_each_image_read_once(tmp_path, monkeypatch):
    """The stamp, the stored hashes (written out from hashlib, the drafted JPEG's derived as always), and
    every source opened twice: its header while planning, then whole once (hashed and decoded from
    those bytes); before, the planning hash read it whole and the decoder read it again (3 opens)."""
    src = str(tmp_path / "src")
    files = sources(src, np.random.default_rng(1))
    opened = []
    real_open = builtins.open

    def counting(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(src):
            opened.append(os.path.basename(os.fspath(file)))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    out = str(tmp_path / "out")
    stats = {}
    build_image_cache(ToyVAE(), src, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    monkeypatch.setattr(builtins, "open", real_open)
    assert stats["encoded"] == len(files)
    assert {name: opened.count(name) for name in files} == dict.fromkeys(files, 2)
    assert LatentCache(out).meta["content_hash"] == "sha256-128"
    want = {os.path.splitext(name)[0]: expected(os.path.join(src, name), "sha256-128", draft=drafted)
            for name, drafted in files.items()}
    assert stored_hashes(out) == want
    stats = {}
    build_image_cache(ToyVAE(), src, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["unchanged"]  # hashed again while planning (there is a cache to compare with), alike


def test_a_blake2b_cache_is_rebuilt_without_reencoding_and_keeps_its_algorithm(tmp_path, monkeypatch):
    """A cache built as before the stamp (the builder's algorithm set to BLAKE2b-128: no ``content_hash``
    in its meta, the hashes main's code stores), rebuilt by this code: nothing encoded; an edited image
    is the only one encoded, and the cache stays BLAKE2b throughout (its copies' hashes compared alike)."""
    src = str(tmp_path / "src")
    files = sources(src, np.random.default_rng(2))
    out = str(tmp_path / "out")
    with monkeypatch.context() as old_code:
        old_code.setattr(images_module, "CONTENT_HASH", LEGACY_CONTENT_HASH)
        build_image_cache(ToyVAE(), src, out, buckets=BUCKETS, batch_size=3, quiet=True)
    assert "content_hash" not in LatentCache(out).meta
    assert stored_hashes(out)["p0"] == expected(os.path.join(src, "p0.png"), "blake2b-128")
    vae, stats = CountingVAE(), {}
    build_image_cache(vae, src, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["unchanged"] and stats["encoded"] == 0 and vae.encoded == 0
    Image.fromarray(np.zeros((44, 56, 3), dtype=np.uint8)).save(os.path.join(src, "p3.png"))  # edited
    stats = {}
    build_image_cache(vae, src, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["encoded"] == 1 and stats["copied"] == len(files) - 1 and vae.encoded == 1
    assert "content_hash" not in LatentCache(out).meta
    want = {os.path.splitext(name)[0]: expected(os.path.join(src, name), "blake2b-128", draft=drafted)
            for name, drafted in files.items()}
    assert stored_hashes(out) == want
    stats = {}
    build_image_cache(vae, src, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["unchanged"]


@pytest.mark.parametrize("algorithm", [LEGACY_CONTENT_HASH, "sha256-128"])
def test_an_interrupted_build_resumes_with_the_hash_it_logged(tmp_path, monkeypatch, algorithm):
    """A build that failed mid-way (its progress log's header holds the stamp, or none: BLAKE2b, an
    interrupted build of the code before) resumes: the logged items' hashes are compared alike, kept."""
    images = str(tmp_path / "imgs")
    make_images(images)
    out = str(tmp_path / "out")
    with monkeypatch.context() as then:
        then.setattr(images_module, "CONTENT_HASH", algorithm)
        with pytest.raises(RuntimeError, match="the encoder broke"):
            build_image_cache(FailingVAE(3), images, out, buckets=BUCKETS, batch_size=3, quiet=True)
    stats = {}
    build_image_cache(ToyVAE(), images, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["resumed"] == 4 and stats["encoded"] == 8
    assert LatentCache(out).meta.get("content_hash", LEGACY_CONTENT_HASH) == algorithm
    path = os.path.join(images, "im00.png")
    assert stored_hashes(out)["im00"] == expected(path, algorithm)


def test_a_clip_folder_is_hashed_by_its_decode_worker_as_its_frames_in_order(tmp_path):
    rng = np.random.default_rng(3)
    clip = tmp_path / "clips" / "c0"
    clip.mkdir(parents=True)
    for t in range(3):
        Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(clip / f"f{t}.png")
    out = str(tmp_path / "out")
    build_video_cache(ToyVAE(), str(tmp_path / "clips"), out, buckets=[(2, 32, 48)], quiet=True)
    frames = [str(clip / f"f{t}.png") for t in range(3)]
    digest = hashlib.sha256()
    for path in frames:
        digest.update(os.path.basename(path).encode() + b"\0" + open(path, "rb").read())
    assert stored_hashes(out) == {"c0": digest.digest()[:16]}
    assert media.source_digest(media.Item("c0", str(clip), frame_paths=frames), "sha256-128") == digest.digest()[:16]
    stats = {}
    build_video_cache(ToyVAE(), str(tmp_path / "clips"), out, buckets=[(2, 32, 48)], quiet=True, stats=stats)
    assert stats["unchanged"]
