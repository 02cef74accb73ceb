"""Encode units, normalize, regroup and the local VisionEncoder path (single process)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from latentfast import ops, reference
from latentfast.errors import ArgumentTypeError, InvalidArgumentError
from latentfast.toy import ToyVAE
from latentfast.vision import (
    BalanceGroup,
    EncodeCostModel,
    VisionEncodeUnit,
    VisionEncoder,
    build_units,
    normalize_uint8_item,
    regroup_latents,
    vae_pixel_shapes,
    validate_multiview_length,
)


def pixels(*shape, seed=0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def expected_normalized(x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The package's pure-torch reference of the fused normalize."""
    out = torch.empty(x.shape, dtype=dtype)
    reference.normalize_uint8_into(x, [out])
    return out


# ---- shapes, normalize, validation -------------------------------------------------------------


def test_vae_pixel_shapes_reads_t_h_w_and_skips_none():
    items = [torch.zeros(3, 5, 16, 24), None, torch.zeros(2, 3, 7, 8, 32)]
    assert vae_pixel_shapes(items) == [(5, 16, 24), (7, 8, 32)]
    assert vae_pixel_shapes(None) == []
    assert vae_pixel_shapes([]) == []


@pytest.mark.parametrize("shape", [(3, 16, 16), (1, 2, 3, 4, 16, 16)])
def test_vae_pixel_shapes_rejects_other_ranks(shape):
    with pytest.raises(ValueError, match=str(shape).replace("(", r"\(").replace(")", r"\)")):
        vae_pixel_shapes([torch.zeros(shape)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_normalize_uint8_item_maps_to_minus_one_one(dtype):
    x = pixels(3, 5, 8, 9)
    x[0, 0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    out = normalize_uint8_item(x, dtype=dtype)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected_normalized(x, dtype), rtol=0, atol=0)
    torch.testing.assert_close(out.double(), x.double() / 127.5 - 1, rtol=0, atol={torch.float32: 1e-7, torch.bfloat16: 4e-3, torch.float16: 5e-4}[dtype])
    assert out[0, 0, 0, 0] == -1 and out[0, 0, 0, 1] == 1


def test_normalize_uint8_item_rejects_float():
    with pytest.raises(ValueError, match="uint8"):
        normalize_uint8_item(torch.zeros(3, 4, 8, 8))


def test_validate_multiview_length():
    validate_multiview_length(torch.zeros(3, 12, 8, 8), num_views=3, frames_per_view=4)
    validate_multiview_length(torch.zeros(2, 3, 12, 8, 8), num_views=4, frames_per_view=3)
    with pytest.raises(ValueError, match="T=12, num_views=5, frames_per_view=2"):
        validate_multiview_length(torch.zeros(3, 12, 8, 8), num_views=5, frames_per_view=2)
    with pytest.raises(ValueError, match="num_views"):
        validate_multiview_length(torch.zeros(3, 12, 8, 8), num_views=0, frames_per_view=2)


# ---- build_units ------------------------------------------------------------------------------


def test_plain_item_is_one_unit_holding_the_tensor_unchanged():
    item = torch.rand(3, 4, 16, 16)
    (unit,) = build_units([item], [1], [None])
    assert unit == VisionEncodeUnit(0, item) and unit.tensor is item
    with pytest.raises(dataclasses_frozen_error()):
        unit.item_index = 1  # frozen


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_plain_item_with_several_views_needs_frames():
    with pytest.raises(ValueError, match="frames_per_item\\[0\\] is required"):
        build_units([pixels(3, 8, 8, 8)], [2], [None])


@pytest.mark.parametrize("batched", [False, True])
def test_multiview_item_becomes_one_normalized_unit_per_view(batched):
    item = pixels(2, 3, 12, 8, 16) if batched else pixels(3, 12, 8, 16)
    units = build_units([item], [3], [4])
    time_axis = item.ndim - 3
    assert [u.item_index for u in units] == [0, 0, 0]
    for view, unit in enumerate(units):
        assert unit.tensor.dtype == torch.float32 and unit.tensor.is_contiguous()
        torch.testing.assert_close(unit.tensor, expected_normalized(item.narrow(time_axis, 4 * view, 4)), rtol=0, atol=0)


def test_multiview_split_is_one_fused_pass_per_item(monkeypatch):
    calls = []
    real = ops.normalize_uint8

    def counting(x, **kwargs):
        calls.append(kwargs.get("num_views", 1))
        return real(x, **kwargs)

    monkeypatch.setattr(ops, "normalize_uint8", counting)
    build_units([pixels(3, 8, 8, 8), torch.rand(3, 4, 8, 8), pixels(3, 6, 8, 8)], [4, 1, 3], [2, None, 2])
    assert calls == [4, 3]


def test_single_view_with_frames_is_normalized():
    item = pixels(3, 4, 8, 8)
    (unit,) = build_units([item], [1], [4])
    torch.testing.assert_close(unit.tensor, expected_normalized(item), rtol=0, atol=0)


def test_build_units_dtype_and_length_checks():
    units = build_units([pixels(3, 4, 8, 8)], [2], [2], dtype=torch.bfloat16)
    assert all(u.tensor.dtype == torch.bfloat16 for u in units)
    with pytest.raises(ValueError, match="same length"):
        build_units([pixels(3, 4, 8, 8)], [2, 1], [2])
    with pytest.raises(ValueError, match="items\\[1\\] is None"):
        build_units([pixels(3, 4, 8, 8), None], [1, 1], [None, None])
    with pytest.raises(ValueError, match="T=4, num_views=3"):
        build_units([pixels(3, 4, 8, 8)], [3], [2])
    with pytest.raises(ValueError, match="uint8"):
        build_units([torch.rand(3, 4, 8, 8)], [2], [2])


def test_mixed_multi_item_batch_keeps_item_order():
    items = [torch.rand(3, 4, 8, 8), pixels(3, 6, 8, 8), torch.rand(2, 3, 4, 8, 8), pixels(2, 3, 4, 8, 8)]
    units = build_units(items, [1, 3, 1, 2], [None, 2, None, 2])
    assert [u.item_index for u in units] == [0, 1, 1, 1, 2, 3, 3]
    assert units[0].tensor is items[0] and units[4].tensor is items[2]
    assert units[5].tensor.shape == (2, 3, 2, 8, 8)


# ---- regroup ---------------------------------------------------------------------------------


def test_regroup_concatenates_views_camera_major_on_the_items_time_axis():
    items = [torch.zeros(3, 6, 8, 8), torch.zeros(3, 4, 8, 8), torch.zeros(2, 3, 4, 8, 8)]
    units = [VisionEncodeUnit(0, None), VisionEncodeUnit(0, None), VisionEncodeUnit(0, None), VisionEncodeUnit(1, None),
             VisionEncodeUnit(2, None), VisionEncodeUnit(2, None)]  # fmt: skip
    latents = [torch.full((4, 1, 2, 2), 10.0 + v) for v in range(3)]
    latents += [torch.full((4, 1, 2, 2), 20.0)]
    latents += [torch.full((2, 4, 1, 2, 2), 30.0 + v) for v in range(2)]
    out = regroup_latents(units, latents, items)
    assert out[0].shape == (4, 3, 2, 2) and out[0][0, :, 0, 0].tolist() == [10.0, 11.0, 12.0]
    assert out[1] is latents[3]
    assert out[2].shape == (2, 4, 2, 2, 2) and out[2][1, 0, :, 0, 0].tolist() == [30.0, 31.0]


def test_regroup_errors():
    items = [torch.zeros(3, 4, 8, 8)] * 2
    with pytest.raises(ValueError, match="2 latents for 1 units"):
        regroup_latents([VisionEncodeUnit(0, None)], [torch.zeros(1)] * 2, items)
    with pytest.raises(ValueError, match="items\\[1\\] has no encoded unit"):
        regroup_latents([VisionEncodeUnit(0, None)], [torch.zeros(1)], items)
    with pytest.raises(ValueError, match="out of range"):
        regroup_latents([VisionEncodeUnit(5, None)], [torch.zeros(1)], items)


# ---- VisionEncoder, local path ---------------------------------------------------------------


def make_encoder(vae=None, **kwargs) -> VisionEncoder:
    vae = vae or ToyVAE()
    defaults = dict(cost_model=None, parallel_dims=None, encode_fn=vae.encode_video, device="cpu")
    defaults.update(kwargs)
    return VisionEncoder(**defaults)


@pytest.mark.parametrize("batched", [False, True])
def test_units_encoded_and_regrouped_equal_per_item_local_encoding(batched):
    vae = ToyVAE()
    encoder = make_encoder(vae)
    lead = (2,) if batched else ()
    items = [pixels(*lead, 3, 12, 16, 8, seed=1), (torch.rand(*lead, 3, 5, 8, 16) * 2 - 1), pixels(*lead, 3, 4, 8, 8, seed=2)]
    views, frames = [3, 1, 2], [4, None, 2]
    units = build_units(items, views, frames)
    regrouped = regroup_latents(units, [vae.encode_video(u.tensor).contiguous().float() for u in units], items)
    local = encoder.encode_local(items, views, frames)
    for got, want in zip(regrouped, local):
        assert torch.equal(got, want)
    assert local[0].shape == (*lead, 4, 3, 2, 1)  # three views of ceil(4/4) latent frames each
    assert torch.equal(local[1], vae.encode_video(items[1]))


def test_encode_item_normalizes_one_view_at_a_time(monkeypatch):
    seen = []
    encoder = make_encoder(encode_fn=lambda x: (seen.append(tuple(x.shape)), x.mean(dim=(-1, -2), keepdim=True))[1])
    item = pixels(3, 12, 8, 8)
    out = encoder.encode_item(item, 3, 4)
    assert seen == [(3, 4, 8, 8)] * 3
    torch.testing.assert_close(out, expected_normalized(item).mean(dim=(-1, -2), keepdim=True), rtol=0, atol=0)
    with pytest.raises(ValueError, match="frames_per_view is required"):
        encoder.encode_item(item, 2, None)


def test_encode_fn_is_late_bound():
    vae = ToyVAE()
    encoder = make_encoder(vae)
    calls = []
    original = encoder.encode_fn

    def timed(x):
        calls.append(x.shape)
        return original(x)

    encoder.encode_fn = timed  # a timer installed after construction
    encoder.encode_local([pixels(3, 8, 8, 8)], [2], [4])
    assert len(calls) == 2


def test_balancing_available_is_config_only():
    table = EncodeCostModel({(4, 8, 8): 0.1})
    assert not make_encoder(cost_model=table, parallel_dims=None).balancing_available()
    assert not make_encoder(cost_model=None, parallel_dims=BalanceGroup()).balancing_available()
    assert not make_encoder(cost_model=EncodeCostModel(), parallel_dims=BalanceGroup()).balancing_available()
    # No process group initialized in this process: the default group cannot balance.
    assert not make_encoder(cost_model=table, parallel_dims=BalanceGroup()).balancing_available()


def test_reference_matches_fused_op_used_here():
    x = pixels(3, 6, 8, 8)
    views = ops.normalize_uint8(x, num_views=3)
    want = [torch.empty(3, 2, 8, 8) for _ in range(3)]
    reference.normalize_uint8_into(x, want)
    assert all(torch.equal(a, b) for a, b in zip(views, want))


# ---- names, aliases, devices, integers, import weight --------------------------------------------


def test_clean_keyword_names_and_the_specifications_aliases():
    from latentfast import compat

    vae, table = ToyVAE(), EncodeCostModel({(4, 8, 8): 0.1})
    clean = VisionEncoder(cost_model=table, parallel_dims=None, encode_fn=vae.encode_video, device="cpu", dtype=torch.bfloat16)
    with pytest.warns(DeprecationWarning) as caught:
        spec = compat.VisionEncoder(tokenizer=table, parallel_dims=None, encode_fn=vae.encode_video, fp32_kwargs={"device": "cpu", "dtype": torch.bfloat16})
    assert [str(w.message).split(" is ")[0] for w in caught] == ["VisionEncoder(tokenizer=)", "VisionEncoder(fp32_kwargs=)"]
    assert clean.cost_model is table and spec.cost_model is table and spec.tokenizer is table
    for encoder in (clean, spec):
        assert encoder.device == torch.device("cpu") and encoder.dtype == torch.bfloat16
    assert not hasattr(clean, "tokenizer"), "the specification's names live in latentfast.compat only"
    with pytest.raises(TypeError):
        VisionEncoder(tokenizer=table, encode_fn=vae.encode_video, device="cpu")
    assert VisionEncoder(encode_fn=vae.encode_video, device="cpu").dtype == torch.float32
    with pytest.warns(DeprecationWarning, match="fp32_kwargs="):
        assert compat.VisionEncoder(encode_fn=vae.encode_video, fp32_kwargs={"device": "cpu"}).dtype == torch.float32
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError, match="cost_model= or its alias tokenizer=, not both"):
        compat.VisionEncoder(cost_model=table, tokenizer=table, encode_fn=vae.encode_video, device="cpu")
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError, match="device=/dtype= or their alias fp32_kwargs=, not both"):
        compat.VisionEncoder(encode_fn=vae.encode_video, device="cpu", fp32_kwargs={"device": "cpu"})
    with pytest.raises(InvalidArgumentError, match="device is required"):
        VisionEncoder(encode_fn=vae.encode_video)
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError, match="fp32_kwargs must be a dict"):
        compat.VisionEncoder(encode_fn=vae.encode_video, fp32_kwargs={"device": "cpu", "layout": None})
    with pytest.raises(ArgumentTypeError, match="dtype must be a floating torch.dtype"):
        VisionEncoder(encode_fn=vae.encode_video, device="cpu", dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="link_bandwidth must be finite and > 0"):
        VisionEncoder(encode_fn=vae.encode_video, device="cpu", link_bandwidth=-1.0)
    assert VisionEncoder(encode_fn=vae.encode_video, device="cpu", link_bandwidth=np.float32(1e9)).link_bandwidth == 1e9


def test_cuda_without_an_index_is_the_current_cuda_device(monkeypatch):
    """Units land on cuda:N and torch.device("cuda") != torch.device("cuda:N"): the encoder must
    name the indexed device, or the balanced path rejects every unit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    encoder = VisionEncoder(encode_fn=torch.neg, device="cuda")
    assert encoder.device == torch.device("cuda", 1)
    from latentfast import compat

    with pytest.warns(DeprecationWarning):
        assert compat.VisionEncoder(encode_fn=torch.neg, fp32_kwargs={"device": "cuda"}).device == torch.device("cuda", 1)
    assert VisionEncoder(encode_fn=torch.neg, device=torch.device("cuda", 0)).device == torch.device("cuda", 0)


def test_numpy_integers_are_accepted_where_an_int_is_expected():
    item = pixels(3, 12, 8, 8)
    views = build_units([item], [np.int64(3)], [np.int32(4)])
    assert [tuple(u.tensor.shape) for u in views] == [(3, 4, 8, 8)] * 3
    validate_multiview_length(item, num_views=np.int64(3), frames_per_view=np.int64(4))
    encoder = make_encoder()
    assert torch.equal(encoder.encode_item(item, np.int64(3), np.int64(4)), encoder.encode_item(item, 3, 4))
    for bad in (True, 2.0, "3"):
        with pytest.raises(TypeError, match="num_views"):
            validate_multiview_length(item, num_views=bad, frames_per_view=4)
    with pytest.raises(ValueError, match=r"frames_per_item\[0\] must be an int >= 1, got 0"):
        build_units([item], [3], [0])


def test_one_set_of_item_checks_for_units_and_local_encoding():
    encoder = make_encoder()
    cases = [
        (([pixels(3, 4, 8, 8)], [2, 1], [2]), "same length"),
        (([pixels(3, 4, 8, 8), None], [1, 1], [None, None]), r"items\[1\] is None"),
        (([torch.zeros(3, 8, 8)], [1], [None]), r"items\[0\]: VAE inputs must have shape"),
    ]
    for args, message in cases:
        for call in (build_units, encoder.encode_local):
            with pytest.raises(ValueError, match=message):
                call(*args)


def test_importing_the_package_loads_neither_the_demo_nor_the_toys():
    code = (
        "import sys, latentfast.vision as v\n"
        "heavy = [m for m in ('latentfast.vision.demo', 'latentfast.toy', 'latentfast.testing') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not hasattr(v, 'demo_balanced_encode') and not hasattr(v, 'spawn_gloo')\n"
        "from latentfast.vision.demo import demo_balanced_encode\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_specifications_module_names_still_work():
    import latentfast.vision
    from latentfast import compat

    with pytest.warns(DeprecationWarning, match="vae_pixel_shapes"):
        from latentfast.compat import get_vae_pixel_shapes
    with pytest.warns(DeprecationWarning, match="regroup_latents"):
        from latentfast.compat import regroup_vision_latents
    assert not hasattr(latentfast.vision, "get_vae_pixel_shapes") and not hasattr(latentfast.vision, "regroup_vision_latents")
    items = [torch.zeros(3, 5, 16, 24), None]
    assert get_vae_pixel_shapes(items) == vae_pixel_shapes(items) == [(5, 16, 24)]
    assert regroup_vision_latents is regroup_latents
    x = pixels(3, 4, 8, 8)
    with pytest.warns(DeprecationWarning, match="fp32_kwargs"):
        spec = compat.normalize_uint8_item(x, {"device": "cpu", "dtype": torch.bfloat16})
    assert spec.dtype == torch.bfloat16 and torch.equal(spec, normalize_uint8_item(x, dtype=torch.bfloat16))
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="fp32_kwargs must be a dict"):
        compat.normalize_uint8_item(x, {"layout": None})
    with pytest.raises(TypeError):
        normalize_uint8_item(x, {"device": "cpu"})
