"""diffusion-pipe shard caches read as records == what diffusion-pipe's own Cache returns, bit for bit."""
import glob
import io
import os
import sqlite3
from collections import defaultdict

import pytest
import torch

from latentfast.cache.trainers import open_source
from latentfast.cache.trainers.fixtures import records_via, same_bits, write_diffusion_pipe


class Cache:
    """utils/cache.py ``Cache`` read side (``init`` without the fingerprint check, ``__len__``, ``__getitem__``)."""

    def __init__(self, path):
        self.path = path
        con = sqlite3.connect(os.path.join(path, "metadata.db"))
        self.items = con.execute("SELECT shard, shard_index FROM items").fetchall() or []
        self.shard_metadata = defaultdict(list)
        for (table_name,) in con.execute("SELECT name FROM sqlite_master").fetchall():
            if table_name.startswith("shard_"):
                shard_id = int(table_name.split("_")[-1])
                for entry in con.execute(f"SELECT offset, size FROM {table_name}").fetchall():
                    self.shard_metadata[shard_id].append(entry)
        con.close()

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        shard_id, shard_index = self.items[idx]
        offset, size = self.shard_metadata[shard_id][shard_index]
        with open(os.path.join(self.path, f"shard_{shard_id}.bin"), "rb") as f:
            f.seek(offset)
            byte_string = f.read(size)
        return torch.load(io.BytesIO(byte_string), map_location="cpu")


@pytest.mark.parametrize("via", ["reader", "import", "auto"])
def test_every_field_matches_diffusion_pipes_cache(tmp_path, via):
    """Read by the reader, or imported (format="diffusion-pipe" / "auto") and read back from the cache."""
    folder = tmp_path / "src"
    stems = write_diffusion_pipe(folder, n=3, buckets=((256, 256), (384, 256)), captions=2, shard_size_bytes=6000)
    records = records_via(folder, "diffusion-pipe", via, tmp_path / "out")
    assert len(records) == 3 * 2
    bucket_dirs = sorted(glob.glob(str(folder / "cache" / "flux" / "cache_*")))
    assert len(glob.glob(os.path.join(bucket_dirs[0], "latents", "shard_*.bin"))) > 1  # records span shards
    for bucket_dir in bucket_dirs:
        latents, texts = Cache(os.path.join(bucket_dir, "latents")), Cache(os.path.join(bucket_dir, "text_embeddings_1"))
        te_idx = defaultdict(list)  # utils/dataset.py TextEmbeddingDataset.image_spec_to_te_idx
        for i in range(len(texts)):
            te_idx[tuple(texts[i]["image_spec"])].append(i)
        for i in range(len(latents)):
            item = latents[i]
            stem = os.path.splitext(os.path.basename(item["image_spec"][1]))[0]
            rec = records[f"{stem}@{'x'.join(map(str, item['latents'].shape[1:]))}"]
            assert same_bits(rec.fields["latent"], item["latents"])
            assert rec.info["image_spec"] == list(item["image_spec"]) and rec.info["captions"] == item["caption"]
            expected = {"latent"}
            for caption_number, j in enumerate(te_idx[tuple(item["image_spec"])]):
                for k, v in texts[j].items():
                    if k != "image_spec":
                        name = f"text_{k}" + (f"_c{caption_number}" if caption_number else "")
                        assert same_bits(rec.fields[name], v), name
                        expected.add(name)
            assert set(rec.fields) == expected
    assert {k.split("@")[0] for k in records} == set(stems)


def test_one_bucket_gives_bare_stems_and_masks_are_fields(tmp_path):
    write_diffusion_pipe(tmp_path, n=2, buckets=((256, 256),), captions=1)
    (first, second) = open_source(tmp_path, "diffusion-pipe")
    assert (first.key, second.key) == ("img_000", "img_001")
    assert "mask" not in first.fields  # mask None is absent, not a zero tensor
    assert first.info["bucket"] == "1.000x256x256x1"


def test_truncated_shard_names_the_byte_range(tmp_path):
    write_diffusion_pipe(tmp_path, n=2, buckets=((256, 256),), captions=1, shard_size_bytes=1 << 30)
    (shard,) = glob.glob(str(tmp_path / "cache" / "flux" / "cache_*" / "latents" / "shard_0.bin"))
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[:-100])
    with pytest.raises(ValueError, match=r"shard_0\.bin: expected bytes \d+\.\.\d+ \(record 1\), found a truncated shard"):
        open_source(tmp_path, "diffusion-pipe")


def test_missing_latents_cache_is_explained(tmp_path):
    write_diffusion_pipe(tmp_path, n=1, buckets=((256, 256),), captions=1)
    for path in glob.glob(str(tmp_path / "cache" / "flux" / "cache_*" / "latents" / "*")):
        os.remove(path)
    with pytest.raises(ValueError, match=r"expected diffusion-pipe caches .*found \['text_embeddings_1'\]"):
        open_source(tmp_path, "diffusion-pipe")


def test_scan_reads_only_the_record_pickles(tmp_path, monkeypatch):
    from latentfast.cache.trainers import diffusion_pipe

    write_diffusion_pipe(tmp_path, n=2, buckets=((256, 256), (384, 256)), captions=2)

    def refuse(self, i):
        raise AssertionError("scan read a whole record")

    monkeypatch.setattr(diffusion_pipe.ShardCache, "read", refuse)
    source = open_source(tmp_path, "diffusion-pipe")
    assert source.keys == ["img_000@8x8", "img_001@8x8", "img_000@8x12", "img_001@8x12"]
