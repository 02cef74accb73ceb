"""EncodeCostModel: measured table, unknown shapes, interpolation."""
from __future__ import annotations

import pytest
import torch

from latentfast.errors import MissingCostError
from latentfast.vision import EncodeCostModel


def test_lookup_and_unknown_shape_raises_naming_it():
    model = EncodeCostModel({(4, 8, 8): 0.5, (8, 8, 8): 1.0})
    assert model.encode_seconds_benchmarked
    assert model.predicted_encode_seconds(4, 8, 8) == 0.5
    with pytest.raises(KeyError, match=r"\(2, 8, 8\).*interpolation") as raised:
        model.predicted_encode_seconds(2, 8, 8)
    assert isinstance(raised.value, MissingCostError) and str(raised.value).startswith("no measured encode time")
    assert not EncodeCostModel().encode_seconds_benchmarked


def test_voxel_interpolation():
    model = EncodeCostModel({(4, 8, 8): 1.0, (8, 8, 8): 2.0}, interpolation="voxels")
    assert model.predicted_encode_seconds(6, 8, 8) == pytest.approx(1.5)
    assert model.predicted_encode_seconds(1, 1, 1) >= 0.0
    single = EncodeCostModel({(4, 8, 8): 1.0}, interpolation="voxels")
    assert single.predicted_encode_seconds(4, 16, 16) == pytest.approx(4.0)
    with pytest.raises(KeyError):
        EncodeCostModel(interpolation="voxels").predicted_encode_seconds(4, 8, 8)


def test_invalid_tables_and_options():
    with pytest.raises(ValueError, match="interpolation"):
        EncodeCostModel({}, interpolation="cubic")
    with pytest.raises(ValueError, match="finite and >= 0"):
        EncodeCostModel({(4, 8, 8): -1.0})
    with pytest.raises(ValueError, match="positive"):
        EncodeCostModel({(0, 8, 8): 1.0})


def test_measure_warms_up_then_takes_the_median_of_repeats():
    calls = []

    def encode(clip):
        calls.append(tuple(clip.shape))
        assert clip.dtype == torch.float32 and -1 <= clip.min() and clip.max() <= 1
        return clip[:, ::4, ::8, ::8]

    model = EncodeCostModel.measure(encode, [(4, 8, 8), (8, 16, 16), (4, 8, 8)], warmup=2, repeats=3)
    assert sorted(model.seconds_by_shape) == [(4, 8, 8), (8, 16, 16)]
    assert calls.count((3, 4, 8, 8)) == 5 and calls.count((3, 8, 16, 16)) == 5
    assert all(s > 0 for s in model.seconds_by_shape.values())
    # The latent each shape encodes to: 3 x ceil(T/4) x H/8 x W/8 float32 here.
    assert model.latent_bytes_by_shape == {(4, 8, 8): 3 * 1 * 1 * 1 * 4, (8, 16, 16): 3 * 2 * 2 * 2 * 4}
    assert model.predicted_latent_bytes(8, 16, 16) == 96
    assert model.predicted_latent_bytes(16, 16, 16) == 192  # scaled by voxels from the measured shapes
    assert EncodeCostModel({(4, 8, 8): 1.0}).predicted_latent_bytes(4, 8, 8) is None
    with pytest.raises(ValueError, match="repeats"):
        EncodeCostModel.measure(encode, [(4, 8, 8)], repeats=0)
