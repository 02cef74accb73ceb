"""Captions of source images: a ``caption`` field of the JSONL manifest, or a text file beside the image.

The caption file of ``photos/cat_01.png`` is ``photos/cat_01.txt``: the image path without its
extension plus ``caption_extension`` (``os.path.splitext(path)[0] + ext``), the rule kohya sd-scripts
(``caption_extension``), ai-toolkit (``caption_ext``) and SimpleTuner (``caption_strategy=textfile``,
always ``.txt``) share. The text is decoded as UTF-8 (all three do; a byte-order mark, which Windows
editors write, is dropped) and stripped; an empty file is the empty caption. A file of several
lines is read as kohya reads it: ``lines="first"`` keeps the first non-empty line (SimpleTuner would pick one line at random per step, which a
cache of one embedding per image cannot do); ``lines="join"`` joins the non-empty lines with a space
(ai-toolkit feeds the whole file); ``lines="error"`` refuses it.

A manifest's ``caption`` field wins over a caption file. An image with neither is an error naming
the image and the file looked for, unless ``missing="empty"`` (the empty caption: what ai-toolkit
uses for an image without one, and what caption dropout trains on).
"""
from __future__ import annotations

import json
import os

from ..errors import ArgumentTypeError, CaptionError, InvalidArgumentError
from .builders.media import _read_manifest

CAPTION_EXTENSION = ".txt"
LINE_MODES = ("first", "join", "error")
MISSING_MODES = ("error", "empty")


def caption_path(image_path: str | os.PathLike, caption_extension: str = CAPTION_EXTENSION) -> str:
    """The caption file of an image: its path without the extension, plus ``caption_extension``."""
    if not isinstance(caption_extension, str) or not caption_extension.startswith(".") or len(caption_extension) < 2:
        raise InvalidArgumentError(f"caption_extension must be a file extension such as '.txt', got {caption_extension!r}")
    return os.path.splitext(os.fspath(image_path))[0] + caption_extension


def read_caption_file(path: str | os.PathLike, *, lines: str = "first") -> str:
    """The caption in a text file (UTF-8, stripped; see the module's note on ``lines``)."""
    if lines not in LINE_MODES:
        raise InvalidArgumentError(f"lines must be one of {LINE_MODES}, got {lines!r}")
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CaptionError(f"caption file {os.fspath(path)}: not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r})") from None
    found = [line.strip() for line in text.splitlines() if line.strip()]
    if len(found) > 1 and lines == "error":
        raise CaptionError(f"caption file {os.fspath(path)}: expected one caption, found {len(found)} non-empty lines "
                           "(lines='first' keeps the first, lines='join' joins them)")
    if lines == "join":
        return " ".join(found)
    return found[0] if found else ""


class Captions:
    """Looks up the caption of each ``(key, image path)`` of a build source.

    Args:
        manifest: the build's JSONL manifest (its records' ``field`` is the caption), or None for a
            folder source (caption files only).
        caption_extension: the caption file's extension (``.txt``; kohya users often use ``.caption``).
        missing: ``"error"`` (default) or ``"empty"`` for an image with no caption.
        lines: how a caption file of several lines is read (``"first"``, ``"join"``, ``"error"``).
        field: the manifest's caption field.
    """

    def __init__(self, manifest=None, *, caption_extension: str = CAPTION_EXTENSION, missing: str = "error",
                 lines: str = "first", field: str = "caption"):
        if missing not in MISSING_MODES:
            raise InvalidArgumentError(f"missing must be one of {MISSING_MODES}, got {missing!r}")
        if lines not in LINE_MODES:
            raise InvalidArgumentError(f"lines must be one of {LINE_MODES}, got {lines!r}")
        caption_path("x", caption_extension)  # checks the extension now, not at the first image
        self.caption_extension, self.missing, self.lines, self.field = caption_extension, missing, lines, field
        self.manifest = None if manifest is None else os.path.abspath(os.fspath(manifest))
        self._from_manifest = {} if manifest is None else manifest_captions(manifest, field=field)

    def __call__(self, key: str, image_path: str | os.PathLike) -> str:
        if key in self._from_manifest:
            return self._from_manifest[key]
        path = caption_path(image_path, self.caption_extension)
        if os.path.isfile(path):
            return read_caption_file(path, lines=self.lines)
        if self.missing == "empty":
            return ""
        where = f"no {self.field!r} in manifest {self.manifest} and " if self.manifest else ""
        raise CaptionError(f"image {os.fspath(image_path)} (key {key!r}) has no caption: {where}no caption file {path} "
                           "(write one, or pass missing='empty' to train it with the empty caption)")


def manifest_captions(manifest: str | os.PathLike, *, field: str = "caption") -> dict[str, str]:
    """``{item key: caption}`` of the manifest's records that carry ``field``, stripped (keys as the
    builders derive them: the record's ``key``, else its path without extension)."""
    path = os.fspath(manifest)
    entries = _read_manifest(path)  # checks every line and derives the keys, as the builders do
    with open(path, encoding="utf-8") as fh:
        records = [(number, json.loads(text)) for number, text in enumerate(fh, start=1) if text.strip()]
    found: dict[str, str] = {}
    for (key, image), (number, record) in zip(entries, records):
        if field not in record:
            continue
        if not isinstance(record[field], str):
            raise ArgumentTypeError(f"manifest {path} line {number} ({image}): {field!r} must be a string, "
                                    f"got {type(record[field]).__name__}")
        found[key] = record[field].strip()
    return found
