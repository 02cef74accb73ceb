"""Small deterministic components that honor the real contracts, so every loop runs on a CPU.

They stand in for a frozen video VAE, the frozen feature encoders of a distribution loss, and a
trainable generator. Each is seeded from its constructor arguments; the same input gives
bit-identical output on CPU. They are the embedded default of the tests and the demo, never a
replacement for a real model: any object with the same methods plugs in instead.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


class ToyVAE(nn.Module):
    """Frozen stand-in for an f8 (spatial) / t4 (temporal) VAE, posterior mode only.

    ``encode(images [B, 3, H, W])`` -> ``[B, C, H/8, W/8]`` (the latent-cache protocol) and
    ``encode_video(clip [3, T, H, W] | [B, 3, T, H, W])`` -> ``[.., C, ceil(T/4), H/8, W/8]`` (rank
    preserved, as the vision path expects). Inputs are in [-1, 1]. The map is nonlinear and
    biased -- white paper does not encode to zeros -- which is why caches pad with the encoder's
    own white column rather than with zeros. H and W must be multiples of 8.
    """

    spatial_downscale = 8
    temporal_downscale = 4

    def __init__(self, latent_channels: int = 4, hidden: int = 16, seed: int = 0):
        super().__init__()
        self.latent_channels = int(latent_channels)
        self.hidden = int(hidden)
        self.seed = int(seed)
        g = _seeded(seed)
        s, t = self.spatial_downscale, self.temporal_downscale
        self.patch = nn.Parameter(torch.randn(hidden, 3, s, s, generator=g) / math.sqrt(3 * s * s))
        self.patch_bias = nn.Parameter(torch.randn(hidden, generator=g) * 0.1)
        self.time_mix = nn.Parameter(torch.randn(t, generator=g).softmax(0))
        self.proj = nn.Parameter(torch.randn(latent_channels, hidden, generator=g) / math.sqrt(hidden))
        self.proj_bias = nn.Parameter(torch.randn(latent_channels, generator=g) * 0.1)
        self.dec = nn.Parameter(torch.randn(3 * s * s, latent_channels, generator=g) / math.sqrt(latent_channels))
        self.requires_grad_(False)
        self.eval()

    def identity(self) -> dict:
        """What a cache stamps: a different identity means different latents."""
        return {
            "pretrained": f"latentfast.toy.ToyVAE(seed={self.seed},hidden={self.hidden})",
            "subfolder": "",
            "latent_channels": self.latent_channels,
            "downscale_factor": self.spatial_downscale,
        }

    def _check(self, x: torch.Tensor, ndim: tuple[int, ...], what: str) -> None:
        if x.ndim not in ndim:
            raise ValueError(f"{what} must be {'/'.join(f'{n}-D' for n in ndim)}, got shape {tuple(x.shape)}")
        if x.shape[-1] % self.spatial_downscale or x.shape[-2] % self.spatial_downscale:
            raise ValueError(f"{what} H and W must be multiples of 8, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{what} must be floating point in [-1, 1], got {x.dtype}")

    def _encode_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, C, H/8, W/8]: a non-overlapping 8x8 patch embedding (as a matmul,
        5x faster than the equivalent strided conv on CPU), tanh, then a channel projection."""
        N, _, H, W = frames.shape
        s = self.spatial_downscale
        patches = frames.reshape(N, 3, H // s, s, W // s, s).permute(0, 2, 4, 1, 3, 5).reshape(N, H // s, W // s, 3 * s * s)
        dtype = frames.dtype
        z = torch.tanh(patches @ self.patch.reshape(self.hidden, -1).to(dtype).T + self.patch_bias.to(dtype))
        z = z @ self.proj.to(dtype).T + self.proj_bias.to(dtype)
        return z.permute(0, 3, 1, 2).contiguous()

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images ``[B, 3, H, W]`` in [-1, 1] -> latents ``[B, C, H/8, W/8]`` (posterior mode)."""
        self._check(images, (4,), "images")
        if images.shape[1] != 3:
            raise ValueError(f"images must have 3 channels, got shape {tuple(images.shape)}")
        return self._encode_frames(images)

    @torch.no_grad()
    def encode_video(self, clip: torch.Tensor) -> torch.Tensor:
        """clip ``[3, T, H, W]`` or ``[B, 3, T, H, W]`` -> ``[.., C, ceil(T/4), H/8, W/8]``."""
        self._check(clip, (4, 5), "clip")
        batched = clip.unsqueeze(0) if clip.ndim == 4 else clip
        if batched.shape[1] != 3:
            raise ValueError(f"clip must have 3 channels, got shape {tuple(clip.shape)}")
        B, _, T, H, W = batched.shape
        t = self.temporal_downscale
        pad = (-T) % t
        if pad:  # causal-style: repeat the last frame up to a multiple of 4
            batched = torch.cat([batched, batched[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
        frames = batched.permute(0, 2, 1, 3, 4).reshape(-1, 3, H, W)
        z = self._encode_frames(frames).reshape(B, -1, t, self.latent_channels, H // 8, W // 8)
        z = torch.einsum("t,bktcyx->bckyx", self.time_mix.to(z.dtype), z)
        return z[0] if clip.ndim == 4 else z

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents ``[B, C, h, w]`` -> images ``[B, 3, 8h, 8w]`` in (-1, 1) (an approximate inverse)."""
        B, C, h, w = latents.shape
        s = self.spatial_downscale
        patches = torch.einsum("pc,bcyx->bpyx", self.dec.to(latents.dtype), latents)
        return torch.tanh(F.pixel_shuffle(patches.reshape(B, 3 * s * s, h, w), s))


class ToyFeatureEncoder(nn.Module):
    """Frozen stand-in for a pretrained feature encoder: clip -> ``[B, num_tokens, dim]`` features.

    ``clip [B, 3, T, H, W]`` is pooled to ``num_tokens`` spatio-temporal cells, each projected
    through a two-layer MLP. Differentiable w.r.t. its input (gradients flow to the generator);
    its own parameters are frozen.
    """

    def __init__(self, num_tokens: int = 8, dim: int = 16, hidden: int = 32, seed: int = 0):
        super().__init__()
        self.num_tokens, self.dim = int(num_tokens), int(dim)
        g = _seeded(seed + 1000)
        self.w1 = nn.Parameter(torch.randn(hidden, 3, generator=g))
        self.b1 = nn.Parameter(torch.randn(hidden, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(dim, hidden, generator=g) / math.sqrt(hidden))
        self.requires_grad_(False)

    @property
    def sample_shape(self) -> tuple[int, int]:
        return (self.num_tokens, self.dim)

    def forward(self, clip: torch.Tensor) -> torch.Tensor:
        if clip.ndim != 5 or clip.shape[1] != 3:
            raise ValueError(f"clip must be [B, 3, T, H, W], got shape {tuple(clip.shape)}")
        B = clip.shape[0]
        tokens = F.adaptive_avg_pool3d(clip, (1, 1, self.num_tokens)).reshape(B, 3, self.num_tokens)
        tokens = tokens + clip.mean(dim=(2, 3, 4))[:, :, None]  # a global term couples the tokens
        hidden = torch.tanh(torch.einsum("hc,bcn->bnh", self.w1.to(clip.dtype), tokens) + self.b1.to(clip.dtype))
        return hidden @ self.w2.to(clip.dtype).T


class ToyGenerator(nn.Module):
    """Trainable stand-in for a video generator: ``(noise [B, noise_dim], condition [B, cond_dim])``
    -> clip ``[B, 3, frames, height, width]`` in (-1, 1).

    An MLP with dropout between layers, so replaying a microbatch reproduces the collected
    forward only if the RNG state is restored. ``hidden`` and ``depth`` size the activations
    (the replay benchmark makes them dominate memory).
    """

    def __init__(
        self,
        noise_dim: int = 16,
        cond_dim: int = 8,
        hidden: int = 64,
        depth: int = 2,
        frames: int = 4,
        height: int = 8,
        width: int = 8,
        dropout: float = 0.1,
        seed: int = 0,
    ):
        super().__init__()
        self.noise_dim, self.cond_dim = int(noise_dim), int(cond_dim)
        self.out_shape = (3, int(frames), int(height), int(width))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = [nn.Linear(noise_dim + cond_dim, hidden), nn.GELU(), nn.Dropout(dropout)]
            for _ in range(depth - 1):
                layers += [nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout)]
            layers.append(nn.Linear(hidden, math.prod(self.out_shape)))
            self.net = nn.Sequential(*layers)

    def forward(self, noise: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        if noise.ndim != 2 or noise.shape[1] != self.noise_dim:
            raise ValueError(f"noise must be [B, {self.noise_dim}], got shape {tuple(noise.shape)}")
        if condition.shape != (noise.shape[0], self.cond_dim):
            raise ValueError(f"condition must be [{noise.shape[0]}, {self.cond_dim}], got shape {tuple(condition.shape)}")
        out = self.net(torch.cat([noise, condition], dim=1))
        return torch.tanh(out).reshape(noise.shape[0], *self.out_shape)
