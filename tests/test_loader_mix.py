"""LatentLoader over several caches (kohya's subsets with num_repeats, or caches drawn by weight), on real
caches on disk (records, sharded, s3:// on a loopback moto server): each item exactly ``repeats`` times an
epoch in kohya's bucket batches (counted as kohya's ``BaseDataset.make_buckets`` counts them, sd-scripts
library/train_util.py, commit 0005867: each image added to its bucket ``num_repeats`` times, then
``ceil(len(bucket) / batch_size)`` batches a bucket); weights respected (a binomial bound on thousands of
seeded batches); every batch from one cache and one bucket; every read option equal to read_batch;
exact resume mid-epoch (in process and 2 workers, and at another world size); rank and world from a
spawned gloo group; the splits of ``cache build --from-config`` opened with their repeats and flip_aug;
bad input named."""
from __future__ import annotations

import collections
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from latentfast.cache import LatentCache, LatentCacheWriter, LatentLoader, open_dataset, read_batch
from latentfast.cache.feed.mix import cache_seed
from latentfast.cache.store.shards import merge_caches
from latentfast.cli import main
from latentfast.errors import ArgumentTypeError, InvalidArgumentError
from latentfast.testing import spawn_gloo, write_random_cache


def write_cache(folder, n, *, seed, prefix, shapes=((4, 3, 5), (4, 5, 3)), flip=True, text_every=1, dtype=torch.float16):
    """Records of ``n`` items (latent of ``shapes[i % len(shapes)]`` in ``dtype``, its std, a mirror pair where
    ``flip``, a bf16 text of its own length on every ``text_every``-th item (others lack it: an optional
    field), a float32 pooled vector)."""
    gen = torch.Generator().manual_seed(seed)
    with LatentCacheWriter(folder, optional=("text",) if text_every > 1 else None) as writer:
        for i in range(n):
            shape = shapes[i % len(shapes)]
            record = {"latent": torch.randn(shape, generator=gen).to(dtype),
                      "latent_std": torch.rand(shape, generator=gen).to(dtype),
                      "pooled": torch.randn(7, generator=gen)}
            if flip:
                record["latent_flipped"] = torch.randn(shape, generator=gen).to(dtype)
                record["latent_flipped_std"] = torch.rand(shape, generator=gen).to(dtype)
            if i % text_every == 0:
                record["text"] = torch.randn((2 + i % 5, 6), generator=gen).bfloat16()
            writer.append(f"{prefix}{i:03d}", record)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    found = {name: str(root / name) for name in ("a", "b", "c", "noflip", "optional", "bf16", "sharded")}
    write_cache(found["a"], 40, seed=0, prefix="a")  # 2 buckets: 27 and 13 items
    write_cache(found["b"], 25, seed=1, prefix="b", shapes=((4, 3, 5), (4, 4, 4), (4, 5, 3)))  # 3 buckets: 9, 8, 8
    write_cache(found["c"], 40, seed=2, prefix="c")  # as large as a: weights, not sizes, must decide
    write_cache(found["noflip"], 17, seed=3, prefix="n", flip=False)
    write_cache(found["optional"], 15, seed=4, prefix="o", text_every=3)
    write_cache(found["bf16"], 10, seed=5, prefix="h", dtype=torch.bfloat16)
    parts = []
    for k in range(2):
        parts.append(str(root / f"part{k}"))
        write_cache(parts[-1], 11 + k, seed=10 + k, prefix=f"p{k}-")
    merge_caches(parts, found["sharded"])
    found["lines"] = write_random_cache(str(root / "lines"), 30, 4, 3, 11, seed=6)["ragged"]  # a line cache: latents only
    return found


def caches(folders, *names):
    return [LatentCache(folders[name]) for name in names]


def snapshot(batch: dict) -> dict:
    """A batch's values, copied out of the loader's reused buffers."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if not isinstance(a[k], torch.Tensor):
            assert a[k] == b[k], k
            continue
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)), k


def counts_of(batches) -> collections.Counter:
    """How often each (cache, item) was read."""
    return collections.Counter((b["source"], i) for b in batches for i in b["index"].tolist())


def kohya_batch_count(mixed, repeats, batch_size) -> int:
    """The batches of an epoch as kohya's BaseDataset.make_buckets counts them, one bucket manager per
    subset: every image appended to its bucket num_repeats times, ceil(len(bucket) / batch_size) each."""
    total = 0
    for cache, r in zip(mixed, repeats):
        buckets = collections.defaultdict(list)
        for i, shape in enumerate(map(tuple, cache.shapes.tolist())):
            for _ in range(r):
                buckets[shape].append(i)
        total += sum(int(math.ceil(len(bucket) / batch_size)) for bucket in buckets.values())
    return total


def test_repeats_list_each_caches_items_that_many_times_in_kohyas_bucket_batches(folders):
    mixed = caches(folders, "a", "b")
    loader = LatentLoader(mixed, 4, repeats=[3, 1], seed=2)
    epochs = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = [snapshot(b) for b in loader]
        assert len(batches) == len(loader) == kohya_batch_count(mixed, [3, 1], 4)
        counts = counts_of(batches)
        assert counts == collections.Counter({(s, i): r for s, r in ((0, 3), (1, 1)) for i in range(len(mixed[s]))})
        short = collections.Counter()
        for batch in batches:  # one cache, one bucket; at most one short batch per (cache, bucket), as kohya's
            shapes = {tuple(s) for s in mixed[batch["source"]].shapes[batch["index"].numpy()].tolist()}
            assert len(shapes) == 1
            short[(batch["source"], *shapes)] += len(batch["index"]) < 4
            assert_same({k: v for k, v in batch.items() if k not in ("index", "source")},
                        read_batch(mixed[batch["source"]], batch["index"], fields=("latent",)))
        assert max(short.values()) <= 1
        assert {b["source"] for b in batches[:10]} == {0, 1}  # the caches' batches shuffled together
        epochs.append([(b["source"], b["index"].tolist()) for b in batches])
    assert epochs[0] != epochs[1]
    again = LatentLoader(mixed, 4, repeats=[3, 1], seed=2)
    again.set_epoch(1)
    assert [(b["source"], b["index"].tolist()) for b in again] == epochs[1]  # deterministic by (seed, epoch)
    other = LatentLoader(mixed, 4, repeats=[3, 1], seed=3)
    assert [(b["source"], b["index"].tolist()) for b in other] != epochs[0]
    ordered = [(b["source"], b["index"].tolist()) for b in LatentLoader(mixed, 4, repeats=[2, 1], shuffle=False)]
    assert [s for s, _ in ordered] == sorted(s for s, _ in ordered)  # cache after cache, each in item order
    assert all(idx == sorted(idx) for _, idx in ordered)
    assert counts_of([{"source": s, "index": torch.tensor(i)} for s, i in ordered]) == collections.Counter(
        {(s, i): r for s, r in ((0, 2), (1, 1)) for i in range(len(mixed[s]))})


def test_drop_last_drops_each_buckets_short_batch(folders):
    mixed = caches(folders, "a", "b")
    loader = LatentLoader(mixed, 4, repeats=[2, 1], drop_last=True, seed=1)
    batches = list(loader)
    assert len(batches) == len(loader) == sum(len(b) // 4 for cache, r in zip(mixed, [2, 1])
                                              for b in _buckets(cache, r).values())
    assert all(len(b["index"]) == 4 for b in batches)


def _buckets(cache, r):
    buckets = collections.defaultdict(list)
    for i, shape in enumerate(map(tuple, cache.shapes.tolist())):
        buckets[shape] += [i] * r
    return buckets


OPTIONS = {
    "latent": {},
    "fields+pad": dict(fields=("latent", "text", "pooled"), pad={"text": 0.0}),
    "pad_to": dict(fields=("latent", "text"), pad={"text": 1.5}, pad_to=9),
    "packed": dict(fields=("latent", "text", "pooled"), packed=("text",)),
    "sample": dict(fields=("latent", "pooled"), sample=True),
    "flip": dict(fields=("latent", "text"), pad={"text": 0.0}, flip=0.5),
    "sample+flip": dict(sample=True, flip=0.5),
    "dtype": dict(fields=("latent", "text"), pad={"text": 0.0}, dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_read_option_through_a_mix_equals_read_batch(folders, name):
    mixed = caches(folders, "a", "sharded")
    options = OPTIONS[name]
    loader = LatentLoader(mixed, 4, seed=3, repeats=[2, 1], **options)
    loader.set_epoch(2)
    batches = [snapshot(b) for b in loader]
    assert counts_of(batches) == collections.Counter({(s, i): r for s, r in ((0, 2), (1, 1)) for i in range(len(mixed[s]))})
    for batch in batches:
        index, source = batch.pop("index"), batch.pop("source")
        spec = {**options, "fields": options.get("fields", ("latent",))}
        if options.get("sample") or options.get("flip") is not None:
            spec.update(seed=cache_seed(3, source), epoch=2)  # each cache draws with its own seed
        assert_same(batch, read_batch(mixed[source], index, **spec))


def test_a_flip_per_cache_reads_the_unflipped_ones_as_never_flipped(folders):
    mixed = caches(folders, "a", "noflip")
    loader = LatentLoader(mixed, 4, seed=1, flip=[0.5, None], fields=("latent", "pooled"))
    flips = collections.defaultdict(list)
    for batch in loader:
        flips[batch["source"]] += batch["flipped"].tolist()
        expected = read_batch(mixed[batch["source"]], batch["index"], fields=("latent", "pooled"),
                              **(dict(flip=0.5, seed=cache_seed(1, 0)) if batch["source"] == 0 else {}))
        expected.setdefault("flipped", torch.zeros(len(batch["index"]), dtype=torch.bool))
        assert_same({k: v for k, v in batch.items() if k not in ("index", "source")}, expected)
    assert not any(flips[1]) and 0 < sum(flips[0]) < len(flips[0])


def test_an_optional_field_has_its_presence_in_every_batch(folders):
    mixed = caches(folders, "optional", "a")
    options = dict(fields=("latent", "text"), pad={"text": 0.0})
    seen = set()
    for batch in LatentLoader(mixed, 3, seed=0, **options):
        expected = read_batch(mixed[batch["source"]], batch["index"], **options)
        if batch["source"] == 1:  # every item of a has its text: present, filled in
            assert "text_present" not in expected
            expected["text_present"] = torch.ones(len(batch["index"]), dtype=torch.bool)
        assert_same({k: v for k, v in batch.items() if k not in ("index", "source")}, expected)
        seen.add((batch["source"], bool(batch["text_present"].all())))
    assert (0, False) in seen and (1, True) in seen


def test_caches_of_other_latent_dtypes_mix_when_the_read_casts(folders):
    mixed = caches(folders, "a", "bf16")
    batches = list(LatentLoader(mixed, 4, dtype=torch.float32))
    assert {b["latent"].dtype for b in batches} == {torch.float32} and {b["source"] for b in batches} == {0, 1}
    with pytest.raises(InvalidArgumentError, match=r"field 'latent' is torch.bfloat16 .* in caches\[1\] .*bf16.* but torch.float16"):
        LatentLoader(mixed, 4)


def test_a_line_cache_mixes_with_a_shaped_one(folders):
    mixed = caches(folders, "a", "lines")
    batches = [snapshot(b) for b in LatentLoader(mixed, 4, repeats=[1, 2], seed=3)]
    assert counts_of(batches) == collections.Counter({(s, i): r for s, r in ((0, 1), (1, 2)) for i in range(len(mixed[s]))})
    for batch in batches:  # the line cache's batches of similar widths, padded with its white column
        assert_same({k: v for k, v in batch.items() if k not in ("index", "source")},
                    read_batch(mixed[batch["source"]], batch["index"], fields=("latent",)))


def test_weights_draw_each_batchs_cache_in_proportion(folders):
    mixed = caches(folders, "a", "c")  # equal sizes: drawn in proportion to sizes would give 0.5
    per_pass = [len(LatentLoader(c, 4)) for c in mixed]
    for weights in ([0.7, 0.3], [1, 4]):
        loader = LatentLoader(mixed, 4, weights=weights, seed=11)
        assert len(loader) == sum(per_pass)
        sources = []
        for epoch in range(100):
            loader.set_epoch(epoch)
            tasks = loader.sampler.rank_batches()
            sources += [source for source, _, _ in tasks]
            for s in (0, 1):  # a cache's batches pass after pass: within an epoch an item is seen k or k + 1 times
                seen = collections.Counter(i for source, _, idx in tasks if source == s for i in idx)
                counts = [seen[i] for i in range(len(mixed[s]))]
                assert max(counts) - min(counts) <= 1
        p = weights[0] / sum(weights)
        share, sigma = sources.count(0) / len(sources), math.sqrt(p * (1 - p) / len(sources))
        assert abs(share - p) < 4 * sigma, (weights, share, len(sources))
    only_a = LatentLoader(mixed, 4, weights=[1, 0], seed=0)
    batches = list(only_a)  # as many batches as both caches hold, all from a: each item exactly twice
    assert counts_of(batches) == collections.Counter({(0, i): 2 for i in range(40)}) and len(batches) == sum(per_pass)
    assert len({epoch for _, epoch, _ in only_a.sampler.rank_batches()}) == 2  # each pass draws with an epoch of its own


def test_weighted_batches_are_read_with_their_pass_draws(folders):
    mixed = caches(folders, "a", "noflip")
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, sample=True)
    loader = LatentLoader(mixed, 4, weights=[3, 1], seed=4, **options)
    loader.set_epoch(1)
    tasks = loader.sampler.rank_batches()
    for (source, epoch, indices), batch in zip(tasks, [snapshot(b) for b in loader]):
        assert batch.pop("source") == source and batch.pop("index").tolist() == indices
        assert_same(batch, read_batch(mixed[source], indices, seed=cache_seed(4, source), epoch=epoch, **options))


def run(loader, epochs, stop=None):
    """Snapshots of ``loader``'s batches over ``epochs``; with ``stop=(epoch, k)``: until k batches of that
    epoch were taken, returning the state saved then too."""
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        for k, batch in enumerate(loader):
            out.append(snapshot(batch))
            if stop == (epoch, k + 1):
                return out, loader.state_dict()
    return out, None


MIXES = {"repeats": dict(repeats=[2, 1]), "weights": dict(weights=[0.6, 0.4])}


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_resume_mid_epoch_is_exact_with_workers_reading_ahead(folders, workers, mix):
    mixed = caches(folders, "a", "noflip")
    options = dict(seed=7, fields=("latent", "text"), pad={"text": 0.0}, flip=[0.5, None], num_workers=workers, **MIXES[mix])
    whole, _ = run(LatentLoader(mixed, 3, **options), [0, 1])
    first, state = run(LatentLoader(mixed, 3, **options), [0, 1], stop=(0, 5))
    assert state["sampler"]["position"] == 5
    resumed = LatentLoader(mixed, 3, **options)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint's state: plain values
    rest, _ = run(resumed, [0, 1])
    assert len(first) + len(rest) == len(whole)
    for a, b in zip(whole, first + rest):
        assert_same(a, b)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_at_another_world_size_loses_and_repeats_nothing(folders, workers):
    mixed = caches(folders, "a", "b")
    options = dict(seed=2, repeats=[2, 1], fields=("latent", "pooled"), flip=[0.5, None])
    alone = [snapshot(b) for b in LatentLoader(mixed, 4, **options)]  # world 1: the epoch's global list
    before = [LatentLoader(mixed, 4, rank=r, world_size=3, num_workers=workers, **options) for r in range(3)]
    for r, loader in enumerate(before):
        for k, batch in enumerate(loader):
            assert_same(snapshot(batch), alone[k * 3 + r])  # rank r of 3 takes every third batch
            if k + 1 == 3:
                break
    state = before[1].state_dict()  # ranks step together: any rank's state serves
    assert state["sampler"]["position"] == 9
    after = [LatentLoader(mixed, 4, rank=r, world_size=2, num_workers=workers, **options) for r in range(2)]
    rest = alone[9:] + alone[: -len(alone[9:]) % 2]  # the epoch's first batches fill the last round
    for r, loader in enumerate(after):
        loader.load_state_dict(state)
        got = [snapshot(b) for b in loader]
        assert len(got) == len(rest[r::2])
        for a, b in zip(got, rest[r::2]):
            assert_same(a, b)


def _ranks_batches(rank, world_size, paths):
    loader = LatentLoader([LatentCache(p) for p in paths], 4, repeats=[2, 1], seed=5)
    loader.set_epoch(1)
    return loader.rank, loader.world_size, len(loader), [(b["source"], b["index"].tolist()) for b in loader]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rank_and_world_come_from_the_process_group(folders):
    paths = [folders["a"], folders["b"]]
    results = spawn_gloo(_ranks_batches, 2, paths)
    whole = LatentLoader(caches(folders, "a", "b"), 4, repeats=[2, 1], seed=5)
    whole.set_epoch(1)
    epoch = [(b["source"], b["index"].tolist()) for b in whole]
    for r, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        rank, world, count, batches = result
        assert (rank, world, count) == (r, 2, len(batches))
        assert batches == (epoch + epoch[: len(epoch) % 2])[r::2]  # the global list, round robin
    both = [{"source": s, "index": torch.tensor(i)} for s, i in results[0][3] + results[1][3]]
    # disjoint and covering: every item its repeats, plus the one batch that fills the odd last round
    expected = counts_of([{"source": s, "index": torch.tensor(i)} for s, i in epoch + epoch[: len(epoch) % 2]])
    assert counts_of(both) == expected and len(epoch) % 2 == 1


@pytest.mark.timeout(240)
def test_a_mix_with_an_s3_cache_reads_as_the_local_ones(folders, tmp_path):
    pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
    pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")
    from latentfast.cache.remote import push
    from latentfast.testing import create_bucket, s3_options, s3_server

    local = caches(folders, "a", "sharded")
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, flip=0.5, seed=4, repeats=[1, 2])
    expected = [snapshot(b) for b in LatentLoader(local, 4, chunk_window=None, **options)]
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfmix")
        push(folders["a"], "s3://lfmix/a", s3_options(endpoint))
        remote = LatentCache("s3://lfmix/a", storage_options=s3_options(endpoint), local_cache=str(tmp_path / "lc"),
                             local_cache_bytes=1 << 30)
        got = [snapshot(b) for b in LatentLoader([remote, local[1]], 4, chunk_window=None, **options)]
        windowed = LatentLoader([remote, local[1]], 4, **options)  # object storage: that cache's order in chunk windows
        assert windowed.sampler.samplers[0].chunk_window is not None and windowed.sampler.samplers[1].chunk_window is None
        assert counts_of(list(windowed)) == counts_of(expected)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert_same(a, b)


CONFIG = """
[general]
enable_bucket = true
bucket_reso_steps = 32
min_bucket_reso = 64
max_bucket_reso = 256

[[datasets]]
resolution = 128

  [[datasets.subsets]]
  image_dir = "a"
  num_repeats = 3
  flip_aug = true

  [[datasets.subsets]]
  image_dir = "b"

[[datasets]]
resolution = [128, 96]

  [[datasets.subsets]]
  image_dir = "b"
  num_repeats = 2
"""


@pytest.fixture(scope="module")
def config_build(tmp_path_factory):
    """What `latentfast cache build --from-config kohya` writes for CONFIG (two image folders, three subsets)."""
    root = tmp_path_factory.mktemp("config")
    rng = np.random.default_rng(0)
    for folder, sizes in (("a", [(100, 60), (64, 64), (150, 90), (96, 160), (128, 128)]),
                          ("b", [(90, 200), (128, 128), (300, 140), (64, 64), (200, 100), (70, 70)])):
        (root / folder).mkdir()
        for i, (w, h) in enumerate(sizes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / folder / f"im{i}.png")
    (root / "config.toml").write_text(CONFIG)
    assert main(["cache", "build", "--from-config", "kohya", str(root / "config.toml"), "--out", str(root / "out"),
                 "--encoder", "toy", "--quiet"]) == 0
    return root


def test_the_from_config_splits_are_read_with_their_repeats_and_flip_aug(config_build):
    dataset = open_dataset(config_build / "out")
    assert dataset.repeats == [3, 1, 2] and dataset.flip_aug == [True, False, False]
    assert [s["split"] for s in dataset.splits] == ["subset_0", "subset_1", "subset_2"]
    assert open_dataset(config_build / "out" / "dataset.json").repeats == [3, 1, 2]
    loader = dataset.loader(2, flip=0.5, seed=1)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = [snapshot(b) for b in loader]
        assert len(batches) == len(loader) == kohya_batch_count(dataset.caches, dataset.repeats, 2)
        keys = collections.Counter((b["source"], dataset.caches[b["source"]].key(i)) for b in batches
                                   for i in b["index"].tolist())
        assert keys == collections.Counter({(s, key): r for s, (cache, r) in enumerate(zip(dataset.caches, dataset.repeats))
                                            for key in cache.keys})
        for batch in batches:  # one subset, one of kohya's buckets
            cache = dataset.caches[batch["source"]]
            assert len({tuple(cache.info(i)["bucket"]) for i in batch["index"].tolist()}) == 1
            assert batch["source"] == 0 or not batch["flipped"].any()  # only the flip_aug subset flips
            expected = read_batch(cache, batch["index"], fields=("latent",),
                                  **(dict(flip=0.5, seed=cache_seed(1, 0), epoch=epoch) if batch["source"] == 0 else {}))
            assert torch.equal(batch["latent"], expected["latent"])
    plain = dataset.loader(2, weights=[1, 1, 2])
    assert len(plain) == sum(len(LatentLoader(c, 2)) for c in dataset.caches) and "flipped" not in next(iter(plain))


def test_from_config_errors_name_the_file_and_split(config_build, tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"dataset.json does not exist.*--from-config"):
        open_dataset(tmp_path)
    (tmp_path / "dataset.json").write_text('{"splits": "subset_0"}')
    with pytest.raises(InvalidArgumentError, match=r"dataset.json: expected \{'splits'"):
        open_dataset(tmp_path)
    listing = json.loads((config_build / "out" / "dataset.json").read_text())
    listing["splits"][1]["is_reg"] = True  # as a config with `is_reg = true` on its second subset writes it
    (config_build / "out" / "reg.json").write_text(json.dumps(listing))
    with pytest.raises(InvalidArgumentError, match=r"\['subset_1'\] are kohya regularization subsets"):
        open_dataset(config_build / "out" / "reg.json").loader(2)
    listing["splits"][1].update(is_reg=False, num_repeats=0)
    (config_build / "out" / "zero.json").write_text(json.dumps(listing))
    with pytest.raises(InvalidArgumentError, match=r"zero.json: splits\[1\].num_repeats must be an int >= 1"):
        open_dataset(config_build / "out" / "zero.json")
    unflipped = dataclasses.replace(open_dataset(config_build / "out"), flip_aug=[False, False, False])
    with pytest.raises(InvalidArgumentError, match="flip=0.5: no split"):
        unflipped.loader(2, flip=0.5)


def test_bad_input_is_named(folders):
    a, b, noflip = caches(folders, "a", "b", "noflip")
    with pytest.raises(InvalidArgumentError, match="repeats= or weights=, not both"):
        LatentLoader([a, b], 4, repeats=[1, 1], weights=[1, 1])
    with pytest.raises(InvalidArgumentError, match=r"repeats must have one value per cache \(2\), got 3"):
        LatentLoader([a, b], 4, repeats=[1, 2, 3])
    with pytest.raises(InvalidArgumentError, match=r"repeats\[1\] must be an int >= 1, got 0"):
        LatentLoader([a, b], 4, repeats=[1, 0])
    with pytest.raises(ArgumentTypeError, match="repeats must be a list with one value per cache, got int 2"):
        LatentLoader([a, b], 4, repeats=2)
    with pytest.raises(InvalidArgumentError, match=r"weights\[0\] must be finite and >= 0, got -1"):
        LatentLoader([a, b], 4, weights=[-1, 1])
    with pytest.raises(InvalidArgumentError, match=r"weights\[1\] must be finite and >= 0, got nan"):
        LatentLoader([a, b], 4, weights=[1, float("nan")])
    with pytest.raises(InvalidArgumentError, match="weights must not all be 0"):
        LatentLoader([a, b], 4, weights=[0, 0.0])
    with pytest.raises(ArgumentTypeError, match=r"weights\[0\] must be a number, got str"):
        LatentLoader([a, b], 4, weights=["1", 1])
    with pytest.raises(InvalidArgumentError, match=r"caches\[1\] makes no batch of 20 .*17 items, drop_last=True.*weights\[1\]"):
        LatentLoader([a, noflip], 20, weights=[1, 1], drop_last=True)
    with pytest.raises(InvalidArgumentError, match=r"take a list of caches: LatentLoader\(\[cache_a, cache_b\]"):
        LatentLoader(a, 4, repeats=[2])
    with pytest.raises(InvalidArgumentError, match="non-empty list of caches"):
        LatentLoader([], 4)
    with pytest.raises(InvalidArgumentError, match=r"caches\[1\] \(.*noflip split 'train'\) has no field 'latent_flipped'"):
        LatentLoader([a, noflip], 4, flip=0.5)
    with pytest.raises(InvalidArgumentError, match=r"caches\[0\] \(.*noflip.*\) has no field 'latent_flipped' \(its fields: "):
        LatentLoader([noflip, a], 4, fields=("latent", "latent_flipped"))
    with pytest.raises(InvalidArgumentError, match=r"caches\[1\] \(.*lines.*\) has no field 'text'"):
        LatentLoader(caches(folders, "optional", "lines"), 4, fields=("latent", "text"), pad={"text": 0.0})
    with pytest.raises(ArgumentTypeError, match=r"caches\[1\] must be a LatentCache, got str"):
        LatentLoader([a, folders["b"]], 4)
    with pytest.raises(InvalidArgumentError, match=r"flip= as a list must have one probability \(or None\) per cache \(2\)"):
        LatentLoader([a, noflip], 4, flip=[0.5])
    single = LatentLoader(a, 4)
    mix = LatentLoader([a, b], 4, repeats=[2, 1])
    with pytest.raises(InvalidArgumentError, match=r"saved by a loader of one cache \(items=40\); this loader mixes 2 caches"):
        mix.load_state_dict(single.state_dict())
    with pytest.raises(InvalidArgumentError, match=r"saved with repeats=\[2, 1\], this loader has \[3, 1\]"):
        LatentLoader([a, b], 4, repeats=[3, 1]).load_state_dict(mix.state_dict())
    with pytest.raises(InvalidArgumentError, match=r"saved with items=\[40, 25\], this sampler has 40"):
        single.load_state_dict(mix.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_mix_on_the_device_equals_the_host_batches(folders, workers):
    mixed = caches(folders, "a", "noflip")
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, flip=[0.5, None], seed=2, repeats=[2, 1])
    host = [snapshot(b) for b in LatentLoader(mixed, 4, **options)]
    device = [snapshot(b) for b in LatentLoader(mixed, 4, device="cuda", num_workers=workers, **options)]
    assert len(host) == len(device)
    for a, b in zip(host, device):
        assert b["latent"].is_cuda and b["text"].is_cuda
        assert_same(a, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()})
