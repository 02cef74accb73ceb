"""The one JSONL manifest reader of every builder: one JSON object per line, naming a source path."""
from __future__ import annotations

import json
import os

from ...errors import InvalidArgumentError


def read_manifest(path: str, kinds: tuple[str, ...]) -> list[tuple[int, str, dict]]:
    """``(line number, path as written, record)`` for each non-blank line of the JSONL manifest at
    ``path``: a JSON object holding a path under the first of ``kinds`` it has (e.g. ``("image",)``
    or ``("image", "video", "frames")``). Anything else raises :class:`InvalidArgumentError` naming
    the file, the line and what was found."""
    entries = []
    with open(path, encoding="utf-8") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                name = next(record[k] for k in kinds if k in record) if isinstance(record, dict) else None
            except (json.JSONDecodeError, StopIteration):
                name = None
            if not isinstance(name, str):
                raise InvalidArgumentError(
                    f"manifest {path} line {number}: expected a JSON object with {_listed(kinds)} path, got {text.strip()[:200]!r}"
                )
            entries.append((number, name, record))
    return entries


def resolve(name: str, root: str) -> str:
    """A manifest entry's path, taken relative to the manifest's folder ``root`` unless absolute."""
    return name if os.path.isabs(name) else os.path.join(root, name)


def _listed(kinds: tuple[str, ...]) -> str:
    quoted = [f"'{k}'" for k in kinds]
    article = "an" if kinds[0][0] in "aeiou" else "a"
    return f"{article} {quoted[0]}" if len(quoted) == 1 else f"{article} {', '.join(quoted[:-1])} or {quoted[-1]}"
