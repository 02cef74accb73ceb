"""Reproducible latent sampling: ``mean + std * eps``, ``eps`` a function of (seed, epoch, item key, element).

The draw of an item never depends on the batch it lands in, the number of DataLoader workers or a
resume mid-epoch: ``eps`` is computed from a counter-based generator keyed by the item, not from a
stateful stream. Every implementation (this torch reference, the Triton kernel
``latentfast.kernels.sample_latents``, a C++ kernel) computes the same definition:

1. **Key hash** (host, once per key): ``h = BLAKE2b(key.encode("utf-8", "surrogatepass"), digest_size=8,
   person=b"latentfast.key")`` read as a little-endian uint64 (``surrogatepass`` changes nothing for
   valid text; it lets a key of an older cache that holds a lone surrogate draw too).
2. **Item seed** (host, per batch), all arithmetic modulo 2**64, ``seed`` and ``epoch`` taken
   modulo 2**64: ``s = mix64(h ^ mix64(epoch + mix64(seed + 0x9E3779B97F4A7C15)))`` where ``mix64``
   is SplitMix64's finalizer ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
   z *= 0x94D049BB133111EB; z ^= z >> 31``. Passed to kernels as int64 (the same 64 bits).
3. **Integers**: element ``j`` of the item (its C-order index in the item's own shape) belongs to
   group ``q = j // 4``. Philox4x32-10 (Salmon et al. 2011, Random123's ``philox4x32_10``; its
   ``kat_vectors`` are checked in the tests) with key ``(s & 0xFFFFFFFF, s >> 32)`` and counter
   ``(q & 0xFFFFFFFF, q >> 32, STREAM_LATENT_EPS = 0, 0)`` gives four uint32 ``x0..x3``.
4. **Normals** (float32 math, Box-Muller): the pair ``(a, b) = (x0, x1)`` gives elements
   ``4q, 4q+1``; ``(x2, x3)`` gives ``4q+2, 4q+3``. ``u1 = ((a >> 8) + 1) * 2**-24`` in (0, 1],
   ``u2 = (b >> 8) * 2**-24`` in [0, 1) (both exact in float32), ``r = sqrt(-2 * log(u1))``,
   ``t = u2 * float32(2*pi)``, first element ``r * cos(t)``, second ``r * sin(t)``.
5. **Output**: ``float32(mean) + float32(std) * eps`` rounded once to the output dtype.

The integer stream (steps 1-3) is bit-identical across implementations. The floats differ only by
the transcendental functions' last bits (and a fused multiply-add on a GPU): a kernel matches this
reference within ``|d eps| <= 1e-5`` plus one rounding of the output dtype (the tests' tolerance).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .errors import ArgumentTypeError, InvalidArgumentError

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
GOLDEN64 = 0x9E3779B97F4A7C15
# Philox4x32 multipliers and Weyl key increments (Random123)
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
# counter word 2: which draw of an item this is (other read-time draws, e.g. flips, take other values)
STREAM_LATENT_EPS = 0
STREAM_FLIP = 1
TWO_PI_F32 = 6.2831854820251465  # float32(2*pi), exactly
INV_2_24 = 2.0**-24
SAMPLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- item seeds (host) ------------------------------------------------------------------------------
def mix64(z: int) -> int:
    """SplitMix64's finalizer on a uint64 (a bijection: distinct inputs give distinct outputs)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def key_hash(key: str) -> int:
    """The stable 64-bit hash of an item key (never Python's salted ``hash``): BLAKE2b-64 of its UTF-8.

    A key holding a lone surrogate (a file name of another encoding, imported before keys had to be
    text) hashes its surrogates as UTF-8 would encode them (``surrogatepass``): every key a cache's keys
    file can hold draws, and valid text hashes as plain UTF-8."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"an item key must be a str, got {type(key).__name__} ({key!r})")
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, person=b"latentfast.key").digest()
    return int.from_bytes(digest, "little")


def _check_int(value, name: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def item_seed(key_hash_value: int, seed: int, epoch: int) -> int:
    """The uint64 Philox key of one item for ``(seed, epoch)`` (step 2 of the module's definition)."""
    run = mix64(epoch + mix64(seed + GOLDEN64))
    return mix64(key_hash_value ^ run)


def item_seeds(keys: Sequence[str], seed: int, epoch: int) -> torch.Tensor:
    """int64 ``[B]`` (uint64 bit patterns) Philox keys of ``keys`` for ``(seed, epoch)``, on the CPU.

    ``seed`` is any int (taken modulo 2**64); ``epoch`` an int >= 0."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise ArgumentTypeError(f"keys must be a sequence of str, got {type(keys).__name__}")
    seed, epoch = _check_int(seed, "seed"), _check_int(epoch, "epoch", minimum=0)
    words = [item_seed(key_hash(k), seed, epoch) for k in keys]
    return torch.tensor([w - (1 << 64) if w >> 63 else w for w in words], dtype=torch.int64)


# -- Philox4x32-10 on int64 tensors holding uint32 values ----------------------------------------------
def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit halves of ``a * m`` (a < 2**32, m < 2**32), without int64 overflow: ``m`` is
    split in 16-bit halves so every partial product stays below 2**49."""
    t_lo = a * (m & 0xFFFF)
    t_hi = a * (m >> 16)
    low = t_lo + ((t_hi & 0xFFFF) << 16)
    return (t_hi >> 16) + (low >> 32), low & MASK32


def philox4x32_10(counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Random123's ``philox4x32_10``: four counter words and two key words (int64 tensors of uint32
    values, broadcastable) -> four int64 tensors of uint32 values."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_words(seeds: torch.Tensor, n: int, *, first_group: int = 0) -> torch.Tensor:
    """int64 ``[B, 4 * ceil(n / 4)]`` of uint32 values: the words ``x0..x3`` of every group of each item
    (step 3), in element order, from group ``first_group`` on. The integer stream every implementation
    must reproduce bit for bit."""
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    groups = torch.arange(first_group, first_group + (n + 3) // 4, dtype=torch.int64, device=seeds.device).reshape(1, -1)
    zero = torch.zeros((), dtype=torch.int64, device=seeds.device)
    words = philox4x32_10((groups & MASK32, groups >> 32, zero + STREAM_LATENT_EPS, zero),
                          (seeds & MASK32, (seeds >> 32) & MASK32))
    return torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(seeds.shape[0], 4 * groups.shape[1])


def box_muller(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 standard normals from two uint32 words (step 4)."""
    u1 = ((a >> 8) + 1).to(torch.float32) * INV_2_24
    u2 = (b >> 8).to(torch.float32) * INV_2_24
    r = torch.sqrt(-2.0 * torch.log(u1))
    t = u2 * TWO_PI_F32
    return r * torch.cos(t), r * torch.sin(t)


def normal_eps(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``[B, n]``: the standard normal draws of elements ``0..n-1`` of each item (int64 ``seeds [B]``)."""
    words = philox_words(seeds, n)
    z0, z1 = box_muller(words[:, 0::4], words[:, 1::4])
    z2, z3 = box_muller(words[:, 2::4], words[:, 3::4])
    return torch.stack((z0, z1, z2, z3), dim=-1).reshape(words.shape[0], words.shape[1])[:, :n]


def uniforms(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    """float64 ``[B]`` in [0, 1): one uniform per item of draw ``stream`` (counter ``(0, 0, stream, 0)``,
    word ``x0``, its top 24 bits times 2**-24, as ``u2`` of step 4), on the CPU. Depends only on the
    item seed: the same for an item in any batch, worker or resumed run."""
    seeds = seeds.to("cpu", torch.int64).reshape(-1)
    zero = torch.zeros((), dtype=torch.int64)
    x0 = philox4x32_10((zero, zero, zero + stream, zero), (seeds & MASK32, (seeds >> 32) & MASK32))[0]
    return torch.broadcast_to(x0 >> 8, seeds.shape).to(torch.float64) * INV_2_24


def flip_draws(seeds: torch.Tensor, p: float) -> torch.Tensor:
    """bool ``[B]``: which items are flipped with probability ``p`` (``uniforms(seeds, STREAM_FLIP) < p``)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise InvalidArgumentError(f"flip must be a probability in [0, 1], got {p!r}")
    return uniforms(seeds, STREAM_FLIP) < p


# -- the reference of the op -----------------------------------------------------------------------
def check_sample_latents(mean: torch.Tensor, std: torch.Tensor, item_seeds: torch.Tensor, out) -> None:
    """The argument checks every implementation of ``sample_latents`` shares."""
    for name, x in (("mean", mean), ("std", std), ("item_seeds", item_seeds)) + ((("out", out),) if out is not None else ()):
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("mean", mean), ("std", std)) + ((("out", out),) if out is not None else ()):
        if x.dtype not in SAMPLE_DTYPES:
            raise InvalidArgumentError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.shape != mean.shape or x.device != mean.device:
            raise InvalidArgumentError(f"{name} must match mean's shape {list(mean.shape)} on {mean.device}, "
                                       f"got {list(x.shape)} on {x.device}")
    if mean.ndim < 1:
        raise InvalidArgumentError("mean must be a [B, ...] batch (one item per row), got a 0-d tensor")
    if item_seeds.dtype != torch.int64 or item_seeds.shape != (mean.shape[0],):
        raise InvalidArgumentError(f"item_seeds must be int64 [{mean.shape[0]}] (one per item, from item_seeds()), "
                                   f"got {item_seeds.dtype} {list(item_seeds.shape)}")


def sample_latents_reference(mean: torch.Tensor, std: torch.Tensor, item_seeds: torch.Tensor,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[b] = mean[b] + std[b] * eps(item_seeds[b], element)`` for a ``[B, ...]`` batch, float32 math.

    ``mean`` and ``std``: the same shape, float16 / bfloat16 / float32, any strides. ``out``: written
    in place when given (its dtype is the output dtype), else a new tensor of ``mean``'s dtype. The
    element index is the C-order index within the row, so a row must hold the item's own shape (a
    padded batch would index by the padded shape and change an item's draw with the batch)."""
    check_sample_latents(mean, std, item_seeds, out)
    B = mean.shape[0]
    eps = normal_eps(item_seeds.to(mean.device), mean[0].numel() if B else 0)
    result = mean.float() + std.float() * eps.reshape(mean.shape)
    if out is None:
        return result.to(mean.dtype)
    return out.copy_(result)
