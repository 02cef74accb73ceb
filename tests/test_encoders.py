"""latentfast.encoders.DiffusersVAE on tiny random-weight diffusers VAEs built from small configs (no
downloads): shapes, the normalization each pipeline applies (checked against the raw posterior),
mode vs seeded sample, identity (a different VAE, other weights, another dtype differ)."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from latentfast.encoders import DiffusersVAE, load_diffusers_vae  # noqa: E402

MEAN, STD = [0.1, -0.2, 0.3, 0.05], [1.0, 2.0, 0.5, 4.0]


def tiny_kl(seed=0, **config):
    torch.manual_seed(seed)
    return diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                   layers_per_block=1, **config)


def tiny_wan(seed=0, cls="AutoencoderKLWan"):
    torch.manual_seed(seed)
    return getattr(diffusers, cls)(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[False, True], latents_mean=MEAN, latents_std=STD)


def tiny_hunyuan(seed=0):
    torch.manual_seed(seed)
    return diffusers.AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 16, 16), latent_channels=4, norm_num_groups=4,
                                               layers_per_block=1, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                               up_block_types=("HunyuanVideoUpBlock3D",) * 4)


def pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("config, expect", [
    ({}, lambda z: z * 0.18215),  # SD 1.x/2.x
    ({"shift_factor": 0.1159, "scaling_factor": 0.3611}, lambda z: (z - 0.1159) * 0.3611),  # SD3 / Flux
    ({"latents_mean": MEAN, "latents_std": STD, "scaling_factor": 0.5},  # SDXL-family with mean/std
     lambda z: (z - torch.tensor(MEAN).view(1, 4, 1, 1)) * 0.5 / torch.tensor(STD).view(1, 4, 1, 1)),
])
def test_autoencoder_kl_normalization(config, expect):
    vae = tiny_kl(**config)
    encoder = DiffusersVAE(vae)
    x = pixels(2, 3, 16, 24)
    raw = vae.encode(x).latent_dist.mode()
    z = encoder.encode(x)
    assert z.dtype == torch.float32 and tuple(z.shape) == (2, 4, 8, 12)
    torch.testing.assert_close(z, expect(raw), rtol=0, atol=1e-6)
    assert (encoder.spatial_downscale, encoder.temporal_downscale, encoder.latent_channels) == (2, 1, 4)
    clip = pixels(2, 3, 3, 16, 24, seed=1)  # an image VAE encodes each frame of a clip
    video = encoder.encode_video(clip)
    assert tuple(video.shape) == (2, 4, 3, 8, 12)
    torch.testing.assert_close(video[:, :, 1], encoder.encode(clip[:, :, 1]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("cls", ["AutoencoderKLWan", "AutoencoderKLQwenImage"])
def test_wan_and_qwen_normalize_with_mean_and_std(cls):
    vae = tiny_wan(cls=cls)
    encoder = DiffusersVAE(vae)
    x = pixels(2, 3, 16, 16)
    raw = vae.encode(x.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    want = (raw - torch.tensor(MEAN).view(1, 4, 1, 1)) / torch.tensor(STD).view(1, 4, 1, 1)
    torch.testing.assert_close(encoder.encode(x), want, rtol=0, atol=1e-6)
    assert encoder.spatial_downscale == 4
    if cls == "AutoencoderKLWan":
        assert tuple(encoder.encode_video(pixels(1, 3, 5, 16, 16)).shape) == (1, 4, 3, 4, 4)  # 1 + (5-1)/2 frames


def test_hunyuan_video_scales():
    vae = tiny_hunyuan()
    encoder = DiffusersVAE(vae)
    clip = pixels(1, 3, 5, 16, 16)
    raw = vae.encode(clip).latent_dist.mode()
    torch.testing.assert_close(encoder.encode_video(clip), raw * vae.config.scaling_factor, rtol=0, atol=1e-6)


def test_mode_and_seeded_sample():
    vae = tiny_kl()
    x = pixels(3, 3, 16, 16)
    mode = DiffusersVAE(vae).encode(x)
    sampler = DiffusersVAE(vae, sample="sample", seed=7)
    a = sampler.encode(x, seeds=[1, 2, 3])
    b = sampler.encode(x, seeds=[1, 2, 3])
    assert torch.equal(a, b) and not torch.allclose(a, mode)
    dist = vae.encode(x).latent_dist
    noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)])
    torch.testing.assert_close(a, (dist.mean + dist.std * noise) * 0.18215, rtol=0, atol=1e-6)
    # per-item seeds: an item's draw does not depend on its batch
    torch.testing.assert_close(sampler.encode(x[1:2], seeds=[2]), a[1:2], rtol=0, atol=1e-5)
    assert not torch.equal(DiffusersVAE(vae, sample="sample", seed=7).encode(x), DiffusersVAE(vae, sample="sample", seed=8).encode(x))


def test_identity_tells_vaes_apart():
    base = DiffusersVAE(tiny_kl(seed=0)).identity()
    assert base == DiffusersVAE(tiny_kl(seed=0)).identity()
    assert base["class"] == "diffusers.AutoencoderKL" and base["downscale_factor"] == 2 and base["latent_channels"] == 4
    assert base["normalization"] == {"scaling_factor": 0.18215, "shift_factor": 0.0}
    assert DiffusersVAE(tiny_kl(seed=1)).identity()["weights_blake2b"] != base["weights_blake2b"]  # other weights
    assert DiffusersVAE(tiny_kl(seed=0).to(torch.bfloat16)).identity()["weights_blake2b"] != base["weights_blake2b"]
    assert DiffusersVAE(tiny_kl(seed=0, scaling_factor=0.13)).identity()["config"] != base["config"]
    assert DiffusersVAE(tiny_kl(seed=0), sample="sample").identity()["sample"] == "sample"
    assert DiffusersVAE(tiny_wan()).identity()["class"] == "diffusers.AutoencoderKLWan"


def test_bad_arguments():
    with pytest.raises(TypeError, match="diffusers AutoencoderKL"):
        DiffusersVAE(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sample must be one of"):
        DiffusersVAE(tiny_kl(), sample="mean")
    encoder = DiffusersVAE(tiny_kl())
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        encoder.encode(pixels(2, 3, 1, 16, 16))
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        encoder.encode_video(pixels(2, 3, 16, 16))
    with pytest.raises(ValueError, match="floating point"):
        encoder.encode(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))


def test_load_from_a_saved_folder(tmp_path):
    vae = tiny_kl(seed=3)
    vae.save_pretrained(str(tmp_path / "model" / "vae"))
    loaded = load_diffusers_vae(str(tmp_path / "model"))  # the vae/ subfolder is found
    assert loaded.identity() == DiffusersVAE(vae).identity()
    explicit = load_diffusers_vae(f"AutoencoderKL:{tmp_path / 'model' / 'vae'}")
    assert explicit.identity()["weights_blake2b"] == loaded.identity()["weights_blake2b"]
    with pytest.raises(ValueError, match="config.json"):
        load_diffusers_vae(str(tmp_path / "nowhere"))
