"""build_image_cache(..., text_encoder=) on real Pillow images with captions in ``<stem>.txt`` files or a
JSONL manifest, encoded by tiny random-weight transformers models (no downloads): the fields ``text``
and ``text_pooled``, equal captions stored once, the stamp, reruns after editing a caption; and a
rerun repairing field files damaged after publish."""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_text_encoders import clip_tokenizer, tiny_clip  # noqa: E402

from latentfast.cache import LatentCache, verify_cache  # noqa: E402
from latentfast.cache.builders.images import build_image_cache  # noqa: E402
from latentfast.cache.captions import Captions  # noqa: E402
from latentfast.cache.store.fields import field_path  # noqa: E402
from latentfast.encoders import TextEncoder  # noqa: E402
from latentfast.errors import CacheCorruptError, CaptionError  # noqa: E402
from latentfast.toy import ToyVAE  # noqa: E402
from latentfast.testing import write_captioned_images  # noqa: E402

BUCKETS = [(32, 32), (32, 48)]
CAPTIONS = ["a cat", "a dog", "a cat", "zebra quick", "a cat", ""]


class CountingText(TextEncoder):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.encoded = []

    def encode(self, captions):
        self.encoded += captions
        return super().encode(captions)


def text_encoder(seed=0):
    return CountingText(tiny_clip(seed=seed), clip_tokenizer())


@pytest.fixture()
def images(tmp_path):
    return pathlib.Path(write_captioned_images(tmp_path / "imgs", CAPTIONS, suffix="\n"))


def build(source, out, te, **kw):
    stats = {}
    build_image_cache(ToyVAE(), source, out, buckets=BUCKETS, batch_size=3, quiet=True, text_encoder=te, stats=stats, **kw)
    return stats


def test_text_fields_are_the_encoders_output_and_equal_captions_are_stored_once(images, tmp_path):
    te = text_encoder()
    build(images, tmp_path / "c", te)
    cache = LatentCache(tmp_path / "c", expected={"text_encoder": te.identity()})
    assert sorted(cache.fields) == ["latent", "text", "text_pooled"]
    assert cache.fields["text"]["dtype"] == torch.float32 and cache.fields["text_pooled"]["shapes"].tolist() == [[32]] * 6
    for i, key in enumerate(cache.keys):
        caption = CAPTIONS[int(key[2:])]
        want = te.encode([caption])
        record = cache.record(i)
        assert record["text"].shape == (want.lengths[0], 32)
        torch.testing.assert_close(record["text"], want.embeds[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(record["text_pooled"], want.pooled[0], rtol=0, atol=1e-6)
    entry = cache.meta["fields"]["text"]
    per_caption = {c: te.encode([c]).embeds[0].numel() * 4 for c in set(CAPTIONS)}
    assert entry["logical_bytes"] == sum(per_caption[c] for c in CAPTIONS)
    assert entry["stored_bytes"] == sum(per_caption.values())  # "a cat" three times, stored once
    rows = [i for i in range(6) if cache.shapes[i].tolist() == cache.shapes[0].tolist()]
    batch = cache.read_batch(rows, fields=("latent", "text", "text_pooled"), pad={"text": 0.0})
    lengths = [te.encode([CAPTIONS[int(cache.keys[i][2:])]]).lengths[0] for i in rows]
    assert batch["text_shape"][:, 0].tolist() == lengths and batch["text"].shape == (len(rows), max(lengths), 32)
    other = text_encoder(seed=1)
    with pytest.raises(ValueError, match="text_encoder"):
        LatentCache(tmp_path / "c", expected={"text_encoder": other.identity()})


def test_manifest_captions_win_and_a_missing_caption_is_named(images, tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"image": f"imgs/im{i}.png", "key": f"k{i}", **({"caption": "from json"} if i < 2 else {})}) + "\n"
                                for i in range(4)), encoding="utf-8")
    te = text_encoder()
    build(manifest, tmp_path / "c", te)
    cache = LatentCache(tmp_path / "c")
    want = {"k0": "from json", "k1": "from json", "k2": CAPTIONS[2], "k3": CAPTIONS[3]}
    for i, key in enumerate(cache.keys):
        torch.testing.assert_close(cache.record(i)["text"], te.encode([want[key]]).embeds[0], rtol=0, atol=1e-6)
    os.remove(images / "im3.txt")
    with pytest.raises(CaptionError, match=r"im3.png \(key 'k3'\) has no caption"):
        build(manifest, tmp_path / "d", te)
    build(manifest, tmp_path / "e", te, captions=Captions(manifest, missing="empty"))
    assert LatentCache(tmp_path / "e").record(LatentCache(tmp_path / "e").keys.index("k3"))["text"].shape[0] == 2  # start + end


def test_rerun_after_editing_a_caption_encodes_only_that_item(images, tmp_path):
    te = text_encoder()
    build(images, tmp_path / "c", te)
    assert build(images, tmp_path / "c", te)["unchanged"]
    (images / "im3.txt").write_text("a dog", encoding="utf-8")
    te.encoded.clear()
    stats = build(images, tmp_path / "c", te)
    assert stats["encoded"] == 1 and stats["copied"] == 5 and te.encoded == ["a dog"]
    cache = LatentCache(tmp_path / "c")
    torch.testing.assert_close(cache.record(cache.keys.index("im3"))["text"], te.encode(["a dog"]).embeds[0], rtol=0, atol=0)
    other = text_encoder(seed=1)
    assert build(images, tmp_path / "c", other)["encoded"] == 6  # another text encoder: nothing copied


@pytest.mark.parametrize("damage", ["value", "spans", "crc"])
def test_rerun_repairs_a_field_file_damaged_after_publish(images, tmp_path, damage):
    te = text_encoder()
    out = tmp_path / "c"
    build(images, out, te)
    kind = {"value": "data", "spans": "spans", "crc": "crc"}[damage]
    path = field_path(out, "train", "text", kind)
    good = {n: open(field_path(out, "train", n, k), "rb").read() for n in ("text", "text_pooled") for k in ("data", "spans", "crc")}
    spans = np.load(field_path(out, "train", "text", "spans"))
    at = os.path.getsize(path) - 6
    hit = int(((spans[:, 0] <= at) & (at < spans[:, 0] + spans[:, 1])).sum())  # the items sharing the damaged value
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(b"\x5a\xa5\x5a\xa5")
    with pytest.raises((CacheCorruptError, ValueError)):
        verify_cache(out)
    stats = build(images, out, te)
    assert not stats["unchanged"]
    assert stats["encoded"] == (hit if damage == "value" else 6)  # a damaged value: its items; an index file: all
    verify_cache(out)
    now = {n: open(field_path(out, "train", n, k), "rb").read() for n in ("text", "text_pooled") for k in ("data", "spans", "crc")}
    assert now == good
