"""Latent caches in object storage: a folder of objects (local path, ``s3://``, ``gs://``, ``az://``)
read by byte spans -- coalesced concurrent ranged GETs, CRC-32 checked, retried -- through an optional
node-shared local chunk cache, and ``push`` / ``pull`` of whole cache folders.

    reader = RemoteReader("s3://bucket/caches/run1", {"endpoint_url": "http://127.0.0.1:9000"},
                          local_cache="/local/nvme/lf", local_cache_bytes=50 << 30)
    meta = json.loads(reader.folder.get("train.latents.meta.json"))      # small files: whole GETs
    reader.read_spans(names, offsets, lengths, out, dest_offsets, crc32)  # a batch's span table
    reader.prefetch_spans(names, offsets, lengths)                        # the next batch's, ahead

DataLoader workers: the reader pickles (``spawn`` / ``forkserver``) and survives ``fork`` (a worker
forked after the parent used the client makes its calls through a helper process: obstore's runtime
does not survive ``fork()``, see :mod:`.client`).
"""
from .chunks import CHUNK_BYTES, ChunkCache
from .errors import RemoteCorruptError, RemoteNotFoundError, RemoteReadError, RemoteReplacedError
from .reader import COALESCE_BYTES, RemoteReader, coalesce
from .storage import ObjectFolder, is_remote
from .transfer import pull, push

__all__ = ["CHUNK_BYTES", "COALESCE_BYTES", "ChunkCache", "ObjectFolder", "RemoteCorruptError",
           "RemoteNotFoundError", "RemoteReadError", "RemoteReader", "RemoteReplacedError", "coalesce", "is_remote", "pull", "push"]
