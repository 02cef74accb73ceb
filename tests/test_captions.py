"""Captions of source images (latentfast.cache.captions): caption files beside the images (the kohya /
SimpleTuner / ai-toolkit rule), a manifest's caption field, and the errors a missing or unreadable
caption gives, on real files."""
from __future__ import annotations

import json

import pytest

from latentfast.cache.captions import Captions, caption_path, manifest_captions, read_caption_file
from latentfast.errors import ArgumentTypeError, CaptionError, InvalidArgumentError


def write(path, data: bytes | str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def test_caption_path_replaces_the_extension():
    assert caption_path("/d/cat_01.png") == "/d/cat_01.txt"
    assert caption_path("/d/a.b.jpeg", ".caption") == "/d/a.b.caption"
    assert caption_path("/d/noext") == "/d/noext.txt"
    for bad in ("txt", ".", "", None):
        with pytest.raises(InvalidArgumentError, match="caption_extension must be a file extension"):
            caption_path("/d/a.png", bad)


@pytest.mark.parametrize("data, first, join", [
    ("a photo of a cat\n", "a photo of a cat", "a photo of a cat"),
    ("  padded \t\r\n", "padded", "padded"),
    ("\ufeffwith a BOM".encode("utf-8"), "with a BOM", "with a BOM"),
    ("ünïcödé 猫", "ünïcödé 猫", "ünïcödé 猫"),
    ("line one\r\n\r\n line two \n", "line one", "line one line two"),
    ("\n\nafter blank lines", "after blank lines", "after blank lines"),
    ("", "", ""),
])
def test_read_caption_file(tmp_path, data, first, join):
    path = write(tmp_path / "a.txt", data)
    assert read_caption_file(path) == first
    assert read_caption_file(path, lines="join") == join


def test_read_caption_file_errors(tmp_path):
    with pytest.raises(CaptionError, match=r"a.txt: not UTF-8 text \(byte 4: b'\\xff'\)"):
        read_caption_file(write(tmp_path / "a.txt", b"abc \xff"))
    two = write(tmp_path / "b.txt", "one\ntwo\n")
    with pytest.raises(CaptionError, match="b.txt: expected one caption, found 2 non-empty lines"):
        read_caption_file(two, lines="error")
    assert read_caption_file(write(tmp_path / "c.txt", "only\n\n"), lines="error") == "only"
    with pytest.raises(InvalidArgumentError, match="lines must be one of"):
        read_caption_file(two, lines="random")


def test_captions_from_files_beside_the_images(tmp_path):
    image = write(tmp_path / "sub" / "dog.png", b"not read")
    write(tmp_path / "sub" / "dog.txt", "a dog\n")
    write(tmp_path / "sub" / "dog.caption", "kohya style\n")
    assert Captions()("sub/dog", image) == "a dog"
    assert Captions(caption_extension=".caption")("sub/dog", image) == "kohya style"
    lonely = write(tmp_path / "cat.jpg", b"")
    with pytest.raises(CaptionError, match=r"image .*cat.jpg \(key 'cat'\) has no caption: no caption file .*cat.txt"):
        Captions()("cat", lonely)
    assert Captions(missing="empty")("cat", lonely) == ""


def test_captions_from_a_manifest(tmp_path):
    write(tmp_path / "imgs" / "a.png", b"")
    write(tmp_path / "imgs" / "b.png", b"")
    write(tmp_path / "imgs" / "b.txt", "from the file")
    write(tmp_path / "imgs" / "c.png", b"")
    write(tmp_path / "imgs" / "a.txt", "the manifest wins")
    manifest = tmp_path / "train.jsonl"
    records = [{"image": "imgs/a.png", "caption": "  a red apple "}, {"image": "imgs/b.png"},
               {"image": "imgs/c.png", "key": "custom", "caption": "keyed"}, {"image": "imgs/d.png", "text": "other field"}]
    manifest.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in records[2:]))
    assert manifest_captions(manifest) == {"imgs/a": "a red apple", "custom": "keyed"}
    assert manifest_captions(manifest, field="text") == {"imgs/d": "other field"}
    captions = Captions(manifest)
    assert captions("imgs/a", tmp_path / "imgs" / "a.png") == "a red apple"
    assert captions("imgs/b", tmp_path / "imgs" / "b.png") == "from the file"
    assert captions("custom", tmp_path / "imgs" / "c.png") == "keyed"
    with pytest.raises(CaptionError, match=r"d.png \(key 'imgs/d'\) has no caption: no 'caption' in manifest .*train.jsonl and no caption file"):
        captions("imgs/d", tmp_path / "imgs" / "d.png")


def test_manifest_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"image": "a.png"}) + "\n" + json.dumps({"image": "b.png", "caption": 3}) + "\n")
    with pytest.raises(ArgumentTypeError, match=r"bad.jsonl line 2 \(.*b.png\): 'caption' must be a string, got int"):
        Captions(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(InvalidArgumentError, match="broken.jsonl line 1: expected a JSON object"):
        manifest_captions(broken)
    with pytest.raises(InvalidArgumentError, match="missing must be one of"):
        Captions(missing="skip")
    with pytest.raises(InvalidArgumentError, match="caption_extension must be a file extension"):
        Captions(caption_extension="txt")
