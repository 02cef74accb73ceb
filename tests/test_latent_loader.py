"""LatentLoader, the one loader a training loop uses, over real caches on disk (line, shaped, records,
sharded, s3:// on a loopback moto server): every read option equals read_batch; exact mid-epoch
resume (in process and with 2 workers, at the same and at another world size); rank and world from a
spawned gloo group; batches in reused buffers (no allocation per batch in steady state); the per-item
dataset with torch's own DataLoader and DistributedSampler; ReadSpec and read_batch(out=BatchBuffers)."""
from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from latentfast.cache import (BatchBuffers, DevicePrefetcher, LatentCache, LatentCacheWriter, LatentLoader, ReadSpec,
                              collate_records, read_batch)
from latentfast.cache.store.shards import merge_caches
from latentfast.errors import InvalidArgumentError
from latentfast.testing import spawn_gloo, write_random_cache


def write_records(folder, n=40, seed=0, prefix="k"):
    """Records of a float16 latent of two shapes (a shaped cache of 2 buckets), its std and mirror pair
    (for sample / flip), a variable-length bf16 text, a pooled f32 vector and a bool mask of odd length."""
    gen = torch.Generator().manual_seed(seed)
    with LatentCacheWriter(folder) as writer:
        for i in range(n):
            shape = (4, 3, 5) if i % 3 else (4, 5, 3)
            L = 2 + i % 7
            writer.append(f"{prefix}{i:03d}", {"latent": torch.randn(shape, generator=gen).half(),
                                        "latent_std": torch.rand(shape, generator=gen).half(),
                                        "latent_flipped": torch.randn(shape, generator=gen).half(),
                                        "latent_flipped_std": torch.rand(shape, generator=gen).half(),
                                        "text": torch.randn((L, 6), generator=gen).bfloat16(),
                                        "pooled": torch.randn(7, generator=gen),
                                        "mask": torch.rand(2 * L + 1, generator=gen) > 0.5})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    found = write_random_cache(str(root), 45, 2, 3, 11, seed=1)
    found["records"] = str(root / "records")
    write_records(found["records"])
    parts = []
    for k in range(3):
        parts.append(str(root / f"part{k}"))
        write_records(parts[-1], n=9 + k, seed=10 + k, prefix=f"p{k}-")  # a key in two parts is refused
    merge_caches(parts, str(root / "sharded"))
    found["sharded"] = str(root / "sharded")
    return found


def snapshot(batch: dict) -> dict:
    """A batch's values, copied out of the loader's reused buffers."""
    return {k: v.clone() for k, v in batch.items()}


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)), k


def items_of(batches) -> list[int]:
    return sorted(i for b in batches for i in b["index"].tolist())


OPTIONS = {
    "latent": {},
    "fields+pad": dict(fields=("latent", "text", "pooled", "mask"), pad={"text": 0.0, "mask": False}),
    "pad_to": dict(fields=("latent", "text"), pad={"text": 1.5}, pad_to=12),
    "packed": dict(fields=("latent", "text", "pooled"), packed=("text",)),
    "sample": dict(fields=("latent", "pooled"), sample=True),
    "flip": dict(fields=("latent", "text"), pad={"text": 0.0}, flip=0.5),
    "sample+flip": dict(sample=True, flip=0.5),
    "dtype": dict(fields=("latent", "text"), pad={"text": 0.0}, dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("kind", ["records", "sharded"])
def test_every_read_option_through_the_loader_equals_read_batch(folders, kind, name):
    cache = LatentCache(folders[kind])
    options = OPTIONS[name]
    loader = LatentLoader(cache, 4, seed=3, **options)
    loader.set_epoch(2)
    batches = [snapshot(b) for b in loader]
    assert len(batches) == len(loader) and items_of(batches) == list(range(len(cache)))
    spec = {**options, "fields": options.get("fields", ("latent",))}
    if options.get("sample") or options.get("flip") is not None:
        spec.update(seed=3, epoch=2)
    for batch in batches:
        index = batch.pop("index")
        assert index.dtype == torch.int64
        assert_same(batch, read_batch(cache, index, **spec))


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_line_caches_batch_similar_widths_padded_with_white(folders, layout):
    cache = LatentCache(folders[layout])
    batches = [snapshot(b) for b in LatentLoader(cache, 8, seed=1)]
    assert items_of(batches) == list(range(45))
    for batch in batches:
        assert_same({k: v for k, v in batch.items() if k != "index"}, read_batch(cache, batch["index"], fields=("latent",)))


def test_a_shaped_cache_batches_by_shape_and_in_order_without_shuffle(folders):
    cache = LatentCache(folders["records"])
    for batch in LatentLoader(cache, 5, seed=0):
        assert len(set(map(tuple, cache.shapes[batch["index"].numpy()].tolist()))) == 1
    ordered = [b["index"].tolist() for b in LatentLoader(cache, 5, shuffle=False)]
    assert ordered == sorted(ordered) and items_of([{"index": torch.tensor(b)} for b in ordered]) == list(range(40))
    assert all(b == sorted(b) for b in ordered)


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


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_mid_epoch_is_exact_with_workers_reading_ahead(folders, workers):
    cache = LatentCache(folders["records"])
    options = dict(seed=7, fields=("latent", "text"), pad={"text": 0.0}, flip=0.5, num_workers=workers)
    whole, _ = run(LatentLoader(cache, 3, **options), [0, 1])
    first, state = run(LatentLoader(cache, 3, **options), [0, 1], stop=(0, 5))
    resumed = LatentLoader(cache, 3, **options)
    resumed.load_state_dict(state)
    rest, _ = run(resumed, [0, 1])  # set_epoch(0) keeps the loaded position
    assert len(first) + len(rest) == len(whole)
    for a, b in zip(whole, first + rest):
        assert_same(a, b)


def test_a_state_saved_at_an_epochs_end_resumes_to_the_next(folders):
    cache = LatentCache(folders["ragged"])
    loader = LatentLoader(cache, 8)
    list(loader)
    state = loader.state_dict()
    resumed = LatentLoader(cache, 8)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    resumed.set_epoch(1)
    assert items_of(list(resumed)) == list(range(45))
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        LatentLoader(cache, 4).load_state_dict(state)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_at_another_world_size_loses_and_repeats_nothing(folders, workers):
    cache = LatentCache(folders["ragged"])  # 45 items, batches of 3: 15 batches, 5 per rank of 3
    before = [LatentLoader(cache, 3, rank=r, world_size=3, seed=2, num_workers=workers) for r in range(3)]
    taken = []
    for loader in before:
        for k, batch in enumerate(loader):
            taken.append(snapshot(batch))
            if k + 1 == 3:
                break
    state = before[0].state_dict()  # ranks step together: any rank's state serves
    assert state["sampler"]["position"] == 9
    after = [LatentLoader(cache, 3, rank=r, world_size=2, seed=2, num_workers=workers) for r in range(2)]
    for loader in after:
        loader.load_state_dict(state)
    rest = [[snapshot(b) for b in loader] for loader in after]
    assert [len(r) for r in rest] == [3, 3]  # the 6 remaining batches re-split over 2 ranks
    assert items_of(taken + rest[0] + rest[1]) == list(range(45))
    for batch in taken + rest[0] + rest[1]:  # each still read as read_batch reads it
        assert_same({k: v for k, v in batch.items() if k != "index"}, read_batch(cache, batch["index"], fields=("latent",)))


def _ranks_batches(rank, world_size, folder):
    loader = LatentLoader(LatentCache(folder), 4, seed=5)
    loader.set_epoch(1)
    alone = LatentLoader(LatentCache(folder), 4, rank=0, world_size=1)  # explicit arguments override the group's
    return loader.rank, loader.world_size, len(loader), [b["index"].tolist() for b in loader], (alone.rank, alone.world_size)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rank_and_world_come_from_the_process_group(folders):
    results = spawn_gloo(_ranks_batches, 2, folders["ragged"])
    for r, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        rank, world, count, batches, alone = result
        assert (rank, world, count) == (r, 2, len(batches)) and alone == (0, 1)
        explicit = LatentLoader(LatentCache(folders["ragged"]), 4, seed=5, rank=r, world_size=2)
        explicit.set_epoch(1)
        assert batches == [b["index"].tolist() for b in explicit]
    both = results[0][3] + results[1][3]
    # 45 items in batches of 4: 12 batches, 6 per rank, disjoint and covering the epoch
    assert sorted(i for b in both for i in b) == list(range(45))


def test_steady_state_reuses_its_buffers_and_allocates_none(folders):
    cache = LatentCache(folders["records"])
    options = dict(fields=("latent", "text", "mask"), pad={"text": 0.0, "mask": False})
    loader = LatentLoader(cache, 4, hold=2, **options)
    list(loader)  # the first epoch makes the ring's buffers (hold + 1 slots)
    made = sum(slot.allocations for slot in loader._ring)
    ring_ptrs = set().union(*(slot.data_ptrs() for slot in loader._ring))
    loader.set_epoch(1)
    for batch in loader:
        assert {batch[name].data_ptr() for name in ("latent", "text", "mask")} <= ring_ptrs
        assert_same({k: v for k, v in batch.items() if k != "index"}, read_batch(cache, batch["index"], **options))
    assert sum(slot.allocations for slot in loader._ring) == made
    assert len(loader._ring) == 3


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_workers_fill_a_ring_of_shared_buffers(folders):
    cache = LatentCache(folders["records"])
    loader = LatentLoader(cache, 2, num_workers=2, hold=1, fields=("latent", "text"), pad={"text": 0.0})
    ptrs = [b["text"].data_ptr() for b in loader]
    slots = loader.prefetch_factor + 1 + 1  # per worker: in flight, the caller's hold, one more
    assert len(ptrs) == 20 and len(set(ptrs)) <= 2 * slots < len(ptrs)


def count_fds_received(monkeypatch) -> list:
    """Count the file descriptors this process receives from others (how torch sends a worker's
    shared-memory tensor: a descriptor per storage, over a socket); the list grows by one each."""
    from multiprocessing import resource_sharer

    received = []
    detach = resource_sharer.DupFd.detach
    monkeypatch.setattr(resource_sharer.DupFd, "detach", lambda self: received.append(1) or detach(self))
    return received


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_send_each_ring_buffer_once_then_only_its_place(folders, monkeypatch, context):
    # torch would send a handle (a file descriptor over a socket) per tensor per batch: here a buffer's
    # storage crosses once, then batches name their place in the ring
    received = count_fds_received(monkeypatch)
    cache = LatentCache(folders["records"])
    options = dict(fields=("latent", "text"), pad={"text": 0.0})
    loader = LatentLoader(cache, 2, num_workers=2, hold=1, multiprocessing_context=context, **options)
    slots = loader.prefetch_factor + 1 + 1  # per worker (see test_workers_fill_a_ring_of_shared_buffers)
    batches = 0
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            index = batch.pop("index")
            assert_same(batch, read_batch(cache, index, **options))
            batches += 1
    assert batches == 60 and 0 < len(received) <= 2 * slots * 2  # workers x slots x fields, not per batch


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_workers_buffer_that_grows_is_sent_again(folders, monkeypatch):
    from latentfast.cache.feed.loader import _RING_STORAGES

    received = count_fds_received(monkeypatch)
    cache = LatentCache(folders["records"])
    options = dict(fields=("latent", "text"), pad={"text": 0.0})
    loader = LatentLoader(cache, 2, num_workers=2, hold=1, **options)
    loader._reserve = {}  # (no worst-case reserve: a slot's text buffer grows when a longer batch comes round)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            index = batch.pop("index")
            assert_same(batch, read_batch(cache, index, **options))
    assert len(received) > len(_RING_STORAGES[loader._workers.dataset.token])  # some buffers were sent twice


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_persistent_workers_draw_each_epochs_samples(folders):
    cache = LatentCache(folders["records"])
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, sample=True, flip=0.5)
    loader = LatentLoader(cache, 4, seed=6, num_workers=2, **options)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        for batch in loader:
            index = batch.pop("index")
            assert_same(batch, read_batch(cache, index, seed=6, epoch=epoch, **options))
        workers = loader._workers._iterator._workers
        assert epoch == 0 or [w.pid for w in workers] == pids  # the same processes serve every epoch
        pids = [w.pid for w in workers]


def test_without_recycling_every_batch_is_fresh(folders):
    loader = LatentLoader(LatentCache(folders["records"]), 4, recycle=False)
    batches = list(loader)
    assert len({b["latent"].data_ptr() for b in batches}) == len(batches)


def test_read_batch_into_batch_buffers_on_every_path(folders):
    cache = LatentCache(folders["records"])
    same_shape = [1, 2, 4, 5]  # (items 1, 2, 4, 5: one latent shape, for sample)
    for name, options in OPTIONS.items():
        spec = {**options, "fields": options.get("fields", ("latent",))}
        if options.get("sample") or options.get("flip") is not None:
            spec.update(seed=1)
        buffers = BatchBuffers()
        first = snapshot(read_batch(cache, same_shape, out=buffers, **spec))
        made = buffers.allocations
        again = read_batch(cache, same_shape, out=buffers, **spec)
        assert buffers.allocations == made, name
        assert again["latent"].data_ptr() in buffers.data_ptrs(), name
        assert_same(first, again)
        assert_same(first, read_batch(cache, same_shape, **spec))


def test_a_dict_of_outputs_is_written_and_checked(folders):
    cache = LatentCache(folders["records"])
    out = {"text": torch.empty((2, 3, 6), dtype=torch.bfloat16)}  # items 7 and 8: texts of 2 and 3 rows
    batch = read_batch(cache, [7, 8], fields=("latent", "text"), pad={"text": 0.0}, out=out)
    assert batch["text"].data_ptr() == out["text"].data_ptr()
    assert_same(batch, read_batch(cache, [7, 8], fields=("latent", "text"), pad={"text": 0.0}))
    with pytest.raises(InvalidArgumentError, match=r"out\['text'\] must have shape"):
        read_batch(cache, [7, 8], fields=("latent", "text"), pad={"text": 0.0}, out={"text": torch.empty(1)})
    with pytest.raises(InvalidArgumentError, match="BatchBuffers or a dict"):
        read_batch(cache, [7, 8], fields=("latent",), out=torch.empty(1))


def test_read_spec_is_what_the_keywords_build(folders):
    cache = LatentCache(folders["records"])
    spec = ReadSpec(fields="text", pad={"text": 0.0})
    assert spec.fields == ("text",) and spec.records and not spec.draws
    assert_same(read_batch(cache, [0, 3], spec), read_batch(cache, [0, 3], fields=("text",), pad={"text": 0.0}))
    assert spec.at_epoch(0) is spec and spec.at_epoch(3).epoch == 3
    with pytest.raises(InvalidArgumentError, match="not both"):
        read_batch(cache, [0], spec, dtype=torch.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'feilds'"):
        read_batch(cache, [0], feilds=("text",))
    with pytest.raises(InvalidArgumentError, match="cold must be"):
        ReadSpec(cold="sometimes")


def test_a_dataloader_over_the_cache_itself_is_refused_naming_the_ways(folders):
    cache = LatentCache(folders["ragged"])
    with pytest.raises(InvalidArgumentError, match=r"LatentLoader.*cache\.dataset"):
        next(iter(DataLoader(cache, batch_size=4, shuffle=True)))
    assert torch.equal(next(iter(DataLoader(cache, batch_size=None))), cache[0])  # items, unbatched, still work


@pytest.mark.parametrize("options", [dict(fields=("latent", "text", "mask"), pad={"text": 0.0, "mask": False}),
                                     dict(fields=("latent", "text"), packed=("text",)),
                                     dict(fields=("latent", "text"), pad={"text": 2.0}, pad_to=10, flip=0.5, seed=4)])
def test_the_dataset_with_torchs_sampler_and_collate_records_equals_read_batch(folders, options):
    cache = LatentCache(folders["records"])
    dataset = cache.dataset(**options)
    spec = {**options}
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=1)
        # a shaped cache's latents must share a shape: batches of one item here, the padding rules on the rest
        loader = DataLoader(dataset, batch_size=1 if "latent" in spec["fields"] else 3, sampler=sampler,
                            collate_fn=collate_records)
        for batch in loader:
            index = batch.pop("index")
            seen += index.tolist()
            assert_same(batch, read_batch(cache, index, **spec))
    assert sorted(seen) == list(range(40))


def test_collate_records_pads_a_line_caches_latents_with_white(folders):
    cache = LatentCache(folders["padded"])
    dataset = cache.dataset()
    batch = collate_records([dataset[i] for i in (3, 0, 7)])
    assert_same(batch, {**read_batch(cache, [3, 0, 7], fields=("latent",)), "index": torch.tensor([3, 0, 7])})
    text = LatentCache(folders["records"]).dataset(fields=("text",))
    with pytest.raises(InvalidArgumentError, match="field 'text'.*pad="):
        collate_records([text[0], text[1]])


def test_the_prefetcher_moves_the_loaders_batches(folders):
    cache = LatentCache(folders["records"])
    loader = LatentLoader(cache, 4, fields=("latent", "text"), pad={"text": 0.0})
    direct = [snapshot(b) for b in loader]
    through = [snapshot(b) for b in DevicePrefetcher(loader, "cpu")]
    assert len(direct) == len(through)
    for a, b in zip(direct, through):
        assert_same(a, b)


class RingSource:
    """A loader that reuses a ring of ``hold + 1`` buffers, as LatentLoader does; it records each pull that
    would write over a batch the loop still holds (the prefetcher's ``_handed``: batches the loop has)."""

    recycle, hold = True, 2

    def __init__(self, prefetcher_of, n=12):
        self.prefetcher_of, self.n, self.pulls, self.overwrites = prefetcher_of, n, 0, []

    def __iter__(self):
        ring = [torch.zeros(4) for _ in range(self.hold + 1)]
        for j in range(self.n):
            held = self.prefetcher_of()._handed - 1  # the batch the loop holds now
            if held >= 0 and j - held > self.hold:
                self.overwrites.append((j, held))
            ring[j % len(ring)].fill_(j)
            self.pulls += 1
            yield {"latent": ring[j % len(ring)]}


def test_the_prefetcher_on_the_cpu_never_pulls_over_a_batch_the_loop_holds():
    prefetcher = None
    source = RingSource(lambda: prefetcher)
    prefetcher = DevicePrefetcher(source, "cpu", lookahead=4)
    for k, batch in enumerate(prefetcher):
        if k == 0:  # give the producer every chance to run ahead (bounded: a fixed prefetcher stops at 3 pulls)
            deadline = time.monotonic() + 2
            while source.pulls < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert batch["latent"][0].item() == k  # the values it was handed with
    assert source.overwrites == [] and source.pulls == source.n


@pytest.mark.parametrize("lookahead", [0, 2])
def test_the_prefetchers_state_resumes_after_what_the_loop_used_not_what_it_pulled(folders, lookahead):
    cache = LatentCache(folders["records"])
    whole = [snapshot(b) for b in LatentLoader(cache, 4, seed=1)]
    loader = LatentLoader(cache, 4, seed=1)
    prefetcher = DevicePrefetcher(loader, "cpu", lookahead=lookahead)
    used = []
    for batch in prefetcher:
        used.append(snapshot(batch))
        if len(used) == 3:
            state = prefetcher.state_dict()
            break
    assert state["sampler"]["position"] == 3
    resumed = LatentLoader(cache, 4, seed=1)
    resumed.load_state_dict(state)
    rest = [snapshot(b) for b in DevicePrefetcher(resumed, "cpu", lookahead=lookahead)]
    assert len(used) + len(rest) == len(whole)
    for a, b in zip(whole, used + rest):
        assert_same(a, b)
    with pytest.raises(InvalidArgumentError, match="consumed must be <="):
        loader.state_dict(consumed=99)


def test_argument_errors(folders):
    cache = LatentCache(folders["ragged"])
    with pytest.raises(InvalidArgumentError, match="rank must be < world_size"):
        LatentLoader(cache, 4, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError, match="num_workers"):
        LatentLoader(cache, 4, num_workers=-1)
    with pytest.raises(InvalidArgumentError, match="state must be a LatentLoader"):
        LatentLoader(cache, 4).load_state_dict({"epoch": 0})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_an_s3_cache_through_the_loader_reads_as_the_local_one(folders, tmp_path, workers):
    pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
    pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")
    from latentfast.cache.remote import push
    from latentfast.testing import create_bucket, s3_options, s3_server

    local = LatentCache(folders["records"])
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, seed=4)
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfloader")
        push(folders["records"], "s3://lfloader/records", s3_options(endpoint))
        cache = LatentCache("s3://lfloader/records", storage_options=s3_options(endpoint), local_cache=str(tmp_path / "lc"),
                           local_cache_bytes=1 << 30)
        loader = LatentLoader(cache, 4, num_workers=workers, **options)
        assert loader.sampler.chunk_window is not None  # object storage: chunk windows by default
        batches = [snapshot(b) for b in loader]
    assert items_of(batches) == list(range(len(local)))
    for batch in batches:
        index = batch.pop("index")
        assert_same(batch, read_batch(local, index, fields=("latent", "text"), pad={"text": 0.0}))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_forked_workers_share_the_crc_checks_of_an_s3_caches_chunks(folders, tmp_path, monkeypatch):
    # each process checks a chunk before its first read of it; the loader's forked workers share those
    # checks with it and with each other, so a warm cache is not checked again by every worker
    pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
    pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")
    import mmap
    import zlib

    import numpy as np

    from latentfast.cache.remote import chunks, push
    from latentfast.testing import create_bucket, s3_options, s3_server

    local = LatentCache(folders["records"])
    options = dict(fields=("latent", "text"), pad={"text": 0.0})
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfchecks")
        push(folders["records"], "s3://lfchecks/records", s3_options(endpoint))

        def opened(folder):
            return LatentCache("s3://lfchecks/records", storage_options=s3_options(endpoint), local_cache=str(tmp_path / folder),
                               local_cache_bytes=1 << 30)

        # a cold cache read by the workers only (opening it opened its chunk maps here, before the workers
        # fork): their checks show in this process's maps
        cold = opened("cold")
        batches = [snapshot(b) for b in LatentLoader(cold, 4, num_workers=2, multiprocessing_context="fork", **options)]
        assert items_of(batches) == list(range(len(local)))
        checked_here = [bool(obj.checked.any()) for obj in cold.remote.reader.cache._objects.values()]
        assert sum(checked_here) == 2  # the latents' and the texts' objects (the other fields are fetched, not read)

        # a cache checked here (read in process), then read by forked workers: no chunk checked again
        warm = opened("warm")
        list(LatentLoader(warm, 4, **options))
        checks = np.frombuffer(mmap.mmap(-1, 8), dtype=np.int64)  # (shared with the workers forked below)
        counting = type("counting_zlib", (), {"crc32": staticmethod(lambda data: checks.__setitem__(0, checks[0] + 1) or zlib.crc32(data))})
        monkeypatch.setattr(chunks, "zlib", counting)
        loader = LatentLoader(warm, 4, num_workers=2, multiprocessing_context="fork", **options)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for batch in loader:
                index = batch.pop("index")
                assert_same(batch, read_batch(local, index, **options))
        assert checks[0] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_on_the_device_equal_the_host_ones(folders, workers):
    cache = LatentCache(folders["records"])
    options = dict(fields=("latent", "text"), pad={"text": 0.0}, flip=0.5, seed=2)
    host = [snapshot(b) for b in LatentLoader(cache, 4, **options)]
    device = [snapshot(b) for b in LatentLoader(cache, 4, device="cuda", num_workers=workers, **options)]
    for a, b in zip(host, device):
        assert b["latent"].is_cuda and b["text"].is_cuda
        assert_same(a, {k: v.cpu() for k, v in b.items()})
