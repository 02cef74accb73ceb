"""Optional record fields: items without a value of a field (a presence bit per item and field), written,
read, drawn from and imported -- kohya folders with a flipped and an unflipped subset, an image without
its text-encoder file -- and ``require=`` refusing such items before anything is written."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from latentfast import sampling
from latentfast.cache import LatentCache, LatentCacheWriter, inspect_cache, verify_cache
from latentfast.cache.builders.importers import import_latents
from latentfast.cache.feed.loader import batch_loader
from latentfast.cache.cli import main as cache_cli
from latentfast.cache.store import fields as fieldstore
from latentfast.cache.store.shards import write_manifest
from latentfast.cache.trainers import TrainerCacheError, open_source
from latentfast.cache.trainers.fixtures import (KOHYA_TE_SUFFIX, same_bits, simpletuner_text_cache_name, write_ai_toolkit,
                                                write_kohya, write_simpletuner)
from latentfast.errors import AbsentValueError, CacheCorruptError, InvalidArgumentError
from latentfast.testing import spawn_gloo
from test_import_distributed import assert_same_records
from test_trainers_ai_toolkit import get_latent, hashed_path, prompt_embeds_load
from test_trainers_kohya import load_latents_from_disk, load_outputs_npz
from test_trainers_simpletuner import first_textfile_caption

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def records(n=6, seed=0, flipped=lambda i: i % 2 == 0, text=lambda i: i != 1, std=False):
    """Records of ``n`` items: a flipped latent where ``flipped(i)``, a text embedding of its own length where ``text(i)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        r = {"latent": torch.randn(4, 3, 5, generator=g)}
        if std:
            r["latent_std"] = torch.rand(4, 3, 5, generator=g)
        if flipped(i):
            r["latent_flipped"] = torch.randn(4, 3, 5, generator=g)
        if text(i):
            r["text"] = torch.randn(2 + i, 8, generator=g).to(torch.bfloat16)
        out.append((f"item{i}", r))
    return out


def write(folder, items, **options):
    with LatentCacheWriter(folder, **options) as writer:
        for key, record in items:
            writer.append(key, record)
    return LatentCache(folder)


def test_records_lacking_optional_fields_read_back_as_written(tmp_path):
    items = records()
    cache = write(tmp_path, items, optional=("latent_flipped", "text"))
    for i, (_, record) in enumerate(items):
        got = cache.record(i)
        assert set(got) == set(record)  # an absent field is not in the record
        assert all(same_bits(got[k], record[k]) for k in record)
    assert cache.fields["text"]["present"].tolist() == [True, False, True, True, True, True]
    assert cache.fields["latent_flipped"]["present"].tolist() == [i % 2 == 0 for i in range(6)]
    assert cache.fields["text"]["shapes"][1].tolist() == [0, 0]
    assert cache.meta["fields"]["text"]["absent"] == 1 and "text.present" in cache.meta["files"]
    assert verify_cache(tmp_path)["rows"] == 6


def test_read_batch_says_which_items_have_a_value_and_zeros_the_others(tmp_path):
    items = records()
    cache = write(tmp_path, items, optional=True)
    batch = cache.read_batch([1, 0, 3], fields=["latent", "latent_flipped", "text"], pad={"text": -1})
    assert batch["latent_flipped_present"].tolist() == [False, True, False]
    assert batch["text_present"].tolist() == [False, True, True]
    assert "latent_present" not in batch  # the latent is never optional
    assert same_bits(batch["latent_flipped"][1], items[0][1]["latent_flipped"])
    assert torch.count_nonzero(batch["latent_flipped"][0]) == 0 and torch.count_nonzero(batch["latent_flipped"][2]) == 0
    assert batch["text_shape"].tolist() == [[0, 0], [2, 8], [5, 8]]
    assert batch["text"].shape == (3, 5, 8) and bool((batch["text"][0] == -1).all())  # absent: all padding
    assert same_bits(batch["text"][2], items[3][1]["text"])
    plain = cache.read_batch([1, 2], fields=["text"], pad={"text": 0})
    assert plain["text"][0].count_nonzero() == 0
    packed = cache.read_batch([1, 2, 3], fields=["text"], packed=["text"])
    assert packed["text_present"].tolist() == [False, True, True]
    assert same_bits(packed["text"], torch.cat([items[2][1]["text"], items[3][1]["text"]]))


def test_a_field_may_first_appear_in_a_later_record(tmp_path):
    items = records(n=4, flipped=lambda i: i >= 2, text=lambda i: True)
    cache = write(tmp_path, items, optional=["latent_flipped"])
    assert cache.fields["latent_flipped"]["present"].tolist() == [False, False, True, True]
    assert "present" not in cache.fields["text"]  # every item has it: not optional
    assert same_bits(cache.record(3)["latent_flipped"], items[3][1]["latent_flipped"])


def test_a_field_declared_optional_is_optional_even_when_every_item_has_it(tmp_path):
    cache = write(tmp_path, records(n=3, flipped=lambda i: True, text=lambda i: True), optional="latent_flipped")
    assert cache.fields["latent_flipped"]["present"].all()
    assert "latent_flipped_present" in cache.read_batch([0], fields=["latent_flipped"])


def test_without_optional_a_record_must_have_every_field(tmp_path):
    with LatentCacheWriter(tmp_path) as writer:
        writer.append("a", {"latent": torch.zeros(4, 3, 5), "text": torch.zeros(2, 8)})
        with pytest.raises(InvalidArgumentError, match=r"key 'b' has the fields \[\].*\['text'\] are not optional.*optional="):
            writer.append("b", {"latent": torch.zeros(4, 3, 5)})
        with pytest.raises(InvalidArgumentError, match=r"key 'c'.*\['extra'\] are not optional"):
            writer.append("c", {"latent": torch.zeros(4, 3, 5), "text": torch.zeros(2, 8), "extra": torch.zeros(1)})
    cache = LatentCache(tmp_path)
    assert "present" not in cache.fields["text"] and not os.path.exists(fieldstore.field_path(tmp_path, "train", "text", "present"))
    with LatentCacheWriter(tmp_path / "named", optional=["text"]) as writer:
        writer.append("a", {"latent": torch.zeros(4, 3, 5), "text": torch.zeros(2, 8)})
        with pytest.raises(InvalidArgumentError, match=r"\['other'\] are not optional"):
            writer.append("b", {"latent": torch.zeros(4, 3, 5), "other": torch.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="every record has its 'latent'"):
        LatentCacheWriter(tmp_path / "bad", optional=["latent"])


def test_old_caches_read_as_every_item_having_every_field(tmp_path):
    """A cache written without optional fields (as before they existed): no presence file, no ``_present``."""
    cache = write(tmp_path, records(n=3, flipped=lambda i: True, text=lambda i: True))
    assert not any(name.endswith(".present.npy") for name in os.listdir(tmp_path))
    assert all("optional" not in e for e in cache.meta["fields"].values())
    batch = cache.read_batch([0, 2], fields=["latent", "latent_flipped", "text"], pad={"text": 0})
    assert not any(k.endswith("_present") for k in batch)
    assert cache.read_batch([0, 1, 2], fields=["latent"], flip=1.0, seed=3)["flipped"].all()


def test_an_interrupted_write_with_absent_values_resumes_to_the_same_cache(tmp_path):
    items = records(n=8)
    whole = write(tmp_path / "whole", items, optional=True)
    writer = LatentCacheWriter(tmp_path / "resumed", optional=True, flush_every=2)
    for key, record in items[:5]:
        writer.append(key, record)
    writer.close()
    with LatentCacheWriter(tmp_path / "resumed", optional=True) as writer:
        assert writer.resumed and writer.keys == [k for k, _ in items[:5]]
        for key, record in items[5:]:
            writer.append(key, record)
    resumed = LatentCache(tmp_path / "resumed")
    for name in ("latent_flipped", "text"):
        for kind in ("spans", "crc", "present"):
            with open(fieldstore.field_path(whole.cache_dir, "train", name, kind), "rb") as a, \
                    open(fieldstore.field_path(resumed.cache_dir, "train", name, kind), "rb") as b:
                assert a.read() == b.read(), (name, kind)


def test_a_damaged_or_missing_presence_file_is_named(tmp_path):
    write(tmp_path, records(), optional=True)
    path = fieldstore.field_path(tmp_path, "train", "text", "present")
    np.save(path, np.ones(6, dtype=bool))  # every item "present": the counts and the CRC disagree
    with pytest.raises(CacheCorruptError, match=r"train\.field\.text\.present\.npy must be bool \[6\] with 1 items absent"):
        LatentCache(tmp_path)
    os.remove(path)
    with pytest.raises(FileNotFoundError, match=r"field 'text' presence file .*train\.field\.text\.present\.npy does not exist"):
        LatentCache(tmp_path)


def test_a_presence_file_with_right_counts_but_other_bits_fails_its_crc(tmp_path):
    write(tmp_path, records(), optional=True)
    path = fieldstore.field_path(tmp_path, "train", "latent_flipped", "present")
    bits = np.load(path)
    np.save(path, bits[::-1].copy())  # same count of absent items, other items
    with pytest.raises(CacheCorruptError, match="latent_flipped.present file .* fails its CRC-32"):
        LatentCache(tmp_path)


def test_flip_draws_only_among_items_that_have_a_flipped_latent(tmp_path):
    items = records(n=12, flipped=lambda i: i % 3 != 0)
    cache = write(tmp_path, items, optional=True)
    index = list(range(12))
    seeds = sampling.item_seeds(cache.keys, 7, 1)
    for p in (1.0, 0.5):
        batch = cache.read_batch(index, fields=["latent"], flip=p, seed=7, epoch=1)
        want = sampling.flip_draws(seeds, p) & torch.tensor([i % 3 != 0 for i in index])
        assert torch.equal(batch["flipped"], want)
        for i in index:
            source = items[i][1]["latent_flipped" if want[i] else "latent"]
            assert same_bits(batch["latent"][i], source)


def test_a_draw_reading_a_value_an_item_lacks_names_the_key_and_field(tmp_path):
    items = records(n=4, std=True)
    items[2][1].pop("latent_std")
    cache = write(tmp_path, items, optional=True)
    cache.read_batch([0, 1, 3], fields=["latent"], sample=True, seed=0)
    with pytest.raises(AbsentValueError, match=r"'latent_std' of indices\[1\] = 2 \(key 'item2'\)"):
        cache.read_batch([0, 2], fields=["latent"], sample=True, seed=0)
    with pytest.raises(AbsentValueError, match="item 2 has no value of the optional field 'latent_std'"):
        cache.field_items["latent_std"].value(2)


def test_a_sharded_cache_joins_its_shards_presence(tmp_path):
    items = records(n=6)
    write(tmp_path / "a", items[:3], optional=True)
    write(tmp_path / "b", items[3:], optional=True)  # every item of b has its text: not optional there
    write_manifest(tmp_path / "joined", "train", [str(tmp_path / "a"), str(tmp_path / "b")])
    joined = LatentCache(tmp_path / "joined")
    batch = joined.read_batch([1, 4, 0], fields=["latent_flipped", "text"], pad={"text": 0})
    assert batch["text_present"].tolist() == [False, True, True]
    assert batch["latent_flipped_present"].tolist() == [False, True, True]
    assert same_bits(batch["latent_flipped"][1], items[4][1]["latent_flipped"])
    assert set(joined.record(1)) == {"latent"}


# ---- imports: kohya folders whose subsets differ -------------------------------------------------
def kohya_subsets(folder):
    """One training folder, two subsets (kohya caches beside each subset's images): ``flipped`` with
    flip_aug and alpha_mask, ``plain`` without, one of whose images has no ``_te_outputs.npz``."""
    write_kohya(folder / "flipped", arch="sdxl", n=3, flip=True, alpha=True)
    write_kohya(folder / "plain", arch="sdxl", n=2, flip=False, alpha=False, seed=1, without_text=(1,))


def test_a_kohya_folder_of_mixed_subsets_imports_whole_as_kohyas_loaders_read_it(tmp_path):
    """Before optional fields this import stopped half-way with the writer's field-set message naming no file."""
    src = tmp_path / "src"
    kohya_subsets(src)
    stats = {}
    import_latents(src, tmp_path / "out", format="kohya", quiet=True, stats=stats)
    cache = LatentCache(tmp_path / "out")
    assert cache.keys == ["flipped/img_000", "flipped/img_001", "flipped/img_002", "plain/img_000", "plain/img_001"]
    for i, key in enumerate(cache.keys):
        subset, stem = key.split("/")
        (path,) = [os.path.join(src, subset, f) for f in os.listdir(src / subset) if f.startswith(stem) and f.endswith("_sdxl.npz")]
        latents, original_size, crop_ltrb, flipped, alpha = load_latents_from_disk(None, path, None)
        record, info = cache.record(i), cache.info(i)
        assert same_bits(record["latent"], torch.from_numpy(latents))
        assert info["original_size"] == original_size and info["crop_ltrb"] == crop_ltrb
        for name, want in (("latent_flipped", flipped), ("alpha_mask", alpha)):
            assert (name in record) == (want is not None)
            assert want is None or same_bits(record[name], torch.from_numpy(want))
        te = os.path.join(src, subset, stem + KOHYA_TE_SUFFIX["sdxl"])
        texts = {k for k in record if k.startswith("text_")}
        if os.path.exists(te):
            outputs = load_outputs_npz("sdxl", te)
            assert texts == {f"text_{n}" for n in outputs}
            assert all(same_bits(record[f"text_{n}"], torch.from_numpy(a)) for n, a in outputs.items())
        else:
            assert texts == set() and key == "plain/img_001"
    lacking = {(k, f) for k, f, _ in stats["lacking"]}
    assert lacking == {("plain/img_000", "latent_flipped"), ("plain/img_001", "latent_flipped"), ("plain/img_000", "alpha_mask"),
                       ("plain/img_001", "alpha_mask"), ("plain/img_001", "text_*")}
    assert "2 without latent_flipped" in stats["summary"] and "1 without text-encoder outputs" in stats["summary"]
    assert str(src / "plain" / "img_001_te_outputs.npz") in {w for _, _, w in stats["lacking"]}
    flipped = [bool(cache.read_batch([i], fields=["latent"], flip=1.0, seed=0)["flipped"]) for i in range(5)]
    assert flipped == [True] * 3 + [False] * 2  # the plain subset never flips, as kohya's flip_aug=False
    again = {}
    import_latents(src, tmp_path / "out", format="kohya", quiet=True, stats=again)
    assert again["unchanged"]


def test_require_refuses_every_lacking_item_naming_its_file_before_writing(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    kohya_subsets(src)
    with pytest.raises(TrainerCacheError) as caught:
        import_latents(src, out, format="kohya", quiet=True, require=["text", "latent_flipped"])
    message = str(caught.value)
    assert "3 items lack a required field; nothing was written" in message
    assert f"plain/img_001: no text (no {src / 'plain' / 'img_001_te_outputs.npz'})" in message
    for stem in ("img_000", "img_001"):
        assert f"plain/{stem}: no latent_flipped (no {src / 'plain'}/{stem}_" in message
    assert not out.exists()
    import_latents(src, out, format="kohya", quiet=True)  # without require: the same folder imports whole
    assert len(LatentCache(out)) == 5
    with pytest.raises(InvalidArgumentError, match="require must name record fields"):
        import_latents(src, out, format="kohya", quiet=True, require=["not a field"])
    with pytest.raises(InvalidArgumentError, match="require="):
        import_latents(src, out, format="npz", quiet=True, require="text")


def test_require_of_a_field_every_item_has_imports(tmp_path):
    write_kohya(tmp_path / "src", arch="sdxl", n=2, flip=True)
    import_latents(tmp_path / "src", tmp_path / "out", format="kohya", quiet=True, require=["text", "latent_flipped"])
    assert all("present" not in f for f in LatentCache(tmp_path / "out").fields.values())


def test_require_of_a_text_output_only_the_files_show_refuses_the_item_before_writing_it(tmp_path):
    """An item whose text file holds fewer outputs than required is found only when read: refused before it is written."""
    write_kohya(tmp_path / "src", arch="sdxl", n=3)
    te = tmp_path / "src" / "img_001_te_outputs.npz"
    arrays = dict(np.load(te))
    del arrays["pool2"]
    np.savez(te, **arrays)
    with pytest.raises(TrainerCacheError, match=r"item 'img_001' has no 'text_pool2'"):
        import_latents(tmp_path / "src", tmp_path / "out", format="kohya", quiet=True, require="text_pool2")
    assert len(open_source(tmp_path / "src", "kohya")) == 3


def test_cli_lists_lacking_items_and_require_refuses_them(tmp_path, capsys):
    src, out = tmp_path / "src", str(tmp_path / "out")
    kohya_subsets(src)
    assert cache_cli(["cache", "import", str(src), "--out", out, "--format", "kohya", "--require", "text"]) == 1
    err = capsys.readouterr().err
    assert "plain/img_001: no text" in err and "img_001_te_outputs.npz" in err and not os.path.exists(out)
    assert cache_cli(["cache", "import", str(src), "--out", out, "--format", "kohya"]) == 0
    printed = capsys.readouterr().out
    assert f"  plain/img_001: no text_* (no {src / 'plain' / 'img_001_te_outputs.npz'})" in printed
    assert "plain/img_000: no latent_flipped" in printed


def test_a_shard_whose_items_all_lack_an_optional_field_joins_as_absent_items(tmp_path):
    items = records(n=6, flipped=lambda i: i < 3)
    write(tmp_path / "a", items[:3], optional=True)
    write(tmp_path / "b", items[3:], optional=True)  # no item of b has a latent_flipped: b has no such field
    assert "latent_flipped" not in LatentCache(tmp_path / "b").fields
    write_manifest(tmp_path / "joined", "train", [str(tmp_path / "a"), str(tmp_path / "b")])
    joined = LatentCache(tmp_path / "joined")
    assert joined.fields["latent_flipped"]["present"].tolist() == [True] * 3 + [False] * 3
    assert joined.meta["fields"]["latent_flipped"]["absent"] == 3
    batch = joined.read_batch([4, 0], fields=["latent", "latent_flipped"])
    assert batch["latent_flipped_present"].tolist() == [False, True]
    assert torch.count_nonzero(batch["latent_flipped"][0]) == 0 and same_bits(batch["latent_flipped"][1], items[0][1]["latent_flipped"])
    assert joined.read_batch([3, 4, 5, 0], fields=["latent"], flip=1.0, seed=1)["flipped"].tolist() == [False] * 3 + [True]
    assert verify_cache(tmp_path / "joined")["rows"] == 6
    assert inspect_cache(tmp_path / "joined")["fields"]["latent_flipped"]["logical_bytes"] == 3 * 4 * 3 * 5 * 4
    write(tmp_path / "named", items[:3], optional=("latent_flipped", "text"))
    with LatentCacheWriter(tmp_path / "c") as writer:  # a field neither cache lets items lack must be in both
        for key, record in records(n=2, flipped=lambda i: False, text=lambda i: False, std=True):
            writer.append(key + "c", record)
    with pytest.raises(InvalidArgumentError, match="different encoders, geometry, fields or latent conventions"):
        write_manifest(tmp_path / "bad", "train", [str(tmp_path / "named"), str(tmp_path / "c")])


def _rank_imports_subsets(rank: int, world: int, src: str, out: str):
    import torch.distributed as dist

    stats = {}
    import_latents(src, out, format="kohya", quiet=True, stats=stats, group=dist.group.WORLD)
    return stats["lacking"]


@pytest.mark.timeout(240)
def test_a_distributed_import_of_mixed_subsets_reads_as_a_one_process_import(tmp_path):
    src = tmp_path / "src"
    kohya_subsets(src)
    lacking = spawn_gloo(_rank_imports_subsets, 2, str(src), str(tmp_path / "dist"), timeout_s=120)
    import_latents(src, tmp_path / "single", format="kohya", quiet=True)
    single, sharded = LatentCache(tmp_path / "single"), LatentCache(tmp_path / "dist")
    assert sorted(sharded.fields) == sorted(single.fields)
    assert_same_records(single, sharded)
    for name in ("latent_flipped", "alpha_mask", "text_pool2"):
        assert sharded.fields[name]["present"].tolist() == single.fields[name]["present"].tolist()
    assert lacking[0] == lacking[1] and len(lacking[0]) == 5  # the whole folder's, on every rank


def test_ai_toolkit_datasets_with_and_without_flips_and_text_import_whole(tmp_path):
    """ai-toolkit sets flip_x and cache_text_embeddings per dataset folder: one root holding three of them."""
    src = tmp_path / "src"
    made = {"flipped": write_ai_toolkit(src / "flipped", n=2, resolutions=(256,), flip_x=True),
            "plain": write_ai_toolkit(src / "plain", n=2, resolutions=(256,), flip_x=False, seed=1),
            "untexted": write_ai_toolkit(src / "untexted", n=1, resolutions=(256,), flip_x=True, text=False, seed=2)}
    stats = {}
    import_latents(src, tmp_path / "out", format="ai-toolkit", quiet=True, stats=stats)
    cache = LatentCache(tmp_path / "out")
    assert len(cache) == 5
    for dataset, manifest in made.items():
        for entry in manifest:
            record = cache.record(cache.index(f"{dataset}/{entry['stem']}"))
            for info in entry["latent_infos"]:
                latent = get_latent(hashed_path(src / dataset, "_latent_cache", entry["stem"], info))
                assert same_bits(record["latent_flipped" if info.get("flip_x") else "latent"], latent)
            assert ("latent_flipped" in record) == (dataset != "plain")
            if dataset == "untexted":
                assert not any(k.startswith("text_") for k in record)
            else:
                text, pooled, mask = prompt_embeds_load(hashed_path(src / dataset, "_t_e_cache", entry["stem"], entry["te_infos"][0]))
                assert same_bits(record["text_text_embed"], text) and same_bits(record["text_pooled_embed"], pooled)
                assert same_bits(record["text_attention_mask"], mask)
    lacking = sorted((k, f) for k, f, _ in stats["lacking"])
    assert lacking == [("plain/img_000", "latent_flipped"), ("plain/img_001", "latent_flipped"), ("untexted/img_000", "text_*")]
    with pytest.raises(TrainerCacheError, match=r"untexted/img_000: no text \(no .*untexted/_t_e_cache/img_000_\{hash\}\.safetensors\)"):
        import_latents(src, tmp_path / "strict", format="ai-toolkit", quiet=True, require="text")


def test_a_simpletuner_item_whose_text_embedding_is_missing_is_listed_with_the_file_it_lacks(tmp_path):
    cache, images = tmp_path / "cache", tmp_path / "images"
    write_simpletuner(str(cache), str(images), n=3, compress=False)
    missing = simpletuner_text_cache_name(first_textfile_caption(images / "img_002.txt"), "flux")
    os.remove(cache / "text" / missing)  # its caption was never encoded
    stats = {}
    import_latents(cache, tmp_path / "out", format="simpletuner", images=str(images), quiet=True, stats=stats)
    ((key, field, where),) = stats["lacking"]
    assert (key, field) == ("img_002", "text_*") and missing in where
    out = LatentCache(tmp_path / "out")
    assert out.fields["text_prompt_embeds"]["present"].tolist() == [k != "img_002" for k in out.keys]


def test_inspect_counts_the_items_without_a_value(tmp_path, capsys):
    write(tmp_path, records(), optional=True)
    info = inspect_cache(tmp_path)
    assert info["fields"]["text"]["absent"] == 1 and info["fields"]["latent_flipped"]["absent"] == 3
    assert "train.field.text.present.npy" in info["files"]
    assert cache_cli(["cache", "inspect", str(tmp_path)]) == 0
    assert "optional: 3 items without" in capsys.readouterr().out


def test_dataloader_workers_read_the_presence_bits(tmp_path):
    items = records(n=8)
    cache = write(tmp_path, items, optional=True)
    loader = batch_loader(cache, [[0, 1, 2], [5, 6, 7]], fields=["latent", "latent_flipped", "text"], pad={"text": 0},
                          flip=0.5, seed=4, num_workers=2, multiprocessing_context="spawn", lookahead=0)
    for batch in loader:
        index = batch["index"].tolist()
        assert batch["text_present"].tolist() == [i != 1 for i in index]
        assert batch["latent_flipped_present"].tolist() == [i % 2 == 0 for i in index]
        assert not (batch["flipped"] & ~batch["latent_flipped_present"]).any()
        assert torch.equal(batch["latent"], cache.read_batch(index, fields=["latent"], flip=0.5, seed=4)["latent"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_batch_of_optional_fields_equals_the_cpu_batch(tmp_path):
    cache = write(tmp_path, records(n=6), optional=True)
    kw = {"fields": ["latent", "latent_flipped", "text"], "pad": {"text": 0}}
    for index in ([1, 0, 3], [1], [0, 2, 4]):
        cpu, gpu = cache.read_batch(index, **kw), cache.read_batch(index, device="cuda", **kw)
        assert cpu.keys() == gpu.keys()
        for name in cpu:
            assert same_bits(gpu[name].cpu(), cpu[name]), name
        drawn = cache.read_batch(index, device="cuda", fields=["latent"], flip=1.0, seed=0)
        assert same_bits(drawn["latent"].cpu(), cache.read_batch(index, fields=["latent"], flip=1.0, seed=0)["latent"])


def test_spans_giving_an_absent_item_bytes_are_refused(tmp_path):
    write(tmp_path, records(), optional=True)
    path = fieldstore.field_path(tmp_path, "train", "text", "spans")
    spans = np.load(path)
    for column, value in ((1, 2), (0, 1 << 40)):
        damaged = spans.copy()
        damaged[1, column] = value  # item 1 has no text
        np.save(path, damaged)
        with pytest.raises(CacheCorruptError, match="an item its presence file says has no value"):
            LatentCache(tmp_path)


def test_a_batch_of_present_values_of_several_shapes_names_them_at_their_places(tmp_path):
    cache = write(tmp_path, records(), optional=True)
    with pytest.raises(InvalidArgumentError, match=r"field 'text': the batch's items have 2 shapes: \[2, 8\] \(indices\[1\] = 0\), "
                                                   r"\[4, 8\] \(indices\[2\] = 2\)"):
        cache.read_batch([1, 0, 2], fields=["text"])
