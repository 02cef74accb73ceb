"""Distributed builds: every rank of a ``torch.distributed`` group encodes a share of the source into a
shard of its own; rank 0 writes the manifest that makes the shards one cache (see
:mod:`latentfast.cache.store.shards`).

Each builder plans the whole source on every rank (deterministically: the same plan everywhere; the
image, video and line builders probe and hash each file on one rank and exchange the results), in
the units a single-process build encodes together (a batch of one bucket, a width-sorted batch of
lines, a file), and calls :meth:`Share.keep`: the units are spread over the ranks by predicted
encode cost (pixels x frames per item) with the project's LPT planner
(:func:`latentfast.vision.plan.lpt_bins`), and the builder goes on with this rank's items only.
Because whole units move, every item is encoded in the batch it has in a single-process build,
and the manifest's order lists the items in that build's order: the sharded cache has the same
keys in the same order with the same bytes.

Each rank writes ``out_dir/shards/{split}-{rank:05d}-of-{world:05d}`` with the builder's own
crash-safe, resumable writer under its own build lock, so ranks on different nodes sharing one
folder never write the same file. When every rank is done (one collective), rank 0 writes the
manifest, durably and last; the others wait for it. A rank killed mid-way loses only its batch in
flight: the shards the others finished are complete caches, and rerunning the same command resumes
each shard (complete ones are found unchanged and skipped). Once the manifest is durable, rank 0
deletes the shards of this split that a build of another world size left there (no manifest refers to
them any more; one that a ``cache merge`` without ``--copy`` still names is kept); a damaged manifest or order file is rewritten by rerunning the same build, which
finds every shard unchanged.

``import_latents`` takes part the same way: each file (extension formats) or each item of a
trainer's folder is one unit, costed by the bytes it reads.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re
import shutil
from concurrent.futures import Future

import numpy as np

from ...errors import CacheError, CacheLockedError, InvalidArgumentError
from ...vision.plan import lpt_bins
from ..store import shards as shardstore
from ..store.durable import BuildLock
from ..store.opening import LatentCache

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("latentfast_build_share", default=None)


class IdleRank(Exception):
    """This rank's share is empty (more ranks than units of work): it writes no shard."""


def shard_dir(out_dir, split: str, rank: int, world: int) -> str:
    """Where rank ``rank`` of ``world`` writes its shard: unique per (split, rank, world size)."""
    return os.path.join(os.fspath(out_dir), "shards", f"{split}-{rank:05d}-of-{world:05d}")


def current_share() -> "Share | None":
    """The :class:`Share` of the distributed build running in this context, or None."""
    return _CURRENT.get()


class Share:
    """One rank's part of a distributed build, and the order of the whole (for the manifest)."""

    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world, self.group = rank, world, group
        self.order: list[str] | None = None
        self.plan = None

    def map(self, pool, fn, args: list) -> list[Future]:
        """``fn(*a)`` for every ``a`` of ``args`` as completed futures, in order: each rank computes every
        world-th on ``pool`` and the outcomes (results or exceptions) are exchanged in one collective, so
        each source file is probed (read and hashed) once in the group, not once per rank."""
        import torch.distributed as dist

        def outcome(a):
            try:
                return True, fn(*a)
            except Exception as exc:  # noqa: BLE001 - handed to every rank, raised where the builder looks
                return False, exc

        mine = list(pool.map(outcome, args[self.rank::self.world]))
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        futures = []
        for k in range(len(args)):
            ok, value = every[k % self.world][k // self.world]
            futures.append(Future())
            futures[-1].set_result(value) if ok else futures[-1].set_exception(value)
        return futures

    def keep(self, ordered: list, units: list[list], *, key, cost, plan=None) -> list:
        """The items of ``ordered`` (every item, in the single-process cache's order) that lie in the
        ``units`` (lists of items encoded together) this rank is given; ``key(item)`` names an item,
        ``cost(item)`` predicts its encode cost (pixels x frames, or bytes read). ``plan``: whatever
        else every rank must have planned alike (e.g. the trainer format ``"auto"`` detected),
        compared across ranks with the order. Raises :class:`IdleRank` if none."""
        self.order, self.plan = [key(x) for x in ordered], plan
        if len(set(self.order)) != len(self.order):
            seen: set = set()
            twice = next(k for k in self.order if k in seen or seen.add(k))
            raise InvalidArgumentError(f"a distributed build needs distinct item keys; {twice!r} appears twice in the source")
        costs = np.asarray([max(1, int(sum(cost(x) for x in unit))) for unit in units], dtype=np.int64)
        bins = lpt_bins(costs, self.world)
        mine = {key(x) for unit, b in zip(units, bins.tolist()) if b == self.rank for x in unit}
        if not mine:
            raise IdleRank
        return [x for x in ordered if key(x) in mine]


def build_sharded(fn, args: dict, agree=None) -> str:
    """Run the builder ``fn`` (called with ``args``, its own arguments, ``group`` among them) as one
    rank of ``args["group"]``: this rank's share into its shard, then (rank 0) the manifest. Every
    rank returns the manifest's path, or raises if any rank failed (naming the ranks). ``agree``: a
    function returning ``{name: JSON-able value}`` (the arguments and the source's digest) that every
    rank must hold alike; compared before anything is written, every rank raises the same error if not."""
    import torch.distributed as dist

    args = dict(args)
    group = args.pop("group")
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError("group= needs an initialized torch.distributed process group "
                                   "(torch.distributed.init_process_group, or run under torchrun with --distributed)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out_dir, split = os.fspath(args["out_dir"]), args.get("split", "train")
    if agree is not None:
        check_agreement(agree, out_dir, group, world)
    if rank == 0:  # a rebuild: the old manifest must not describe shards being rewritten
        with contextlib.suppress(FileNotFoundError):
            os.remove(shardstore.manifest_path(out_dir, split))
    share, error, keys = Share(rank, world, group), None, None
    folder = shard_dir(out_dir, split, rank, world)
    token = _CURRENT.set(share)
    try:
        fn(**{**args, "out_dir": folder})
        keys = LatentCache(folder, split).keys  # what this shard holds, in its order
    except IdleRank:
        pass
    except Exception as exc:  # every rank must still reach the collective below
        error = exc
    finally:
        _CURRENT.reset(token)
    statuses = [None] * world
    dist.all_gather_object(statuses, (None if error is None else f"{type(error).__name__}: {error}",
                                      share.order, share.plan, keys), group=group)
    failed = [r for r, (message, *_) in enumerate(statuses) if message is not None]
    if error is not None:
        raise error
    if failed:
        raise CacheError(f"distributed build of {out_dir}: rank(s) {failed} failed ({statuses[failed[0]][0]}); "
                         f"fix that and rerun the same command: every finished shard is kept and resumed")
    orders = {tuple(o) for _, o, _, _ in statuses if o is not None}
    plans = {repr(p) for _, o, p, _ in statuses if o is not None}
    if len(orders) != 1 or len(plans) != 1:
        raise CacheError(f"distributed build of {out_dir}: the ranks planned different sources ({len(orders)} orders of "
                         f"items, {len(plans)} plans: {sorted(plans)}); every rank must see the same source files and arguments")
    if rank == 0:
        try:
            _write_manifest(out_dir, split, world, list(orders.pop()), [k for *_, k in statuses])
            remove_other_worlds(out_dir, split, world)
        except Exception as exc:  # the other ranks must not wait for a manifest that will not come
            error = exc
    outcomes = [None] * world  # (all_gather_object, not broadcast: its source is a group rank on every torch)
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    if outcomes[0] is not None:
        raise CacheError(f"distributed build of {out_dir}: rank 0 could not write the manifest ({outcomes[0]})")
    return shardstore.manifest_path(out_dir, split)


def check_agreement(agree, out_dir: str, group, world: int) -> None:
    """Gather every rank's ``agree()`` and raise, alike on every rank, naming each value that differs and
    which ranks hold what (or the rank that could not compute it)."""
    import json

    import torch.distributed as dist

    try:
        mine = {name: json.dumps(value, sort_keys=True, default=repr) for name, value in agree().items()}
        failure = None
    except Exception as exc:  # noqa: BLE001 - every rank must reach the collective, and hear of it
        mine, failure = {}, f"{type(exc).__name__}: {exc}"
    every = [None] * world
    dist.all_gather_object(every, (mine, failure), group=group)
    failed = [(r, f) for r, (_, f) in enumerate(every) if f is not None]
    if failed:
        raise CacheError(f"distributed import of {out_dir}: rank {failed[0][0]} could not read its arguments or source "
                         f"({failed[0][1]}); nothing was written")
    lines = []
    for name in dict.fromkeys(n for values, _ in every for n in values):
        held: dict = {}
        for r, (values, _) in enumerate(every):
            held.setdefault(values.get(name), []).append(r)
        if len(held) > 1:
            lines.append(f"  {name}: " + "; ".join(
                f"{f'rank {ranks[0]}' if len(ranks) == 1 else f'rank(s) {ranks}'} "
                f"{'(not given)' if value is None else f'{json.loads(value)!r:.200}'}" for value, ranks in held.items()))
    if lines:
        raise InvalidArgumentError(f"distributed import of {out_dir}: the ranks were given different arguments or source files "
                                   f"(nothing was written; every rank must be called alike over the same files):\n" + "\n".join(lines))


def remove_other_worlds(out_dir, split: str, world: int) -> list[str]:
    """Delete the shards of ``split`` that a build of another world size left in ``out_dir/shards``
    (``{split}-*-of-{other:05d}``): the manifest just written refers to none of them. Called after the
    manifest is durable, so a crash in between leaves an extra folder, never a cache without its data.
    This world size's shards and other splits' are kept, and so is a shard whose build lock is held
    (a build of that world size writing into the folder now) or that a ``cache merge`` without
    ``--copy`` refers to (:func:`~latentfast.cache.store.shards.referenced_by`: its manifest still
    exists and names it). Returns the folders removed."""
    root = os.path.join(os.fspath(out_dir), "shards")
    name = re.compile(re.escape(split) + r"-\d{5}-of-(\d{5})")
    try:
        found = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    stale = [os.path.join(root, n) for n in found if (m := name.fullmatch(n)) and int(m.group(1)) != world
             and os.path.isdir(os.path.join(root, n))]
    removed = []
    for folder in stale:
        try:
            lock = BuildLock(folder, split)
        except CacheLockedError:
            continue
        with lock:  # moved aside under its lock: a build starting now finds no half-deleted shard
            if shardstore.referenced_by(folder, split):
                continue
            trash = os.path.join(root, f".{os.path.basename(folder)}.{os.getpid()}.removing")
            os.rename(folder, trash)
        shutil.rmtree(trash)
        removed.append(folder)
    return removed


def _write_manifest(out_dir: str, split: str, world: int, order: list[str], shard_keys: list) -> None:
    """The manifest over the shards written (``shard_keys[r]``: rank r's shard's keys, None if it wrote
    none), with the items in the single-process ``order`` (keys)."""
    folders, where = [], {}
    for rank, keys in enumerate(shard_keys):
        if keys is None:
            continue
        for row, key in enumerate(keys):
            where[key] = (len(folders), row)
        folders.append(shard_dir(out_dir, split, rank, world))
    missing = [k for k in order if k not in where]
    if missing or len(where) != len(order):
        raise CacheError(f"distributed build of {out_dir}: the shards hold {len(where)} items, the plan {len(order)}"
                         f"{f' (missing e.g. {missing[0]!r})' if missing else ''}")
    shardstore.write_manifest(out_dir, split, folders, np.asarray([where[k] for k in order], dtype=np.int64).reshape(-1, 2))
