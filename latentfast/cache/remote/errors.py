"""Errors of remote (object-storage) reads; both name the object and the byte range."""
from __future__ import annotations

from ...errors import CacheCorruptError, CacheError


class RemoteReadError(CacheError, OSError):
    """A ranged read of an object failed after its bounded retries, or came back short."""


class RemoteNotFoundError(RemoteReadError, FileNotFoundError):
    """The object (or the folder's meta) does not exist at the URL."""


class RemoteCorruptError(CacheCorruptError):
    """Fetched bytes failed their expected CRC-32 on every attempt."""



class RemoteReplacedError(CacheCorruptError):
    """The object changed after the reader opened it (a push replaced the cache): its bytes now are
    another generation's, which the reader's index does not describe. Open the cache again."""
