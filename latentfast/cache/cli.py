"""``latentfast cache build | import | merge | inspect | verify | push | pull``.

``add_cache_subparsers(subparsers)`` adds the ``cache`` command to a parent parser's subparsers;
each leaf sets ``func`` to a handler taking the parsed namespace and returning the exit status.
Every failure is one line on stderr and a non-zero exit, never a traceback (set
``LATENTFAST_DEBUG=1`` to get the traceback). ``python -m latentfast.cache.cli cache ...`` runs them
stand-alone.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import tempfile

_AUTOCAST = {"none": None, "bf16": "bfloat16", "fp16": "float16"}
_ENCODERS = "'toy' (latentfast.toy.ToyVAE), 'module:factory' (a callable returning an encoder), " \
            "'diffusers:PATH' (a diffusers VAE folder saved with save_pretrained, or a model folder with a vae/ " \
            "subfolder; the class comes from its config.json) or 'diffusers:CLASS:PATH'"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default printed once, and only where there is one (not ``(default: None)``, not for
    on/off flags, not after a help text that names its default); required options marked."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            text += " (required)"
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return text + " (default: %(default)s)"

    def _split_lines(self, text, width):  # never split an option name such as --max-bucket across lines
        import textwrap

        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


class CliError(Exception):
    """A bad command-line value: printed as one line, exit status 2."""


def _one_line_errors(handler):
    """Run ``handler``; any exception becomes one line on stderr and a non-zero exit status."""

    @functools.wraps(handler)
    def run(args) -> int:
        try:
            return handler(args)
        except KeyboardInterrupt:
            print(f"latentfast cache {args.cache_command}: interrupted (rerun the same command to resume)", file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - the CLI's promise: one clear line, no traceback
            if os.environ.get("LATENTFAST_DEBUG"):
                raise
            kind = "" if type(exc).__module__.startswith("latentfast") or isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: "
            print(f"latentfast cache {args.cache_command}: error: {kind}{error_text(args, exc)}", file=sys.stderr)
            return 2 if isinstance(exc, CliError) else 1

    return run


def error_text(args, exc: Exception) -> str:
    """``exc`` as one line, without the object-storage client's debug dump; a failed request to an
    ``s3://`` URL names the settings that are not set (the likely reason)."""
    text = " ".join(str(exc).split()).split(" Debug source:", 1)[0] or type(exc).__name__
    from .remote.errors import RemoteReadError

    missing = _missing_s3_settings(args)
    if isinstance(exc, RemoteReadError) and missing:
        return f"{' and '.join(missing)}; the client's error: {text}"
    return text


def _missing_s3_settings(args) -> list[str]:
    """What a request to this command's ``s3://`` URL lacks: an endpoint, credentials (none for other URLs)."""
    url = getattr(args, "url", None) or getattr(args, "cache_dir", "")
    if not str(url).startswith("s3://"):
        return []
    missing = []
    if not (getattr(args, "endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")):
        missing.append(f"{url}: no endpoint is set (AWS_ENDPOINT_URL or --endpoint-url; without one the client asks AWS S3)")
    keys = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not (keys or any(os.environ.get(k) for k in _OTHER_CREDENTIALS)):
        missing.append(f"{'no' if missing else f'{url}: no'} credentials are set (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
                       f"without them the client asks the cloud's instance metadata service)")
    return missing


# the other ways the client finds credentials without the metadata service (web identity, a container's, none needed)
_OTHER_CREDENTIALS = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                      "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_SKIP_SIGNATURE")


def add_cache_subparsers(subparsers) -> argparse.ArgumentParser:
    cache = subparsers.add_parser("cache", help="the commands of an offline VAE latent cache (listed above)")
    commands = cache.add_subparsers(dest="cache_command")
    commands.required = True
    _add_build(commands)
    _add_import(commands)
    _add_merge(commands)
    for name, handler, text in (("inspect", run_inspect, "meta, size, padding waste and latent-width (or shape) histogram"),
                                ("verify", run_verify, "recompute checksums, check finiteness, widths and shapes")):
        sub = commands.add_parser(name, help=text, description=text + ". A cache in object storage (s3://bucket/prefix) "
                                  "is read through a local chunk cache; the standard AWS environment variables are honoured.",
                                  formatter_class=HelpFormatter)
        sub.add_argument("cache_dir", help="folder holding the cache, or its object-store URL (s3://bucket/prefix)")
        sub.add_argument("--split", default="train", help="which split of the folder")
        sub.add_argument("--json", action="store_true", help="print the result as JSON")
        sub.add_argument("--endpoint-url", help="URLs: the S3-compatible endpoint (overrides AWS_ENDPOINT_URL)")
        sub.add_argument("--local-cache", help="URLs: the folder of fetched chunks (default: a temporary folder, removed after)")
        sub.add_argument("--local-cache-bytes", type=parse_bytes, default=2 << 30,
                         help="URLs: the local cache's budget, in bytes or with a K/M/G/T suffix")
        _add_timeout(sub, 30.0)
        sub.set_defaults(func=_one_line_errors(handler))
    _add_push_pull(commands)
    _add_export(commands)
    commands.metavar = "{" + ",".join(commands.choices) + "}"
    return cache


def _add_export(commands) -> None:
    text = ("write a cache imported from a trainer back as that trainer's own files (kohya .npz, musubi-tuner "
            ".safetensors), which its loader reads as the same tensors")
    sub = commands.add_parser("export", help=text, description=text, formatter_class=HelpFormatter)
    sub.add_argument("cache_dir", help="folder holding the cache")
    sub.add_argument("--format", required=True, choices=("kohya", "musubi-tuner"), help="the trainer's file format")
    sub.add_argument("--out", required=True, help="folder to write the trainer's files into")
    sub.add_argument("--split", default="train", help="which split of the folder")
    sub.set_defaults(func=_one_line_errors(run_export))


def run_export(args) -> int:
    from .export import export_cache

    counts = export_cache(args.cache_dir, args.out, args.format, args.split)
    print(f"{counts['items']} items exported as {args.format}: {counts['files']} files in {args.out}")
    return 0


def _add_push_pull(commands) -> None:
    for name, handler, text, src, dst in (
            ("push", run_push, "upload a finished cache folder to object storage (data first, the meta last: a "
             "half-pushed cache never opens)", ("cache_dir", "the local cache folder"), ("url", "s3://bucket/prefix")),
            ("pull", run_pull, "download a cache from object storage into a folder, verify it, then publish it there "
             "(the meta last: a pull that fails its checks leaves the folder as it was)",
             ("url", "s3://bucket/prefix"), ("cache_dir", "the local folder to write"))):
        sub = commands.add_parser(name, help=text, description=text + ". The standard AWS environment variables "
                                  "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION) are honoured.",
                                  formatter_class=HelpFormatter)
        sub.add_argument(src[0], help=src[1])
        sub.add_argument(dst[0], help=dst[1])
        sub.add_argument("--endpoint-url", help="the S3-compatible endpoint (overrides AWS_ENDPOINT_URL)")
        _add_timeout(sub, None)
        if name == "pull":
            sub.add_argument("--no-verify", action="store_true", help="skip verifying the pulled cache's checksums "
                             "(sizes and single-part uploads' MD5s are still checked)")
        sub.set_defaults(func=_one_line_errors(handler))


def _add_timeout(sub, default) -> None:
    sub.add_argument("--timeout", type=float, default=default, metavar="SECONDS",
                     help="URLs: the seconds one object-store request may take, and its retries after it: an endpoint "
                     "that accepts and never answers fails within about twice this" +
                     (f" (default: {default:g})" if default else " (default: the client's, 30 s a request, retries for 180 s)"))


def _storage_options(args) -> dict | None:
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    if args.timeout is not None:
        if args.timeout <= 0:
            raise CliError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        options.update(timeout=args.timeout, retry_timeout=args.timeout)
    return options or None


def parse_bytes(text: str) -> int:
    """``"2G"`` -> ``2 << 30``; ``"4096"`` as it is (K, M, G, T: powers of 1024)."""
    shifts = {"K": 10, "M": 20, "G": 30, "T": 40}
    number = text.strip().upper().removesuffix("B").removesuffix("I")  # (512M, 512MB, 512MiB)
    shift = shifts.get(number[-1:], 0)
    try:
        value = float(number[:-1] if shift else number) * (1 << shift)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 1073741824, 512M or 2G, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return int(value)


@contextlib.contextmanager
def _remote_options(args):
    """The ``storage_options`` / ``local_cache`` / ``local_cache_bytes`` of inspect and verify: none for a
    local folder; for a URL, the given local cache or a temporary one removed afterwards."""
    from .remote.storage import is_remote

    if not is_remote(args.cache_dir):
        if args.endpoint_url or args.local_cache:
            raise CliError(f"--endpoint-url and --local-cache are for caches in object storage (s3://...), not the folder {args.cache_dir!r}")
        yield {}
        return
    with contextlib.ExitStack() as stack:
        folder = args.local_cache or stack.enter_context(tempfile.TemporaryDirectory(prefix="latentfast-"))
        yield {"storage_options": _storage_options(args), "local_cache": folder, "local_cache_bytes": args.local_cache_bytes}


def run_push(args) -> int:
    from .remote import push

    names = push(args.cache_dir, args.url, _storage_options(args))
    print(f"pushed {len(names)} files of {args.cache_dir} to {args.url} (the meta last)")
    return 0


def run_pull(args) -> int:
    from .remote import pull

    stats: dict = {}
    names = pull(args.url, args.cache_dir, _storage_options(args), verify=not args.no_verify, stats=stats)
    for split, result in stats["verified"].items():
        print(f"verify OK: split {split!r}, {result['rows']} rows, {result['bytes']:,} bytes")
    print(f"pulled {len(names)} files of {args.url} into {args.cache_dir}")
    return 0


def _add_build(commands) -> None:
    text = ("encode images into a latent cache: images in aspect-ratio buckets (the default; --buckets, or buckets "
            "generated from --resolution as kohya does), video clips (--video --buckets) or text lines of one height "
            "(--lines); rerun the same command to resume an interrupted build, to re-encode only edited images, or "
            "to repair a damaged cache")
    build = commands.add_parser("build", help=text, description=text, formatter_class=HelpFormatter)
    src = build.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", help='JSONL manifest, one {"image": path} per line (or {"video"|"frames": path} with '
                     "--video; paths relative to its folder allowed; an optional \"key\")")
    src.add_argument("--images", help="folder of images (walked recursively, sorted by name), or with --video of clips "
                     "(sub-folders of frame images, video files)")
    src.add_argument("--from-config", nargs=2, metavar=("FORMAT", "FILE"), help="a kohya (sd-scripts) or musubi-tuner "
                     "dataset config (TOML): one split per kohya subset / musubi image dataset, the trainer's bucket shapes, "
                     "flip_aug, caption_extension; dataset.json lists the splits' num_repeats")
    build.add_argument("--out", required=True, help="output folder (a cache per split)")
    build.add_argument("--split", default="train", help="name of the split (the files' prefix)")
    build.add_argument("--encoder", default=None, help=f"required: the VAE, {_ENCODERS}")
    build.add_argument("--sample", choices=("mode", "sample", "store"), default="mode",
                       help="diffusers encoders: the posterior's mode, a seeded draw from it, or store its mean and std "
                       "(fields latent, latent_std) for a fresh draw at every read")
    build.add_argument("--vae-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="diffusers encoders: load the weights in this dtype (default: as saved)")
    mode = build.add_mutually_exclusive_group()
    mode.add_argument("--video", action="store_true", help="the source holds video clips; needs --buckets FxHxW")
    mode.add_argument("--lines", action="store_true", help="build a text-line cache: every image one line of "
                      "--line-height pixels, widths kept (--layout, --max-line-width)")
    build.add_argument("--buckets", default=None, help="comma-separated HxW pixel sizes (e.g. 512x512,576x448,448x576); "
                       "with --video, FxHxW (frames x height x width) (default: images generated from --resolution)")
    build.add_argument("--resolution", type=int, default=1024, help="images without --buckets: buckets of about this "
                       "many pixels squared (kohya's scheme: every WxH, multiples of --bucket-step, sides from "
                       "--min-bucket to --max-bucket, area at most the square's)")
    build.add_argument("--min-bucket", type=int, default=256, help="images without --buckets: the shortest bucket side")
    build.add_argument("--max-bucket", type=int, default=2048, help="images without --buckets: the longest bucket side")
    build.add_argument("--bucket-step", type=int, default=64, help="images: bucket sides are multiples of this")
    build.add_argument("--no-upscale", action="store_true", help="images: never enlarge an image to fit a bucket; one "
                       "its bucket would enlarge gets a bucket of its own size (kohya's bucket_no_upscale)")
    build.add_argument("--frame-stride", type=int, default=1, help="--video: take every N-th frame")
    build.add_argument("--layout", choices=("padded", "ragged"), default="padded", help="line caches: on-disk layout")
    build.add_argument("--line-height", type=int, default=32, help="line caches: pixel height of every line")
    build.add_argument("--max-line-width", type=int, default=1024, help="line caches: wider lines are resized to this")
    build.add_argument("--batch-size", type=int, default=16, help="images encoded per encoder call")
    build.add_argument("--toy-seed", type=int, default=0, help="seed of the toy encoder")
    build.add_argument("--toy-channels", type=int, default=4, help="latent channels of the toy encoder")
    build.add_argument("--device", default="auto", help="where the encoder runs: auto (cuda where torch sees a GPU, else "
                       "cpu), cpu, cuda, cuda:1")
    build.add_argument("--autocast", choices=sorted(_AUTOCAST), default="none", help="encode under torch.autocast in this dtype")
    build.add_argument("--workers", type=int, default=None, help="image decode threads (default: the cores available)")
    build.add_argument("--skip-bad-images", action="store_true", help="skip and report missing, corrupt or truncated "
                       "images (or clips) instead of failing")
    build.add_argument("--lock-timeout", type=float, default=0.0,
                       help="seconds to wait for another build of the same split in --out before failing")
    build.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    build.add_argument("--distributed", action="store_true", help="one rank of a distributed build (run under torchrun): "
                       "each rank encodes its share into a shard of --out, rank 0 writes the manifest; --device cuda "
                       "means each rank's own GPU (LOCAL_RANK)")
    _add_record_options(build)
    build.set_defaults(func=_one_line_errors(run_build))


def _add_record_options(build) -> None:
    """``cache build``'s options for the fields beside the latent and for where the VAE comes from."""
    build.add_argument("--vae-config", default=None, help="--encoder diffusers:FILE.safetensors (a single-file checkpoint): "
                       "a diffusers VAE folder with its config.json (default: the config diffusers infers, from the local "
                       "Hugging Face cache)")
    build.add_argument("--flip", action="store_true", help="images: also encode each image's mirror (field latent_flipped, "
                       "kohya's flip_aug)")
    build.add_argument("--latent-dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                       help="the stored dtype of the latent fields")
    build.add_argument("--text-encoder", action="append", default=None, metavar="DIR",
                       help="images: encode each image's caption with this transformers text encoder (a local "
                       "save_pretrained folder with its tokenizer; fields text, text_pooled); with --preset, one "
                       "folder per encoder of the pipeline in its order, or one diffusers pipeline folder")
    build.add_argument("--preset", default=None, metavar="NAME",
                       help="images: encode captions as this model family's pipeline does: sd15, sdxl, sd3, flux, wan or hunyuan-video "
                       "(see latentfast.text_presets; fields text_clip_l, "
                       "text_clip_g, text_t5, text_pooled, ...); the encoders from --text-encoder, else from the "
                       "--encoder diffusers:FOLDER pipeline folder")
    build.add_argument("--text-max-length", type=int, default=None, help="tokens per caption: a T5's "
                       "max_sequence_length (presets: the pipeline's default), or the max length of a --text-encoder")
    build.add_argument("--text-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="load the text encoders in this dtype (default: as saved)")
    build.add_argument("--caption-ext", default=".txt", help="captions: the extension of the caption file beside each "
                       "image (a manifest's \"caption\" wins)")
    build.add_argument("--caption-missing", choices=("error", "empty"), default="error",
                       help="an image without a caption: fail naming it, or train it with the empty caption")


def _add_import(commands) -> None:
    text = ("import a trainer's cache folder (--format kohya | musubi-tuner | ai-toolkit | simpletuner | diffusion-pipe, "
            "or auto to detect it) as records: latents, flipped and extra latents, masks, text-encoder outputs, in their "
            "own dtypes, keyed by image stem; or per-item latent files of one extension (--format npz | safetensors | pt: "
            "keys = relative paths without extension, stored as float16)")
    imp = commands.add_parser("import", help=text, description=text, formatter_class=HelpFormatter)
    imp.add_argument("source_dir", help="folder of latent files (walked recursively)")
    imp.add_argument("--out", required=True, help="output folder")
    imp.add_argument("--format", required=True, choices=("kohya", "musubi-tuner", "ai-toolkit", "simpletuner", "diffusion-pipe",
                                                          "auto", "npz", "safetensors", "pt"),
                     help="the trainer that wrote the folder (auto: detect it), or the files' extension")
    imp.add_argument("--convention", choices=("keep", "scaled", "raw"), default="keep",
                     help="trainer formats: store latents scaled ((z - shift) * scale) or raw, converting as needed "
                     "(keep: as the trainer stored them; the stamp says which)")
    imp.add_argument("--scaling-factor", type=float, default=None, help="the VAE config's scaling_factor (for --convention)")
    imp.add_argument("--shift-factor", type=float, default=None, help="the VAE config's shift_factor (for --convention)")
    imp.add_argument("--arch", default=None, help="kohya: which architecture's files to import when several are there")
    imp.add_argument("--images", default=None, help="simpletuner: the image folder (recovers stems from hashed names, "
                     "captions from {stem}.txt)")
    imp.add_argument("--latent-dtype", choices=("bfloat16", "float16"), default=None,
                     help="trainer formats: store the VAE latents (latent, latent_flipped, ...) in this dtype, rounded to "
                     "nearest (an item with a value float16 cannot hold is refused, named); default: the source's dtype")
    imp.add_argument("--require", action="append", default=None, metavar="FIELD",
                     help="trainer formats: refuse the import, naming each file, if an item lacks FIELD (e.g. latent_flipped, "
                     "alpha_mask; text: the text-encoder outputs); repeatable. Without it such items are imported without "
                     "that field (an optional field) and listed")
    imp.add_argument("--dataset-id", default=None, help="simpletuner: the dataset's id, for models that key text "
                     "embeddings by dataset and file path (default: tried from the VAE cache folder's name)")
    imp.add_argument("--reasoner-component", default=None, help="simpletuner cosmos3: the config's "
                     "cosmos3_reasoner_component (default: each id its auto gives is tried)")
    imp.add_argument("--framerate", type=float, default=None, help="simpletuner cosmos3: the config's framerate "
                     "(default 24), which its text files' names hash")
    imp.add_argument("--key", default=None, help="entry holding the latent (default: 'latents', the one tensor named "
                     "'latent...', or the only entry)")
    imp.add_argument("--split", default="train", help="name of the split")
    imp.add_argument("--lock-timeout", type=float, default=0.0, help="seconds to wait for another writer of the split")
    imp.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    imp.add_argument("--distributed", action="store_true", help="one rank of a distributed import (run under torchrun): "
                     "each rank imports its share into a shard of --out, rank 0 writes the manifest")
    imp.set_defaults(func=_one_line_errors(run_import))


def make_encoder(spec: str, *, toy_seed: int = 0, toy_channels: int = 4, sample: str = "mode", vae_dtype=None,
                 vae_config=None):
    """The encoder a ``--encoder`` value names (see the build command's help)."""
    if spec == "toy":
        from ..toy import ToyVAE

        return ToyVAE(latent_channels=toy_channels, seed=toy_seed)
    module, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise CliError(f"--encoder must be 'toy', 'module:factory' or 'diffusers:PATH', got {spec!r}")
    if module == "diffusers":
        from ..encoders import load_diffusers_vae

        return load_diffusers_vae(attr, sample=sample, dtype=vae_dtype, config=vae_config)
    return getattr(importlib.import_module(module), attr)()


def parse_buckets(text: str, *, video: bool) -> list[tuple[int, ...]]:
    """``"512x512,576x448"`` -> ``[(512, 512), (576, 448)]`` (``FxHxW`` triples with ``video``)."""
    size = 3 if video else 2
    try:
        buckets = [tuple(int(x) for x in part.strip().lower().split("x")) for part in text.split(",") if part.strip()]
    except ValueError:
        buckets = []
    if not buckets or any(len(b) != size for b in buckets):
        form = "FxHxW (frames x height x width)" if video else "HxW (height x width)"
        raise CliError(f"--buckets must be comma-separated {form} sizes, got {text!r}")
    return buckets


NO_ENCODER = ("--encoder is required: name the VAE that encodes the images, e.g. --encoder diffusers:PATH (a diffusers "
              "VAE folder saved with save_pretrained, or a model folder with a vae/ subfolder; "
              "diffusers:AutoencoderKL:PATH names the class), --encoder module:factory, or --encoder toy for the "
              "random-weight toy VAE of the demo and tests")


def run_build(args) -> int:
    if args.encoder is None:
        raise CliError(NO_ENCODER)
    if args.video and not args.buckets:
        raise CliError("--video needs --buckets FxHxW (frames x height x width)")
    if args.lines and args.buckets:
        raise CliError("--lines builds a text-line cache of one --line-height; --buckets is for image or video caches")
    args.device, line = pick_device(args.device)
    if line and not args.quiet and os.environ.get("RANK", "0") == "0":
        print(line)
    encoder = make_encoder(args.encoder, toy_seed=args.toy_seed, toy_channels=args.toy_channels, sample=args.sample,
                           vae_dtype=args.vae_dtype, vae_config=args.vae_config)
    new_folder = not os.path.isdir(args.out)
    before = _written(args.out)
    try:
        path = _distributed(args, lambda group: _build(args, encoder, group)) if args.distributed else _build(args, encoder)
    except BaseException:
        if new_folder:  # the lock file went with its lock (durable.BuildLock); the folder goes if we made it and it is empty
            with contextlib.suppress(OSError):
                os.rmdir(args.out)
        raise
    if not args.quiet:
        print(_up_to_date(args, path) if not new_folder and _written(args.out) == before else f"latent cache written: {path}")
    return 0


def _written(folder: str) -> dict:
    """``(size, mtime)`` of every file under ``folder`` but the hidden ones (locks): what a build wrote changes it."""
    state = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if not name.startswith("."):
                st = os.stat(os.path.join(root, name))
                state[os.path.join(root, name)] = (st.st_size, st.st_mtime_ns)
    return state


def _up_to_date(args, path: str) -> str:
    from .store.opening import LatentCache

    return f"up to date: {len(LatentCache(args.out, args.split))} unchanged ({path})"


def pick_device(device: str) -> tuple[str, str | None]:
    """``--device`` as the builders take it, and a line saying what ``auto`` chose (None otherwise).
    A CUDA device this torch cannot use is refused here, before any model is loaded."""
    import torch

    cpu_only = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda", f"--device auto: cuda ({torch.cuda.get_device_name(0)}; --device cpu encodes on the CPU)"
        why = f"torch {torch.__version__} is a CPU-only build" if cpu_only else "torch sees no GPU"
        return "cpu", f"--device auto: cpu ({why})"
    if device.startswith("cuda") and cpu_only:
        raise CliError(f"--device {device}: torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
                       f"install a CUDA build of torch, or use --device cpu (or auto)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); use --device cpu (or auto)")
    return device, None


def _distributed(args, run):
    """``--distributed``: join the torchrun group (gloo on CPU, NCCL on GPUs: ``--device cuda`` becomes
    this rank's GPU, LOCAL_RANK) and return ``run(group)``, this rank's part of a build or import."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CliError(f"--distributed runs under torchrun (e.g. torchrun --nproc_per_node 2 -m latentfast cache "
                       f"{args.cache_command} ... --distributed): RANK and WORLD_SIZE are not set")
    on_gpu = getattr(args, "device", "cpu").startswith("cuda")
    if on_gpu:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(args.device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        args.quiet = args.quiet or dist.get_rank() != 0  # one progress bar and one summary: rank 0's
        return run(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _build(args, encoder, group=None) -> str:
    """Build the cache the mode flags ask for (images by default, --video, --lines)."""
    import torch

    autocast = _AUTOCAST[args.autocast]
    common = dict(batch_size=args.batch_size, device=args.device, num_workers=args.workers, quiet=args.quiet,
                  autocast_dtype=getattr(torch, autocast) if autocast else None, lock_timeout=args.lock_timeout,
                  group=group)
    if args.from_config:
        return _build_from_config(args, encoder, common)
    source = args.manifest or args.images
    image_only = [flag for flag, on in (("--flip", args.flip), ("--text-encoder", args.text_encoder), ("--preset", args.preset),
                                        ("--latent-dtype", args.lines and args.latent_dtype != "float16")) if on]
    if (args.video or args.lines) and image_only:
        raise CliError(f"{', '.join(image_only)}: image caches only, not with {'--video' if args.video else '--lines'}")
    if args.lines:
        from .builders.lines import build_latent_cache

        return build_latent_cache(encoder, source, args.out, args.split, line_height=args.line_height,
                                  max_line_width=args.max_line_width, layout=args.layout,
                                  skip_bad_images=args.skip_bad_images, **common)
    from .builders.images import build_image_cache, build_video_cache

    if args.video:
        return build_video_cache(encoder, source, args.out, args.split, buckets=parse_buckets(args.buckets, video=True),
                                 frame_stride=args.frame_stride, skip_bad_clips=args.skip_bad_images,
                                 latent_dtype=args.latent_dtype, **common)
    if args.buckets:
        buckets = parse_buckets(args.buckets, video=False)
    else:
        from .builders.media import resolution_buckets

        buckets = resolution_buckets(args.resolution, args.min_bucket, args.max_bucket, args.bucket_step)
    return build_image_cache(encoder, source, args.out, args.split, buckets=buckets, no_upscale=args.no_upscale,
                             bucket_step=args.bucket_step, skip_bad_images=args.skip_bad_images,
                             **_record_options(args), **common)


def _build_from_config(args, encoder, common) -> str:
    """``--from-config kohya|musubi-tuner FILE``: the config's splits, as its trainer buckets them."""
    from .dataset_config import CONFIG_KINDS, build_from_config

    kind, path = args.from_config
    if kind not in CONFIG_KINDS:
        raise CliError(f"--from-config FORMAT FILE: FORMAT must be one of {', '.join(CONFIG_KINDS)}, got {kind!r}")
    given = [flag for flag, on in (("--video", args.video), ("--lines", args.lines), ("--buckets", args.buckets),
                                   ("--no-upscale", args.no_upscale), ("--flip", args.flip)) if on]
    if given:
        raise CliError(f"{', '.join(given)}: --from-config takes the buckets and flip_aug from the config")
    options = _record_options(args)
    options.pop("captions", None)  # each subset's caption_extension / class_tokens
    options.pop("flip")  # each subset's flip_aug
    splits = build_from_config(encoder, kind, path, args.out, **options, **common)
    return f"{os.path.join(args.out, 'dataset.json')} ({len(splits)} splits)"


def _record_options(args) -> dict:
    """``build_image_cache``'s flip / latent_dtype / text_encoder / captions from the record options."""
    options = {"flip": args.flip, "latent_dtype": args.latent_dtype}
    folders = args.text_encoder or []
    if args.preset is not None:
        from ..text_presets import load_text_preset

        if not folders:
            pipeline = args.encoder.removeprefix("diffusers:")
            if not args.encoder.startswith("diffusers:") or not os.path.isdir(os.path.join(pipeline, "text_encoder")):
                raise CliError(f"--preset {args.preset} needs --text-encoder folders, or --encoder diffusers:FOLDER of a "
                               f"pipeline with a text_encoder/ subfolder; got --encoder {args.encoder}")
            folders = pipeline
        elif len(folders) == 1 and os.path.isdir(os.path.join(folders[0], "text_encoder")):
            folders = folders[0]  # a diffusers pipeline folder
        options["text_encoder"] = load_text_preset(args.preset, folders, dtype=args.text_dtype, max_length=args.text_max_length)
    elif len(folders) > 1:
        raise CliError(f"several --text-encoder folders need --preset (which fields they make), got {len(folders)}: {folders}")
    elif folders:
        from ..encoders import TextEncoder
        from ..text_presets import load_text_model

        model, tokenizer = load_text_model(folders[0], dtype=args.text_dtype)
        options["text_encoder"] = TextEncoder(model, tokenizer, max_length=args.text_max_length)
    if "text_encoder" in options:
        from .captions import Captions

        options["captions"] = Captions(args.manifest, caption_extension=args.caption_ext, missing=args.caption_missing)
    return options


def run_import(args) -> int:
    stats: dict = {}
    path = _distributed(args, lambda group: _import(args, stats, group)) if args.distributed else _import(args, stats)
    if not args.quiet:
        unit = "items" if "evidence" in stats else "files"
        what = f"{stats['imported']} {unit} imported, {stats['resumed']} resumed"
        if "ranks" in stats:
            what += f" by {stats['ranks']} ranks"
        if "evidence" in stats:
            print(stats["evidence"])
        print(stats["summary"])
        lacking = stats.get("lacking") or []
        for key, field, where in lacking[:20]:  # the items imported without a field others have
            print(f"  {key}: no {field} (no {where})")
        if len(lacking) > 20:
            print(f"  ... and {len(lacking) - 20} more (--require FIELD refuses such items)")
        print(_up_to_date(args, path) if stats.get("unchanged") else f"latent cache written: {path} ({what})")
    return 0


def _import(args, stats: dict, group=None) -> str:
    """Import as the flags say (one rank's share with ``group``: ``stats`` then counts every rank's items)."""
    from .builders.importers import import_latents

    given = (("arch", args.arch), ("images", args.images), ("require", args.require), ("latent_dtype", args.latent_dtype),
             ("dataset_id", args.dataset_id), ("reasoner_component", args.reasoner_component), ("framerate", args.framerate))
    trainer = {k: v for k, v in given if v is not None}
    if args.convention != "keep" or args.scaling_factor is not None or args.shift_factor is not None:
        trainer.update(scaled={"keep": None, "scaled": True, "raw": False}[args.convention],
                       scaling_factor=args.scaling_factor, shift_factor=args.shift_factor)
    path = import_latents(args.source_dir, args.out, args.split, format=args.format, key=args.key, quiet=args.quiet,
                          lock_timeout=args.lock_timeout, stats=stats, group=group, **trainer)
    if group is not None:  # the summary line speaks for the whole import, not rank 0's shard
        import torch.distributed as dist

        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, {k: stats[k] for k in ("imported", "resumed", "unchanged")}, group=group)
        stats.update(imported=sum(s["imported"] for s in every), resumed=sum(s["resumed"] for s in every),
                     unchanged=all(s["unchanged"] for s in every), ranks=len(every))
    return path


def _add_merge(commands) -> None:
    text = ("join caches of one encoder stamp into one sharded cache, without re-encoding: --out refers to the sources' "
            "files (or copies them with --copy); the items in the order of the sources")
    merge = commands.add_parser("merge", help=text, description=text, formatter_class=HelpFormatter)
    merge.add_argument("sources", nargs="+", help="cache folders (complete caches, single or sharded)")
    merge.add_argument("--out", required=True, help="folder of the sharded cache")
    merge.add_argument("--split", default="train", help="which split of every folder")
    merge.add_argument("--copy", action="store_true", help="copy the sources' files into --out/shards/ instead of referring to them")
    merge.set_defaults(func=_one_line_errors(run_merge))


def run_merge(args) -> int:
    from .store.shards import merge_caches
    from .store.opening import LatentCache

    path = merge_caches(args.sources, args.out, args.split, copy=args.copy)
    print(f"sharded cache written: {path} ({len(LatentCache(args.out, args.split))} items from {len(args.sources)} caches)")
    return 0


def run_inspect(args) -> int:
    from .store.opening import inspect_cache

    with _remote_options(args) as remote:
        info = inspect_cache(args.cache_dir, args.split, **remote)
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    meta = info["meta"]
    print(f"latent cache {args.cache_dir} split={args.split!r}")
    hidden = {"skipped", "encoder", "files"} | (set(_LINE_ONLY) if "shape_counts" in info else set())
    for key in sorted(k for k in meta if k not in hidden):
        print(f"  {key}: {meta[key]}")
    if "encoder" in meta:
        print(f"  encoder: {json.dumps(meta['encoder'], sort_keys=True)}")
    if meta.get("skipped"):
        print(f"  skipped: {len(meta['skipped'])} (first: {meta['skipped'][0]})")
    print(f"rows: {info['n']}   layout: {info['layout']}")
    print("fields (bytes: logical = every item's value, stored = on disk, equal values once):")
    for name, field in info["fields"].items():
        absent = f"   optional: {field['absent']:,} items without" if "absent" in field else ""
        print(f"  {name:>16} {field['dtype']:>9} {field['ndim']}-D   logical {field['logical_bytes']:>15,}   stored {field['stored_bytes']:>15,}{absent}")
    if "shape_counts" in info:
        _print_shaped(info)
        return 0
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


_LINE_ONLY = ("latent_h", "w_max", "line_height", "max_line_width")  # a shaped cache's meta holds these for the original format only


def human_size(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; bytes below 1 KiB as they are."""
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


def _print_shaped(info: dict) -> None:
    """An image/video cache: sizes, residency, items per bucket, the fields items carry, items per latent shape."""
    print(f"size on disk: {human_size(info['bytes_on_disk'])}   data: {human_size(info['data_bytes'])}")
    if info["resident_bytes"] is not None:
        share = info["resident_bytes"] / info["data_bytes"] if info["data_bytes"] else 1.0
        print(f"in the page cache: {human_size(info['resident_bytes'])} ({share:.0%} of the data file)")
    if info["bucket_counts"]:
        print("items per bucket (pixels -> latent shape):")
        for entry in info["bucket_counts"][:40]:
            pixels, shape = "x".join(map(str, entry["bucket"])), "x".join(map(str, entry["latent_shape"]))
            print(f"  {pixels:>16} -> {shape:<18} {entry['items']:>9}")
    if info["item_fields"]:
        print(f"fields per item: {', '.join(info['item_fields'])}")
    print("items per latent shape:")
    for shape, count in info["shape_counts"][:40]:
        print(f"  {'x'.join(map(str, shape)):>20} {count:>9}")


def run_verify(args) -> int:
    from .store.opening import verify_cache

    try:
        with _remote_options(args) as remote:
            result = verify_cache(args.cache_dir, args.split, **remote)
    except CliError:
        raise
    except Exception as exc:  # noqa: BLE001 - corrupt, inconsistent or missing files: one line
        if os.environ.get("LATENTFAST_DEBUG"):
            raise
        print(f"verify FAILED: {error_text(args, exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        kind = "checksums, finiteness and index" if result["checksummed"] else "finiteness and index (this cache stores no checksums)"
        print(f"verify OK: {result['rows']} rows, {result['bytes']:,} bytes, {result['blocks']} blocks: "
              f"{kind} in {result['seconds']:.3f} s ({_verify_rate(args, result)})")
    return 0


def _verify_rate(args, result: dict) -> str:
    """What verify's rate measured: object storage (and the local chunk cache), or the disk / page cache."""
    from .remote.storage import is_remote

    if not is_remote(args.cache_dir):
        return f"{result['gb_per_s']:.2f} GB/s, from the page cache if the file was read recently"
    rate = f"{human_size(result['bytes'] / result['seconds'])}/s" if result["seconds"] > 0 else "too fast to time"
    where = f" or read from the local chunk cache {args.local_cache}" if args.local_cache else ""
    return f"{rate} verified, fetched from object storage{where}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="latentfast")
    add_cache_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
