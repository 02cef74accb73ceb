"""Synthetic text-line images (Pillow) for the demo, the benchmarks and the tests."""
from __future__ import annotations

import json
import os
import random

from PIL import Image, ImageDraw, ImageFont

WORDS = (
    "latent cache memmap pinned stream gather kernel width bucket sampler white column padding "
    "encode decode frozen vae camera view balance rank replay cotangent scatter nystrom"
).split()


def render_text_lines(
    out_dir: str,
    count: int,
    *,
    line_height: int = 32,
    max_line_width: int = 512,
    seed: int = 0,
    oversize_fraction: float = 0.05,
) -> str:
    """Render ``count`` black-on-white text lines of varied widths as PNGs; return a JSONL manifest.

    Widths are uniform in [20%, 100%] of ``max_line_width`` (a few lines, ``oversize_fraction``,
    are wider, to exercise the builder's resize). Deterministic for a given seed.
    """
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    font = ImageFont.load_default(size=max(8, int(line_height * 0.6)))
    manifest = os.path.join(out_dir, "lines.jsonl")
    with open(manifest, "w") as fh:
        for index in range(count):
            scale = rng.uniform(1.05, 1.5) if rng.random() < oversize_fraction else rng.uniform(0.2, 1.0)
            width = max(8, int(max_line_width * scale))
            image = Image.new("RGB", (width, line_height), "white")
            draw = ImageDraw.Draw(image)
            x = 2
            while x < width - 4:
                word = rng.choice(WORDS)
                draw.text((x, line_height * 0.15), word, fill=(rng.randint(0, 60),) * 3, font=font)
                x += int(draw.textlength(word + " ", font=font))
            name = f"line_{index:05d}.png"
            image.save(os.path.join(out_dir, name))
            fh.write(json.dumps({"image": name}) + "\n")
    return manifest
