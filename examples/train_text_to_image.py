"""Train a tiny text-to-image diffusion model from a latentfast cache of latents and caption embeddings.

What a fine-tuning script does with latentfast: encode every image (its VAE posterior, its mirror)
and every caption (the text encoder) once into one cache, then train from it: a DataLoader with
workers reads whole batches (a fresh draw of each latent's posterior, a seeded flip, the caption
embeddings padded to the tokenizer's length), and ``DevicePrefetcher`` overlaps the next batch's copy
with the step. ``--encode-on-the-fly`` is the baseline without a cache: a DataLoader decodes the
images, and every step runs the VAE and the text encoder before the denoiser.

The models are diffusers / transformers classes with tiny configs and random weights (no
downloads): an ``AutoencoderKL``, a ``CLIPTextModel`` with an in-memory tokenizer and a
``UNet2DConditionModel`` conditioned on the caption embeddings. Swap in yours. Run it:

    python examples/train_text_to_image.py --steps 20
    python examples/train_text_to_image.py --steps 20 --encode-on-the-fly

Each run prints its median step time and the share of the step spent waiting for data.
"""
from __future__ import annotations

import argparse
import os
import statistics
import string
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

SIZE = 16  # pixels; the tiny VAE's latents are SIZE / 2
MAX_TOKENS = 16
WORDS = ["a", "cat", "dog", "red", "blue", "small", "photo", "of", "the", "zebra"]


def tiny_models(seed: int = 0):
    """``(vae, text_model, tokenizer, unet)`` with tiny configs and random weights."""
    import diffusers
    import transformers

    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                  layers_per_block=1)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase:
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    tokenizer = transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=MAX_TOKENS)
    text_model = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    unet = diffusers.UNet2DConditionModel(
        sample_size=SIZE // 2, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, time_embedding_dim=32)
    return vae, text_model, tokenizer, unet


def make_dataset(folder: str, n: int, seed: int = 0) -> None:
    """``n`` random images with a caption file each (``<stem>.txt``, the kohya / SimpleTuner / ai-toolkit
    convention); captions repeat, as in a class-prompt dataset."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i:04d}.png"))
        with open(os.path.join(folder, f"{i:04d}.txt"), "w", encoding="utf-8") as fh:
            fh.write(" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 4)) if i % 3 else "a photo of a cat")


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
    from latentfast.cache import DevicePrefetcher, LatentCache, ShapeBucketBatchSampler, batch_loader
    from latentfast.cache.builders.images import build_image_cache

    # --8<-- [start:cache-loop]
    # once: each image's VAE posterior (mean, std) and its mirror's, each caption's embedding (from <stem>.txt)
    build_image_cache(vae, args.images, args.cache, buckets=[(SIZE, SIZE)], batch_size=16, quiet=True, flip=True,
                      text_encoder=text_encoder)
    cache = LatentCache(args.cache)
    # every step: a fresh posterior draw and a seeded flip per item, the captions padded to the tokenizer's length
    sampler = ShapeBucketBatchSampler(cache.shapes, args.batch_size, seed=0, drop_last=True)
    loader = batch_loader(cache, sampler, fields=("latent", "text"), pad={"text": 0.0}, pad_to=MAX_TOKENS,
                          sample=True, flip=0.5, seed=0, num_workers=args.workers, pin_memory=device.type == "cuda")
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        loader.dataset.set_epoch(epoch)
        for batch in DevicePrefetcher(loader, device):
            lengths = batch["text_shape"][:, 0].to(device)
            mask = torch.arange(MAX_TOKENS, device=device)[None, :] < lengths[:, None]
            yield batch["latent"].float(), batch["text"].float(), mask
        epoch += 1
    # --8<-- [end:cache-loop]


def on_the_fly_batches(args, vae, text_encoder, device):
    """The baseline: images decoded by a DataLoader, the VAE and the text encoder run every step."""
    from torch.utils.data import DataLoader, Dataset

    from latentfast.cache.captions import Captions
    from latentfast.cache.builders import media

    class Images(Dataset):
        def __init__(self, folder):
            self.entries = media.list_items(folder, video=False)
            self.captions = Captions()

        def __len__(self):
            return len(self.entries)

        def __getitem__(self, i):
            key, path = self.entries[i]
            item = media.Item(key, path, width=SIZE, height=SIZE, bucket=(SIZE, SIZE))
            pixels = torch.from_numpy(media.load_image(item)[0]).permute(2, 0, 1)  # uint8 [3, h, w]
            return pixels, self.captions(key, path)

    loader = DataLoader(Images(args.images), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    while True:
        for pixels, captions in loader:
            flip = torch.rand(pixels.shape[0]) < 0.5
            pixels = torch.where(flip[:, None, None, None], pixels.flip(-1), pixels).to(device).float() / 127.5 - 1
            with torch.no_grad():
                latents = vae.vae.encode(pixels).latent_dist.sample() * vae.vae.config.scaling_factor
                encoded = text_encoder.encode(list(captions))
            text = torch.zeros(len(captions), MAX_TOKENS, encoded.embeds[0].shape[-1], device=device)
            for b, e in enumerate(encoded.embeds):
                text[b, : e.shape[0]] = e
            mask = torch.arange(MAX_TOKENS, device=device)[None, :] < torch.tensor(encoded.lengths, device=device)[:, None]
            yield latents, text, mask


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--images", type=int, default=64, help="synthetic images (with captions) to train on")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--workdir", default=None, help="where the images and the cache go (default: a temp dir)")
    parser.add_argument("--encode-on-the-fly", action="store_true", help="the baseline: run the VAE and text encoder every step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the training process")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from diffusers import DDPMScheduler

    from latentfast.encoders import DiffusersVAE, TextEncoder

    device = torch.device(args.device)
    workdir = args.workdir or tempfile.mkdtemp(prefix="latentfast-t2i-")
    count, args.images, args.cache = args.images, os.path.join(workdir, "images"), os.path.join(workdir, "cache")
    if not os.path.isdir(args.images):
        make_dataset(args.images, count)
    vae_model, text_model, tokenizer, unet = tiny_models()
    vae = DiffusersVAE(vae_model, sample="store").to(device)
    text_encoder = TextEncoder(text_model.to(device), tokenizer)
    unet.to(device).train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    mode = "on the fly" if args.encode_on_the_fly else "from the cache"
    batches = (on_the_fly_batches if args.encode_on_the_fly else cached_batches)(args, vae, text_encoder, device)
    steps, waits = [], []
    for step in range(args.steps + 1):  # step 0 warms up (workers start, first batches) and is not counted
        t0 = time.perf_counter()
        latents, text, mask = next(batches)  # with the baseline, this includes the encoders' time
        t1 = time.perf_counter()
        loss = train_step(unet, optimizer, scheduler, latents, text, mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            steps.append(time.perf_counter() - t0)
            waits.append(t1 - t0)
    batches.close()
    step_ms = statistics.median(steps) * 1e3
    share = sum(waits) / sum(steps)
    print(f"{mode}: {args.steps} steps of {args.batch_size}, median step {step_ms:.1f} ms, "
          f"{100 * share:.0f}% of the step waiting for data (loss {loss:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
