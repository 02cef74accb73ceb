"""``latentfast cache build | inspect | verify``.

``add_cache_subparsers(subparsers)`` adds the ``cache`` command to a parent parser's
subparsers; each leaf sets ``func`` to a handler taking the parsed namespace and returning
the exit status. ``python -m latentfast.cache.cli cache ...`` runs them stand-alone.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

_AUTOCAST = {"none": None, "bf16": "bfloat16", "fp16": "float16"}


def add_cache_subparsers(subparsers) -> argparse.ArgumentParser:
    cache = subparsers.add_parser("cache", help="build, inspect or verify an offline VAE latent cache")
    commands = cache.add_subparsers(dest="cache_command", metavar="{build,inspect,verify}")
    commands.required = True

    build = commands.add_parser("build", help="encode line images into a latent cache (resumes an interrupted build)")
    src = build.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", help='JSONL manifest, one {"image": path} per line (paths relative to its folder allowed)')
    src.add_argument("--images", help="folder of line images (sorted by file name)")
    build.add_argument("--out", required=True, help="output folder")
    build.add_argument("--split", default="train")
    build.add_argument("--layout", choices=("padded", "ragged"), default="padded")
    build.add_argument("--line-height", type=int, default=32)
    build.add_argument("--max-line-width", type=int, default=1024)
    build.add_argument("--batch-size", type=int, default=16)
    build.add_argument("--encoder", default="toy",
                       help="'toy' (latentfast.toy.ToyVAE) or 'module:factory', a callable returning an encoder")
    build.add_argument("--toy-seed", type=int, default=0, help="seed of the toy encoder")
    build.add_argument("--toy-channels", type=int, default=4, help="latent channels of the toy encoder")
    build.add_argument("--device", default="cpu")
    build.add_argument("--autocast", choices=sorted(_AUTOCAST), default="none", help="encode under torch.autocast in this dtype")
    build.add_argument("--workers", type=int, default=4, help="image decode threads")
    build.add_argument("--skip-bad-images", action="store_true", help="skip and report missing/corrupt images instead of failing")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=run_build)

    for name, handler, text in (("inspect", run_inspect, "meta, size, padding waste and latent-width histogram"),
                                ("verify", run_verify, "recompute checksums, check finiteness and widths")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("cache_dir")
        sub.add_argument("--split", default="train")
        sub.add_argument("--json", action="store_true", help="print the result as JSON")
        sub.set_defaults(func=handler)
    return cache


def make_encoder(spec: str, *, toy_seed: int = 0, toy_channels: int = 4):
    if spec == "toy":
        from ..toy import ToyVAE

        return ToyVAE(latent_channels=toy_channels, seed=toy_seed)
    module, sep, attr = spec.partition(":")
    if not sep:
        raise SystemExit(f"--encoder must be 'toy' or 'module:factory', got {spec!r}")
    return getattr(importlib.import_module(module), attr)()


def run_build(args) -> int:
    import torch

    from .builder import build_latent_cache

    encoder = make_encoder(args.encoder, toy_seed=args.toy_seed, toy_channels=args.toy_channels)
    autocast = _AUTOCAST[args.autocast]
    path = build_latent_cache(
        encoder,
        args.manifest or args.images,
        args.out,
        args.split,
        line_height=args.line_height,
        max_line_width=args.max_line_width,
        batch_size=args.batch_size,
        layout=args.layout,
        device=args.device,
        autocast_dtype=getattr(torch, autocast) if autocast else None,
        num_workers=args.workers,
        skip_bad_images=args.skip_bad_images,
        quiet=args.quiet,
    )
    if not args.quiet:
        print(f"latent cache written: {path}")
    return 0


def run_inspect(args) -> int:
    from .reader import inspect_cache

    info = inspect_cache(args.cache_dir, args.split)
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    meta = info["meta"]
    print(f"latent cache {args.cache_dir} split={args.split!r}")
    for key in sorted(k for k in meta if k not in ("skipped", "encoder")):
        print(f"  {key}: {meta[key]}")
    if "encoder" in meta:
        print(f"  encoder: {json.dumps(meta['encoder'], sort_keys=True)}")
    if meta.get("skipped"):
        print(f"  skipped lines: {len(meta['skipped'])} (first: {meta['skipped'][0]})")
    print(f"rows: {info['n']}   layout: {info['layout']}")
    print(f"bytes on disk: {info['bytes_on_disk']:,}   data: {info['data_bytes']:,}   padded layout would be: {info['padded_layout_bytes']:,}")
    print(f"padding waste: {info['padding_waste_pct']:.1f}% of the data file")
    if info["resident_bytes"] is not None:
        share = info["resident_bytes"] / info["data_bytes"] if info["data_bytes"] else 1.0
        print(f"in the page cache: {info['resident_bytes']:,} bytes ({share:.0%} of the data file)")
    print("latent width histogram:")
    peak = max((c for _, _, c in info["histogram"]), default=0) or 1
    for lo, hi, count in info["histogram"]:
        print(f"  {lo:>5}-{hi:<5} {count:>9}  {'#' * round(40 * count / peak)}")
    return 0


def run_verify(args) -> int:
    from .reader import IncompleteCacheError, verify_cache

    try:
        result = verify_cache(args.cache_dir, args.split)
    except (ValueError, OSError, IncompleteCacheError) as exc:  # corrupt, inconsistent or missing files
        print(f"verify FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        kind = "checksums, finiteness and widths" if result["checksummed"] else "finiteness and widths (this cache stores no checksums)"
        print(f"verify OK: {result['rows']} rows, {result['bytes']:,} bytes, {result['blocks']} blocks: "
              f"{kind} in {result['seconds']:.3f} s ({result['gb_per_s']:.2f} GB/s)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="latentfast")
    add_cache_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
