"""Errors of remote (object-storage) reads; both name the object and the byte range."""
from __future__ import annotations

from ...errors import CacheCorruptError, CacheError


class RemoteReadError(CacheError, OSError):
    """A ranged read of an object failed after its bounded retries, or came back short."""


class RemoteNotFoundError(RemoteReadError, FileNotFoundError):
    """The object (or the folder's meta) does not exist at the URL."""


class RemoteCorruptError(CacheCorruptError):
    """Fetched bytes failed their expected CRC-32 on every attempt."""

