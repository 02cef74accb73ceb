"""A folder of objects -- a local path or ``s3://bucket/prefix`` (``gs://``, ``az://``) -- behind one
small async interface: ranged GETs, whole GETs, uploads (multipart for large files), listing.

The client is `obstore <https://developmentseed.org/obstore>`_, Python bindings of the Rust
``object_store`` crate (part of Apache Arrow; crates.io and many query engines depend on it):

- ranged GETs are async on a Rust/tokio runtime: hundreds of concurrent requests from one Python
  thread, the body never passes through Python's asyncio streams (aiobotocore/s3fs) and there is no
  thread per request (boto3); the answer is a buffer we copy once, into the caller's array;
- its retry layer is the crate's well-tested one: exponential backoff with jitter on 5xx (503
  SlowDown included), 429, connection errors, dropped connections and timeouts of read-only
  requests, bounded by ``max_retries`` and ``retry_timeout``;
- multipart uploads are built in (``put(..., use_multipart=True)``), so is ``gs://``/``az://``;
- one wheel, no Python dependencies, typed, released often.

``get_ranges`` of obstore coalesces too, but our runs are also the local chunk cache's unit (and its
byte count), so :mod:`.reader` coalesces itself and issues one ``get_range`` per run.

Configuration: the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``) are read by the client; ``storage_options`` override them.
Keys: ``endpoint_url`` (or ``endpoint``), ``key``/``access_key_id``, ``secret``/``secret_access_key``,
``region``, ``token``, any other ``object_store`` S3 config key, plus the client's ``timeout`` and
``connect_timeout`` (seconds) and retries: ``max_retries`` (default 10), ``retry_backoff`` (first
wait, seconds, default 0.1), ``retry_max_backoff`` (default 15), ``retry_timeout`` (default 180).
``timeout`` bounds one request (the client's default: 30 s) and ``retry_timeout`` the retries after
it, so an endpoint that accepts connections and never answers fails after about their sum: pass
both (``{"timeout": 10, "retry_timeout": 10}``) to fail fast; the CLI's ``--timeout`` sets both.
``http://`` endpoints are allowed (loopback MinIO, moto, s3rver).
"""
from __future__ import annotations

import asyncio
import datetime
import os

from ...errors import InvalidArgumentError
from .errors import RemoteNotFoundError, RemoteReadError, RemoteReplacedError
from . import client

_ALIASES = {"endpoint_url": "endpoint", "key": "access_key_id", "aws_access_key_id": "access_key_id",
            "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
            "region_name": "region", "token": "session_token", "aws_session_token": "session_token"}
_CLIENT_KEYS = ("timeout", "connect_timeout")
_RETRY_KEYS = ("max_retries", "retry_backoff", "retry_max_backoff", "retry_timeout")
MULTIPART_BYTES = 64 << 20  # files above this upload in parts (obstore's 5 MiB parts, 12 at once)
_client_started_in = {"pid": None}  # inherited by a fork: how a child knows the parent's runtime is dead


def _forked_after_use() -> bool:
    """True in a process forked from one that had used obstore: its calls must go to a helper
    process (see :mod:`.client` for why and how); marks this process as a user otherwise."""
    pid = _client_started_in["pid"]
    if pid is None:
        _client_started_in["pid"] = pid = os.getpid()
    return pid != os.getpid()


def is_remote(url: str) -> bool:
    """True for an object-store URL (``s3://``, ``gs://``, ``az://``, ...), False for a local path."""
    return "://" in str(url) and not str(url).startswith("file://")


def _seconds(value) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(value))


def _split_options(url: str, storage_options) -> tuple[dict, dict, dict]:
    """``storage_options`` -> (store config, client options, retry config) for obstore."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise InvalidArgumentError(f"storage_options must be a dict, got {type(storage_options).__name__}")
    config = {_ALIASES.get(k, k): v for k, v in (storage_options or {}).items()}
    client = {k: _seconds(config.pop(k)) for k in _CLIENT_KEYS if k in config}
    retry = {}
    if "max_retries" in config:
        retry["max_retries"] = int(config.pop("max_retries"))
    backoff = {}
    if "retry_backoff" in config:
        backoff["init_backoff"] = _seconds(config.pop("retry_backoff"))
    if "retry_max_backoff" in config:
        backoff["max_backoff"] = _seconds(config.pop("retry_max_backoff"))
    if backoff:
        retry["backoff"] = backoff
    if "retry_timeout" in config:
        retry["retry_timeout"] = _seconds(config.pop("retry_timeout"))
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if url.startswith("s3://") and str(endpoint).startswith("http://"):
        client["allow_http"] = True
    return config, client, retry


def _store_spec(url: str, storage_options) -> tuple:
    """What :func:`.client.open_store` needs (picklable: a helper process opens it too)."""
    if not is_remote(url):
        if storage_options:
            raise InvalidArgumentError(f"storage_options are for object-store URLs, not the local folder {url!r}")
        path = url[len("file://"):] if url.startswith("file://") else url
        os.makedirs(path, exist_ok=True)
        return ("local", os.path.abspath(path))
    return ("url", url, *_split_options(url, storage_options))


def _import_obstore():
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        raise ImportError("remote caches need obstore: pip install 'latentfast[s3]'") from exc


class ObjectFolder:
    """The objects under ``url``; names are relative to it (``"train.latents.f16.dat"``).

    Picklable (DataLoader workers): the client is made again in each process, on first use. In a
    process forked after this one used the client (DataLoader workers with ``fork``, the default on
    Linux), calls go through a helper process instead (:mod:`.client` says why).
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        _import_obstore()
        self.url = str(url).rstrip("/")
        self._spec = _store_spec(self.url, storage_options)  # bad options fail here, not in a worker
        self.storage_options = dict(storage_options or {})
        self._store, self._pid = None, None

    def __getstate__(self):
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state):
        self.__init__(state["url"], state["storage_options"])

    def __repr__(self) -> str:
        return f"ObjectFolder({self.url!r})"

    @property
    def store(self):
        """This process's obstore store (not for a process forked after the client was used)."""
        if self._store is None or self._pid != os.getpid():
            try:
                self._store, self._pid = client.open_store(self._spec), os.getpid()
            except Exception as exc:  # obstore's configuration errors (unknown key, bad URL) as ours
                raise InvalidArgumentError(f"cannot open object store {self.url!r} with storage_options {sorted(self.storage_options)}: {exc}") from exc
        return self._store

    def where(self, name: str, start: int | None = None, end: int | None = None) -> str:
        """``url/name`` and, when given, ``bytes [start, end)``: how errors name what failed."""
        place = f"{self.url}/{name}"
        return place if start is None else f"{place} bytes [{start}, {end})"

    def _error(self, exc: Exception, name: str, start=None, end=None, version=None):
        helped = isinstance(exc, client.HelperError)
        if exc.replaced if helped else client.is_replaced(exc):
            return RemoteReplacedError(
                f"{self.where(name, start, end)}: replaced since this reader opened it (its version {version} is gone: a "
                f"push replaced the cache); open the cache again to read the new one")
        cls = RemoteNotFoundError if (exc.not_found if helped else client.is_not_found(exc)) else RemoteReadError
        if "TimedOut" in str(exc):  # (the client's message is a page of debug output)
            bounds = ", ".join(f"{k}={self.storage_options[k]} s" if k in self.storage_options else f"{k} the client's default"
                               for k in ("timeout", "retry_timeout"))
            return cls(f"{self.where(name, start, end)}: the endpoint timed out: no answer within {bounds} "
                       f"(storage_options; the CLI's --timeout sets both)")
        return cls(f"{self.where(name, start, end)}: {type(exc).__name__}: {exc}")

    def _call(self, op: str, name: str, *args):
        """A synchronous client call, here or (forked) in the helper; errors name ``name``."""
        try:
            if _forked_after_use():
                return client.helper().call(self._spec, op, *args)
            return client.SYNC_CALLS[op](self.store, *args)
        except InvalidArgumentError:
            raise
        except Exception as exc:
            raise self._error(exc, name) from exc

    async def get_range(self, name: str, start: int, end: int, version: str | None = None):
        """The bytes ``[start, end)`` of ``name`` (a buffer); short answers are the caller's to check.
        ``version`` (from :meth:`head`): of that version only, else :class:`RemoteReplacedError`."""
        try:
            if _forked_after_use():
                return await asyncio.wrap_future(client.helper().submit(self._spec, "get_range", name, int(start), int(end), version))
            return await client.get_range(self.store, name, start, end, version)
        except InvalidArgumentError:
            raise
        except Exception as exc:
            raise self._error(exc, name, start, end, version) from exc

    def get(self, name: str) -> bytes:
        """The whole of a (small) object."""
        return self._call("get", name, name)

    def head(self, name: str) -> tuple[int, str]:
        """``(size, version)``: the version (ETag, else mtime) keys local copies of the object."""
        return self._call("head", name, name)

    def list(self) -> list[str]:
        """Every object name under the folder (recursive), sorted."""
        return self._call("list", "*")

    def list_heads(self) -> dict[str, tuple[int, str]]:
        """Every object under the folder (recursive) and its :meth:`head`, from one listing."""
        return self._call("list_heads", "*")

    def put_file(self, name: str, path: str) -> None:
        """Upload the local file ``path`` as ``name``; multipart above :data:`MULTIPART_BYTES`."""
        self._call("put_file", name, name, path, os.path.getsize(path) > MULTIPART_BYTES)  # read at call time: tests lower it

    def download(self, name: str, path: str) -> tuple[int, str, str]:
        """Stream ``name`` into the new local file ``path`` (fsynced); returns the bytes written, their
        MD5 (hex) and the object's ETag."""
        return self._call("download", name, name, path)

    def delete(self, name: str) -> None:
        self._call("delete", name, name)
