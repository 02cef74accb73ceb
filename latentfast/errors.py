"""The library's error classes: one base, :class:`LatentfastError`, and a subclass per kind of failure.

Every class also derives from the built-in exception a Python user would expect for that kind
(``ValueError`` for a bad argument value, ``IndexError`` for an index out of range, ...), so
``except ValueError`` keeps working while ``except latentfast.LatentfastError`` catches
everything this library raises on purpose. Every backend of an op raises the same class for the
same bad input (the op layer translates the compiled kernels' errors, see :mod:`latentfast.backends`).

Messages name the argument, what was expected and what was received.
"""
from __future__ import annotations


class LatentfastError(Exception):
    """Base class of every error latentfast raises on purpose."""


class InvalidArgumentError(LatentfastError, ValueError):
    """An argument has the wrong value, shape, dtype, device or layout."""


class ArgumentTypeError(LatentfastError, TypeError):
    """An argument has the wrong Python type."""


class IndexOutOfRangeError(LatentfastError, IndexError):
    """An index (a cache row, a rank, a unit) is outside its valid range."""


class BackendUnavailableError(LatentfastError, RuntimeError):
    """A backend was forced (argument or ``LATENTFAST_BACKEND``) but cannot run this op here."""


class CacheError(LatentfastError):
    """Base class of the latent cache's errors."""


class IncompleteCacheError(CacheError, RuntimeError):
    """The cache's build started and did not finish."""


class CacheCorruptError(CacheError, ValueError):
    """A block, row or index file of the cache holds wrong contents, or a file changed under a reader."""


class CacheLockedError(CacheError, RuntimeError):
    """Another process holds the cache folder's build lock."""


class ImageError(CacheError, ValueError):
    """A source image cannot be read or decoded."""


class CaptionError(CacheError, ValueError):
    """An image's caption is missing, or its caption file cannot be read as UTF-8 text."""


class OffloadEncodeError(LatentfastError, RuntimeError):
    """A balanced encode step failed on some rank; raised on every rank. ``failed_ranks`` names them."""

    def __init__(self, message: str, failed_ranks=()):
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)


class ReplayError(LatentfastError, RuntimeError):
    """Feature gradient replay was used out of order (an expired result, a reused arena, ...)."""


class NonFiniteError(LatentfastError, ValueError):
    """A value that must be finite (a feature, a loss, a cotangent, a cost) is not."""


class NonFiniteReplayError(NonFiniteError, FloatingPointError):
    """A replay feature, loss or cotangent is not finite (also a ``FloatingPointError``, the class
    the feature replay specification raises for non-finite features)."""


class MissingCostError(LatentfastError, KeyError):
    """No predicted encode cost for a shape (measure it, or allow interpolation)."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class AbsentValueError(CacheError, LookupError):
    """An item has no value of an optional record field that this read needs (the error names the item's
    key and the field)."""


class UnknownKeyError(CacheError, KeyError):
    """A latent cache holds no item with this key."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class DeviceUnavailableError(LatentfastError, RuntimeError):
    """The requested device (e.g. ``"cuda"``) does not exist or cannot be used in this process."""


__all__ = [
    "AbsentValueError",
    "ArgumentTypeError",
    "BackendUnavailableError",
    "CaptionError",
    "CacheCorruptError",
    "CacheError",
    "CacheLockedError",
    "DeviceUnavailableError",
    "ImageError",
    "IncompleteCacheError",
    "IndexOutOfRangeError",
    "InvalidArgumentError",
    "LatentfastError",
    "MissingCostError",
    "NonFiniteError",
    "NonFiniteReplayError",
    "UnknownKeyError",
    "OffloadEncodeError",
    "ReplayError",
]
