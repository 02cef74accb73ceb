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
``http://`` endpoints are allowed (loopback MinIO, moto, s3rver).
"""
from __future__ import annotations

import datetime
import os

from ...errors import InvalidArgumentError
from .errors import RemoteForkError, RemoteNotFoundError, RemoteReadError

_ALIASES = {"endpoint_url": "endpoint", "key": "access_key_id", "aws_access_key_id": "access_key_id",
            "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
            "region_name": "region", "token": "session_token", "aws_session_token": "session_token"}
_CLIENT_KEYS = ("timeout", "connect_timeout")
_RETRY_KEYS = ("max_retries", "retry_backoff", "retry_max_backoff", "retry_timeout")
MULTIPART_BYTES = 64 << 20  # files above this upload in parts (obstore's 5 MiB parts, 12 at once)
_client_started_in = {"pid": None}  # inherited by a fork: how a child knows the parent's runtime is dead


def _runtime_here() -> None:
    """obstore's tokio runtime does not survive ``fork()``: a forked child that calls it hangs for
    ever (tokio-rs/tokio#4301). Fail clearly instead, and say what works."""
    pid = _client_started_in["pid"]
    if pid is None:
        _client_started_in["pid"] = os.getpid()
    elif pid != os.getpid():
        raise RemoteForkError(
            f"this process was forked from process {pid} after it used the object-store client (obstore), whose "
            "runtime does not survive fork(): start DataLoader workers with multiprocessing_context='spawn' or "
            "'forkserver', or make the parent touch no remote cache before the workers start")


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


def _open_store(url: str, storage_options):
    import obstore.store

    if not is_remote(url):
        if storage_options:
            raise InvalidArgumentError(f"storage_options are for object-store URLs, not the local folder {url!r}")
        path = url[len("file://"):] if url.startswith("file://") else url
        os.makedirs(path, exist_ok=True)
        return obstore.store.LocalStore(os.path.abspath(path))
    config, client, retry = _split_options(url, storage_options)
    try:
        return obstore.store.from_url(url, config=config or None, client_options=client or None, retry_config=retry or None)
    except Exception as exc:  # obstore's configuration errors (unknown key, bad URL) as ours
        raise InvalidArgumentError(f"cannot open object store {url!r} with storage_options {sorted(storage_options or {})}: {exc}") from exc


def _import_obstore():
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        raise ImportError("remote caches need obstore: pip install 'latentfast[s3]'") from exc


class ObjectFolder:
    """The objects under ``url``; names are relative to it (``"train.latents.f16.dat"``).

    Picklable (DataLoader workers): the client is made again in each process, on first use.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        _import_obstore()
        self.url = str(url).rstrip("/")
        _split_options(self.url, storage_options)  # bad options fail here, not in a worker
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
        _runtime_here()
        if self._store is None or self._pid != os.getpid():
            self._store, self._pid = _open_store(self.url, self.storage_options), os.getpid()
        return self._store

    def where(self, name: str, start: int | None = None, end: int | None = None) -> str:
        """``url/name`` and, when given, ``bytes [start, end)``: how errors name what failed."""
        place = f"{self.url}/{name}"
        return place if start is None else f"{place} bytes [{start}, {end})"

    def _error(self, exc: Exception, name: str, start=None, end=None) -> RemoteReadError:
        import obstore.exceptions as oe

        cls = RemoteNotFoundError if isinstance(exc, (oe.NotFoundError, FileNotFoundError)) else RemoteReadError
        return cls(f"{self.where(name, start, end)}: {type(exc).__name__}: {exc}")

    async def get_range(self, name: str, start: int, end: int):
        """The bytes ``[start, end)`` of ``name`` (a buffer); short answers are the caller's to check."""
        import obstore

        store = self.store  # outside the try: a RemoteForkError stays itself
        try:
            return await obstore.get_range_async(store, name, start=int(start), end=int(end))
        except Exception as exc:
            raise self._error(exc, name, start, end) from exc

    def get(self, name: str) -> bytes:
        """The whole of a (small) object."""
        import obstore

        store = self.store
        try:
            return obstore.get(store, name).bytes().to_bytes()
        except Exception as exc:
            raise self._error(exc, name) from exc

    def head(self, name: str) -> tuple[int, str]:
        """``(size, version)``: the version (ETag, else mtime) keys local copies of the object."""
        import obstore

        store = self.store
        try:
            meta = obstore.head(store, name)
        except Exception as exc:
            raise self._error(exc, name) from exc
        return int(meta["size"]), str(meta.get("e_tag") or meta.get("last_modified"))

    def list(self) -> list[str]:
        """Every object name under the folder (recursive), sorted."""
        import obstore

        store = self.store
        try:
            return sorted(m["path"] for batch in obstore.list(store) for m in batch)
        except Exception as exc:
            raise self._error(exc, "*") from exc

    def put_file(self, name: str, path: str) -> None:
        """Upload the local file ``path`` as ``name``; multipart above :data:`MULTIPART_BYTES`."""
        import obstore

        multipart = os.path.getsize(path) > MULTIPART_BYTES  # read at call time: tests lower it
        store = self.store
        try:
            with open(path, "rb") as fh:
                obstore.put(store, name, fh, use_multipart=multipart)
        except Exception as exc:
            raise self._error(exc, name) from exc

    def delete(self, name: str) -> None:
        import obstore

        store = self.store
        try:
            obstore.delete(store, name)
        except Exception as exc:
            raise self._error(exc, name) from exc
