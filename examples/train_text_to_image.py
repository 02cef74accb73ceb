"""Train a text-to-image diffusion model from a latentfast cache of latents and caption embeddings.

What a fine-tuning script does with latentfast: encode every image (its VAE posterior, its mirror)
and every caption (the text encoder) once into one cache, then train from it: a ``LatentLoader``
with workers reads whole batches into reused buffers (a fresh draw of each latent's posterior, a
seeded flip, the caption embeddings padded to the tokenizer's length), and ``DevicePrefetcher``
overlaps the next batch's copy with the step. ``--encode-on-the-fly`` is the baseline without a cache: a DataLoader decodes the
images, and every step runs the VAE and the text encoder before the denoiser.

The encoders cost what Stable Diffusion's do: an ``AutoencoderKL`` of the SD VAE's config
(block_out_channels 128, 256, 512, 512; 4 latent channels) at 256 px and a ``CLIPTextModel`` of
CLIP-L's text config (768 wide, 12 layers, 12 heads, 77 tokens), with random weights built here (no
downloads; the tokenizer is a letter-level CLIP tokenizer with an in-memory vocabulary, and CLIP runs
on all 77 padded tokens as a pipeline does, so its cost is a real tokenizer's). The denoiser is a
small ``UNet2DConditionModel`` (4.6M parameters) conditioned on the caption embeddings: swap in
yours, and the cache saves the encoders' time per step beside your denoiser's. ``--tiny`` takes
tiny models at 16 px instead (for tests).

``--images DIR``: a folder of images, each with a caption file beside it (``cat.png``, ``cat.txt``);
without it a small folder of drawn shapes and their captions is generated. Run it:

    python examples/train_text_to_image.py --steps 20
    python examples/train_text_to_image.py --steps 20 --encode-on-the-fly
    python examples/train_text_to_image.py --images DIR --compare 3 --steps 3   # both, alternating, 3 runs each

Each run prints its median step time and the share of the step spent waiting for data; ``--compare``
also prints the ratio of the two modes' step times (median and range over the runs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import string
import sys
import tempfile
import time

import diffusers
import numpy as np
import torch
import torch.nn.functional as F
import transformers
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

from latentfast.cache import DevicePrefetcher, LatentCache, LatentLoader
from latentfast.cache.builders import media
from latentfast.cache.builders.images import build_image_cache
from latentfast.cache.captions import Captions
from latentfast.encoders import DiffusersVAE, TextEncoder

COLORS = {"red": (200, 30, 30), "green": (40, 160, 60), "blue": (40, 70, 200), "yellow": (230, 200, 40),
          "white": (240, 240, 240), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")


def clip_tokenizer(max_tokens: int):
    """A CLIP tokenizer with an in-memory letter-level vocabulary (no download, no merges)."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase:
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_tokens)


def encoders(tiny: bool, seed: int = 0):
    """``(vae, text_model, tokenizer)`` with random weights: SD's VAE and CLIP-L's text model, or tiny ones."""
    torch.manual_seed(seed)
    if tiny:
        vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                      up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                      layers_per_block=1)
        text = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16)
    else:  # the configs of runwayml/stable-diffusion-v1-5's vae/ and text_encoder/ (CLIP ViT-L/14's text tower)
        vae = diffusers.AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                                      up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=32,
                                      layers_per_block=2, sample_size=512)
        text = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    max_position_embeddings=77, hidden_act="quick_gelu", vocab_size=49408)
    tokenizer = clip_tokenizer(text["max_position_embeddings"])
    text_model = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        **{"vocab_size": len(tokenizer), **text}, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    return vae, text_model, tokenizer


def denoiser(tiny: bool, size: int, text_dim: int, seed: int = 0):
    """A small ``UNet2DConditionModel`` on the latents of ``size`` px images (a fresh one per run)."""
    torch.manual_seed(seed)
    if tiny:
        return diffusers.UNet2DConditionModel(
            sample_size=size // 2, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=text_dim, attention_head_dim=8, norm_num_groups=8, time_embedding_dim=32)
    return diffusers.UNet2DConditionModel(  # cross-attention at 1/16 of the image only: small on a CPU
        sample_size=size // 8, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=text_dim, attention_head_dim=8, norm_num_groups=32)


def make_dataset(folder: str, n: int, size: int, seed: int = 0) -> None:
    """``n`` images of a shape on a background, a caption file each (``<stem>.txt``, the kohya /
    SimpleTuner / ai-toolkit convention) saying what is drawn; some are wider or taller than ``size``
    (resized and centre-cropped like any), and captions repeat, as in a class-prompt dataset."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    names = list(COLORS)
    for i in range(n):
        w, h = [(size, size), (size * 5 // 4, size), (size, size * 3 // 2)][i % 3]
        shape, color, ground = SHAPES[rng.integers(3)], *rng.choice(names, 2, replace=False)
        image = Image.new("RGB", (w, h), COLORS[ground])
        r = int(rng.integers(size // 6, size // 3))
        x, y = int(rng.integers(r, w - r)), int(rng.integers(r, h - r))
        box = (x - r, y - r, x + r, y + r)
        draw = ImageDraw.Draw(image)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLORS[color])
        pixels = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3))  # some texture, as a photo has
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:04d}.png"))
        with open(os.path.join(folder, f"{i:04d}.txt"), "w", encoding="utf-8") as fh:
            fh.write(f"a {color} {shape} on a {ground} background")


def train_step(unet, optimizer, scheduler, latents, text, mask):
    """One denoising step: noise the latents at random timesteps, predict the noise, step the optimizer."""
    noise = torch.randn_like(latents)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    noisy = scheduler.add_noise(latents, noise, t)
    pred = unet(noisy, t, encoder_hidden_states=text, encoder_attention_mask=mask).sample
    loss = F.mse_loss(pred.float(), noise.float())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def cached_batches(args, vae, text_encoder, device):
    """Build (or reuse) the cache, then yield ``(latents, text, mask)`` on ``device`` from its loader."""
    # --8<-- [start:cache-loop]
    # once: each image's VAE posterior (mean, std) and its mirror's, each caption's embedding (from <stem>.txt)
    build_image_cache(vae, args.images, args.cache, buckets=[(args.size, args.size)], batch_size=8, quiet=True,
                      flip=True, text_encoder=text_encoder)
    cache = LatentCache(args.cache)
    # every step: a fresh posterior draw and a seeded flip per item, the captions padded to the tokenizer's length
    loader = LatentLoader(cache, args.batch_size, fields=("latent", "text"), pad={"text": 0.0}, pad_to=args.max_tokens,
                          sample=True, flip=0.5, drop_last=True, num_workers=args.workers, pin_memory=device.type == "cuda")
    epoch = 0
    while True:
        loader.set_epoch(epoch)  # the batches of an epoch: its order, draws and flips
        for batch in DevicePrefetcher(loader, device):
            lengths = batch["text_shape"][:, 0].to(device)
            mask = torch.arange(args.max_tokens, device=device)[None, :] < lengths[:, None]
            yield batch["latent"].float(), batch["text"].float(), mask
        epoch += 1
    # --8<-- [end:cache-loop]


def on_the_fly_batches(args, vae, text_encoder, device):
    """The baseline: images decoded by a DataLoader, the VAE and the text encoder run every step."""
    class Images(Dataset):
        def __init__(self, folder):
            self.items = [media.probe(key, path) for key, path in media.list_items(folder, video=False)]
            for item in self.items:  # decoded as the cache build decodes it (resize, crop, JPEG draft)
                item.bucket = (args.size, args.size)
                item.draft = media.plan_draft(item)
            self.captions = Captions()

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            item = self.items[i]
            pixels = torch.tensor(media.load_image(item)[0]).permute(2, 0, 1)  # uint8 [3, h, w] (a copy: the array is read-only)
            return pixels, self.captions(item.key, item.path)

    loader = DataLoader(Images(args.images), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    while True:
        for pixels, captions in loader:
            flip = torch.rand(pixels.shape[0]) < 0.5
            pixels = torch.where(flip[:, None, None, None], pixels.flip(-1), pixels).to(device).float() / 127.5 - 1
            with torch.no_grad():
                latents = vae.vae.encode(pixels).latent_dist.sample() * vae.vae.config.scaling_factor
                encoded = text_encoder.encode(list(captions))
            text = torch.zeros(len(captions), args.max_tokens, encoded.embeds[0].shape[-1], device=device)
            for b, e in enumerate(encoded.embeds):
                text[b, : e.shape[0]] = e
            lengths = torch.tensor(encoded.lengths, device=device)
            yield latents, text, torch.arange(args.max_tokens, device=device)[None, :] < lengths[:, None]


def train(args, vae, text_encoder, device, on_the_fly: bool) -> float:
    """Train a fresh denoiser ``args.steps`` steps (after one warm-up step); prints and returns the median step (ms)."""
    unet = denoiser(args.tiny, args.size, text_encoder.model.config.hidden_size).to(device).train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
    batches = (on_the_fly_batches if on_the_fly else cached_batches)(args, vae, text_encoder, device)
    steps, waits = [], []
    for step in range(args.steps + 1):  # step 0 warms up (the cache build or open, workers start) and is not counted
        t0 = time.perf_counter()
        latents, text, mask = next(batches)  # with the baseline, this includes the encoders' time
        t1 = time.perf_counter()
        loss = train_step(unet, optimizer, scheduler, latents, text, mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            steps.append(time.perf_counter() - t0)
            waits.append(t1 - t0)
        else:
            first = time.perf_counter() - t0
    batches.close()
    step_ms = statistics.median(steps) * 1e3
    print(f"{'on the fly' if on_the_fly else 'from the cache'}: {args.steps} steps of {args.batch_size}, median step "
          f"{step_ms:.1f} ms, {100 * sum(waits) / sum(steps):.0f}% of the step waiting for data (loss {loss:.4f}); first step "
          f"{first:.1f} s{'' if on_the_fly else ' (builds the cache, or opens it once built)'}", flush=True)
    return step_ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", default=None, help="a folder of images with a caption file (<stem>.txt) each "
                                                        "(default: --count generated ones)")
    parser.add_argument("--count", type=int, default=16, help="images to generate when --images is not given "
                                                                "(those of an earlier run in --workdir are reused)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--workdir", default=None, help="where the generated images and the cache go (default: a temp dir)")
    parser.add_argument("--encode-on-the-fly", action="store_true", help="the baseline: run the VAE and text encoder every step")
    parser.add_argument("--compare", type=int, default=0, metavar="RUNS",
                        help="run both modes, alternating, RUNS times each, and print the ratio of their step times")
    parser.add_argument("--tiny", action="store_true", help="tiny models at 16 px (for tests) instead of SD's VAE and CLIP-L at 256 px")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the training process")
    args = parser.parse_args(argv)
    if args.images is not None and not os.path.isdir(args.images):
        parser.error(f"--images: expected a folder of images with a caption file (<stem>.txt) each, got {args.images!r}, "
                     "which is not a folder (without --images, --count N images are generated)")
    if args.batch_size < 1 or args.steps < 1 or args.compare < 0:
        parser.error(f"expected --batch-size >= 1, --steps >= 1 and --compare >= 0; got --batch-size {args.batch_size}, "
                     f"--steps {args.steps}, --compare {args.compare}")
    found = len(media.list_items(args.images, video=False)) if args.images else args.count
    if found < args.batch_size:  # drop_last: no batch at all
        parser.error(f"--batch-size {args.batch_size}: expected at most as many images, and "
                     f"{f'--images {args.images} has' if args.images else '--count is'} {found}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.size = 16 if args.tiny else 256
    workdir = args.workdir or tempfile.mkdtemp(prefix="latentfast-t2i-")
    args.cache = os.path.join(workdir, "cache-tiny" if args.tiny else "cache")
    if args.images is None:
        args.images = os.path.join(workdir, "images-tiny" if args.tiny else "images")
        if not os.path.isdir(args.images):
            make_dataset(args.images, args.count, args.size)
    vae_model, text_model, tokenizer = encoders(args.tiny)
    args.max_tokens = tokenizer.model_max_length
    vae = DiffusersVAE(vae_model, sample="store").to(device)
    text_encoder = TextEncoder(text_model.to(device), tokenizer)
    if not args.compare:
        train(args, vae, text_encoder, device, on_the_fly=args.encode_on_the_fly)
        return 0
    times = {False: [], True: []}
    for _ in range(args.compare):  # alternating, so the load of a shared machine falls on both alike
        for on_the_fly in (False, True):
            times[on_the_fly].append(train(args, vae, text_encoder, device, on_the_fly))
    ratios = [fly / cached for cached, fly in zip(times[False], times[True])]
    print(f"on the fly / from the cache: {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}) "
          f"over {args.compare} runs of {args.steps} steps of {args.batch_size} at {args.size} px on {device.type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
