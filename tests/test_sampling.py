"""Reproducible latent sampling (latentfast.sampling): the definition every implementation shares.

- the item seeds against an independent formula (hashlib + Python ints), stable across processes;
- Philox4x32-10 against Random123's known-answer vectors and against a numpy implementation written
  separately here (uint64 products instead of the reference's 16-bit split): bit-equal streams;
- the float draws against numpy's float64 Box-Muller, the statistics of 1e6 draws, independence
  across keys / seeds / epochs and within Box-Muller pairs;
- sample_latents_reference: the formula, every dtype, non-contiguous inputs, out=, draws that do
  not depend on the batch an item is in, clear errors;
- the Triton kernel (``triton`` cases: run on CPU by test_triton_interpreter.py under Triton's
  interpreter, or on CUDA): the integer stream bit for bit, the outputs within tolerance.
"""
from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from latentfast import sampling
from latentfast.errors import ArgumentTypeError, InvalidArgumentError
from latentfast.sampling import item_seeds, normal_eps, philox_words, sample_latents_reference
from latentfast.testing import assert_sampled_like_reference, poisoned_like

M64 = (1 << 64) - 1


# -- the independent formulas ---------------------------------------------------------------------
def splitmix_finalizer(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return z ^ (z >> 31)


def expected_item_seed(key: str, seed: int, epoch: int) -> int:
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, person=b"latentfast.key").digest(), "little")
    run = splitmix_finalizer((epoch + splitmix_finalizer((seed + 0x9E3779B97F4A7C15) % (1 << 64))) % (1 << 64))
    return splitmix_finalizer(h ^ run)


def numpy_philox(ctr: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 on uint32 arrays ctr [..., 4], key [..., 2] with numpy's uint64 products."""
    c = [ctr[..., i].astype(np.uint64) for i in range(4)]
    k = [key[..., i].astype(np.uint64) for i in range(2)]
    m32 = np.uint64(0xFFFFFFFF)
    for r in range(10):
        p0 = c[0] * np.uint64(0xD2511F53)
        p1 = c[2] * np.uint64(0xCD9E8D57)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k[0], p1 & m32, (p0 >> np.uint64(32)) ^ c[3] ^ k[1], p0 & m32]
        k = [(k[0] + np.uint64(0x9E3779B9)) & m32, (k[1] + np.uint64(0xBB67AE85)) & m32]
    return np.stack(c, axis=-1).astype(np.uint32)


def numpy_words(seeds: list[int], n: int) -> np.ndarray:
    """uint32 [B, 4 * ceil(n/4)]: the words of groups 0.. of each item seed (uint64 ints)."""
    q = np.arange((n + 3) // 4, dtype=np.uint64)
    out = []
    for s in seeds:
        ctr = np.stack([q & np.uint64(0xFFFFFFFF), q >> np.uint64(32), np.zeros_like(q), np.zeros_like(q)], -1)
        key = np.broadcast_to(np.array([s & 0xFFFFFFFF, s >> 32], dtype=np.uint64), (len(q), 2))
        out.append(numpy_philox(ctr.astype(np.uint32), key.astype(np.uint32)).reshape(-1))
    return np.stack(out)


def numpy_normals(words: np.ndarray, n: int) -> np.ndarray:
    """float64 Box-Muller of the words (pairs (x0, x1), (x2, x3) of each group)."""
    a, b = words[:, 0::2].astype(np.float64), words[:, 1::2].astype(np.float64)
    u1 = (np.floor(a / 256) + 1) / 2**24
    u2 = np.floor(b / 256) / 2**24
    r = np.sqrt(-2 * np.log(u1))
    z = np.stack([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)], -1).reshape(words.shape[0], -1)
    return z[:, :n]


def as_uint64(seeds: torch.Tensor) -> list[int]:
    return [int(s) & M64 for s in seeds.tolist()]


# -- item seeds -----------------------------------------------------------------------------------
def test_item_seeds_follow_the_definition():
    keys = ["a", "img/0001", "ünïcödé/猫", "", "x" * 300]
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (-1, 7), (2**64 + 5, 3), (123456789, 10**12)]:
        got = as_uint64(item_seeds(keys, seed, epoch))
        assert got == [expected_item_seed(k, seed % (1 << 64), epoch) for k in keys], (seed, epoch)


def test_item_seeds_are_the_same_in_another_process():
    # never Python's salted hash: a child with another PYTHONHASHSEED computes the same seeds
    keys = ["a", "b/c", "photo_17"]
    code = f"from latentfast.sampling import item_seeds; print(item_seeds({keys!r}, 42, 3).tolist())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(item_seeds(keys, 42, 3).tolist())


def test_item_seeds_differ_across_keys_seeds_and_epochs():
    keys = [f"img_{i:06d}" for i in range(20_000)]
    seeds = set(as_uint64(item_seeds(keys, 0, 0)))
    assert len(seeds) == len(keys)
    again = set(as_uint64(item_seeds(keys, 0, 1))) | set(as_uint64(item_seeds(keys, 1, 0)))
    assert not seeds & again and len(again) == 2 * len(keys)


@pytest.mark.parametrize("args, error, match", [
    (("abc", 0, 0), ArgumentTypeError, "keys must be a sequence of str"),
    (([1, 2], 0, 0), ArgumentTypeError, "an item key must be a str, got int"),
    ((["a"], 1.5, 0), ArgumentTypeError, "seed must be an int, got float"),
    ((["a"], True, 0), ArgumentTypeError, "seed must be an int, got bool"),
    ((["a"], 0, -1), InvalidArgumentError, "epoch must be >= 0, got -1"),
])
def test_item_seeds_errors(args, error, match):
    with pytest.raises(error, match=match):
        item_seeds(*args)


# -- the integer stream ---------------------------------------------------------------------------
# Random123 tests/kat_vectors, philox4x32 10: counter (4 words), key (2 words) -> 4 words
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert numpy_philox(np.array(ctr, dtype=np.uint32), np.array(key, dtype=np.uint32)).tolist() == want
    got = sampling.philox4x32_10([torch.tensor(c) for c in ctr], [torch.tensor(k) for k in key])
    assert [int(w) for w in got] == want


def test_reference_words_equal_numpy_bit_for_bit():
    rng = np.random.default_rng(1)
    seeds = [int(s) for s in rng.integers(0, 2**63, 5, dtype=np.int64)] + [M64, 0, 2**63]
    seeds_t = torch.tensor([s - (1 << 64) if s >> 63 else s for s in seeds], dtype=torch.int64)
    for n in (1, 3, 4, 5, 1023, 4097):
        got = philox_words(seeds_t, n)
        assert got.dtype == torch.int64 and bool(((got >= 0) & (got <= 0xFFFFFFFF)).all())
        assert np.array_equal(got.numpy().astype(np.uint32), numpy_words(seeds, n)), n


def test_words_from_a_high_group_equal_numpy():
    # groups 2**32 - 1 and 2**32: where the counter's high word starts to count
    seeds = [12345678901234567, M64]
    got = philox_words(torch.tensor([seeds[0], -1]), 8, first_group=2**32 - 1)
    ctr = np.array([[0xFFFFFFFF, 0, 0, 0], [0, 1, 0, 0]], dtype=np.uint32)
    for row, s in zip(got, seeds):
        key = np.array([s & 0xFFFFFFFF, s >> 32], dtype=np.uint32)
        want = np.concatenate([numpy_philox(c, key) for c in ctr])
        assert np.array_equal(row.numpy().astype(np.uint32), want)
    assert not torch.equal(got[:, 4:], philox_words(torch.tensor([seeds[0], -1]), 4))  # no aliasing of group 0


# -- the normals ----------------------------------------------------------------------------------
def test_normals_match_float64_box_muller():
    seeds = item_seeds(["a", "b", "c"], 5, 2)
    n = 40_001
    got = normal_eps(seeds, n)
    want = numpy_normals(numpy_words(as_uint64(seeds), n), n)
    assert got.dtype == torch.float32 and got.shape == (3, n)
    err = np.abs(got.double().numpy() - want).max()
    assert err < 4e-6, err  # float32 log/sqrt/cos/sin of |z| <= 5.8


def test_normals_statistics():
    n = 1_000_000
    z = normal_eps(item_seeds(["stats"], 0, 0), n)[0].double()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs((z**3).mean().item()) < 5 * math.sqrt(15 / n)  # skewness
    assert abs((z**4).mean().item() - 3) < 5 * math.sqrt(96 / n)  # kurtosis
    cdf = torch.special.ndtr(z.sort().values)
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max().item()
    assert ks < 1.95 / math.sqrt(n), ks  # the KS test's 0.1% critical value
    # both members of a Box-Muller pair, and the two pairs of a group, are uncorrelated
    groups = z.view(-1, 4)
    corr = torch.corrcoef(groups.T)
    assert (corr - torch.eye(4, dtype=corr.dtype)).abs().max() < 5 / math.sqrt(n / 4)


def test_draws_are_independent_across_keys_seeds_and_epochs():
    n = 250_000
    rows = [item_seeds(["k1", "k2"], 0, 0), item_seeds(["k1"], 1, 0), item_seeds(["k1"], 0, 1)]
    z = normal_eps(torch.cat(rows), n).double()
    corr = torch.corrcoef(z)
    assert (corr - torch.eye(4, dtype=corr.dtype)).abs().max() < 5 / math.sqrt(n), corr


# -- the reference of the op ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", sampling.SAMPLE_DTYPES)
def test_reference_is_mean_plus_std_times_eps(dtype):
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(3, 4, 5, 7, generator=g).to(dtype)
    std = torch.rand(3, 4, 5, 7, generator=g).to(dtype)
    seeds = item_seeds(["x", "y", "z"], 11, 0)
    got = sample_latents_reference(mean, std, seeds)
    assert got.dtype == dtype and got.shape == mean.shape
    eps = torch.from_numpy(numpy_normals(numpy_words(as_uint64(seeds), 140), 140)).view(3, 4, 5, 7)
    want = (mean.double() + std.double() * eps).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_reference_out_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(5, 6, 3, 9, generator=g).permute(0, 3, 1, 2)  # [5, 9, 6, 3], not contiguous
    std = torch.rand(5, 9, 6, 3, generator=g).to(torch.bfloat16)[:, :, :, :]
    seeds = item_seeds([str(i) for i in range(5)], 0, 4)
    want = sample_latents_reference(mean.contiguous(), std.contiguous(), seeds)
    got = sample_latents_reference(mean, std, seeds)
    assert torch.equal(got, want)
    out = poisoned_like((5, 9, 6, 3), torch.float16)
    assert sample_latents_reference(mean, std, seeds, out=out) is out
    assert torch.equal(out, want.half())
    wide = poisoned_like((5, 9, 6, 6), torch.float32)[..., ::2]  # a strided out
    sample_latents_reference(mean, std, seeds, out=wide)
    assert torch.equal(wide, want)


def test_an_items_draw_does_not_depend_on_its_batch():
    keys = [f"item{i}" for i in range(6)]
    mean, std = torch.zeros(6, 4, 8, 8), torch.ones(6, 4, 8, 8)
    full = sample_latents_reference(mean, std, item_seeds(keys, 7, 2))
    for order in ([3], [5, 0], [4, 2, 1], [1, 0, 3, 5, 4, 2]):
        part = sample_latents_reference(mean[order], std[order], item_seeds([keys[i] for i in order], 7, 2))
        assert torch.equal(part, full[order]), order
    other_epoch = sample_latents_reference(mean, std, item_seeds(keys, 7, 3))
    assert not torch.equal(other_epoch, full)


def test_reference_empty_batches():
    assert sample_latents_reference(torch.zeros(0, 4, 2), torch.zeros(0, 4, 2), item_seeds([], 0, 0)).shape == (0, 4, 2)
    assert sample_latents_reference(torch.zeros(2, 0), torch.zeros(2, 0), item_seeds(["a", "b"], 0, 0)).shape == (2, 0)


@pytest.mark.parametrize("change, error, match", [
    (dict(mean=[1.0]), ArgumentTypeError, "mean must be a torch.Tensor, got list"),
    (dict(mean=torch.zeros(2, 3, dtype=torch.float64)), InvalidArgumentError, "mean must be float16, bfloat16 or float32, got torch.float64"),
    (dict(std=torch.zeros(2, 4)), InvalidArgumentError, r"std must match mean's shape \[2, 3\]"),
    (dict(std=torch.zeros(2, 3, dtype=torch.int32)), InvalidArgumentError, "std must be float16, bfloat16 or float32"),
    (dict(seeds=torch.zeros(3, dtype=torch.int64)), InvalidArgumentError, r"item_seeds must be int64 \[2\]"),
    (dict(seeds=torch.zeros(2, dtype=torch.int32)), InvalidArgumentError, r"item_seeds must be int64 \[2\]"),
    (dict(out=torch.zeros(2, 3, 1)), InvalidArgumentError, r"out must match mean's shape"),
    (dict(mean=torch.zeros(()), std=torch.zeros(())), InvalidArgumentError, "mean must be a \\[B, ...\\] batch"),
])
def test_reference_errors(change, error, match):
    args = dict(mean=torch.zeros(2, 3), std=torch.zeros(2, 3), seeds=item_seeds(["a", "b"], 0, 0), out=None)
    args.update(change)
    with pytest.raises(error, match=match):
        sample_latents_reference(args["mean"], args["std"], args["seeds"], out=args["out"])


# -- the Triton kernel (``triton`` cases) -------------------------------------------------------------
@pytest.fixture
def triton_device():
    """The device the Triton kernel runs on here: CPU under Triton's interpreter (TRITON_INTERPRET=1
    before Triton is imported: test_triton_interpreter.py runs these cases so), else CUDA, else skip."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("the Triton kernel needs a CUDA device or TRITON_INTERPRET=1")


def test_triton_words_equal_the_reference_bit_for_bit(triton_device):
    from latentfast.kernels import sample_latents as kernel

    seeds = torch.cat([item_seeds([f"k{i}" for i in range(6)], 3, 1), torch.tensor([0, -1, -(2**63)])])
    for n in (1, 5, 4 * kernel.BLOCK_SIZE + 3, 10_001):
        got = kernel.philox_words(seeds.to(triton_device), n).cpu()
        assert torch.equal(got, philox_words(seeds, n)), n
    for first in (2**31 - 7, 2**32 - 3, 2**40 + 11):  # the counter's high word (items of more than 2**34 elements)
        got = kernel.philox_words(seeds.to(triton_device), 64, first_group=first).cpu()
        assert torch.equal(got, philox_words(seeds, 64, first_group=first)), first


@pytest.mark.parametrize("dtype_in, dtype_out", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
])
def test_triton_sample_latents_matches_reference(triton_device, dtype_in, dtype_out):
    from latentfast.kernels import sample_latents as kernel

    g = torch.Generator().manual_seed(5)
    for shape in [(1, 1), (3, 5), (2, 4, 3, 7), (5, 3, 2, 9, 11), (2, 4, 33, 65), (7,)]:
        mean = (torch.randn(shape, generator=g) * 3).to(dtype_in).to(triton_device)
        std = torch.rand(shape, generator=g).to(dtype_in).to(triton_device)
        seeds = item_seeds([f"img/{i}" for i in range(shape[0])], 17, 4).to(triton_device)
        out = poisoned_like(shape, dtype_out, triton_device)
        kernel.sample_latents_into(mean, std, seeds, out)
        assert_sampled_like_reference(out, mean, std, seeds)


def test_triton_sample_latents_non_contiguous(triton_device):
    from latentfast.kernels import sample_latents as kernel

    g = torch.Generator().manual_seed(6)
    base = torch.randn(4, 6, 10, 9, generator=g).to(triton_device)
    cases = {
        "permuted": (base.permute(0, 2, 1, 3), base.abs().permute(0, 2, 1, 3)),  # inner dims merge as a view
        "sliced": (base[:, 1:5, :, ::2], base.abs()[:, 1:5, :, ::2]),
        "batch-major transpose": (base.transpose(0, 1), base.abs().transpose(0, 1)),
        "unmergeable": (base.permute(0, 3, 1, 2), base.abs().permute(0, 3, 1, 2)),  # copied to contiguous
    }
    for name, (mean, std) in cases.items():
        seeds = item_seeds([str(i) for i in range(mean.shape[0])], 0, 9).to(triton_device)
        out = poisoned_like(mean.shape, torch.float32, triton_device)
        kernel.sample_latents_into(mean, std, seeds, out)
        assert_sampled_like_reference(out, mean, std, seeds)
        wide = poisoned_like((*mean.shape[:-1], 2 * mean.shape[-1]), torch.float32, triton_device)
        strided = wide[..., 1::2]  # a strided out, written in place; the other columns stay poisoned
        kernel.sample_latents_into(mean, std, seeds, strided)
        assert torch.equal(strided, out), name
        assert bool(wide[..., 0::2].isnan().all()), name
        odd = poisoned_like(mean.shape[::-1], torch.float32, triton_device).permute(*range(mean.ndim - 1, -1, -1))
        kernel.sample_latents_into(mean, std, seeds, odd)  # an out whose strides do not merge
        assert torch.equal(odd, out), name


def test_triton_sample_latents_empty_and_errors(triton_device):
    from latentfast.kernels import sample_latents as kernel

    out = poisoned_like((0, 3), torch.float32, triton_device)
    kernel.sample_latents_into(out.clone(), out.clone(), torch.zeros(0, dtype=torch.int64, device=triton_device), out)
    mean = torch.zeros(2, 3, device=triton_device)
    with pytest.raises(InvalidArgumentError, match=r"item_seeds must be int64 \[2\]"):
        kernel.sample_latents_into(mean, mean, torch.zeros(2, dtype=torch.int32, device=triton_device), mean.clone())
