"""offload_encode / VisionEncoder.encode_balanced in real spawned gloo groups of 2 and 3 ranks.

Each group runs every scenario in sequence (spawning is the slow part), one result per scenario
and rank; the tests below check them. Scenarios that fail on purpose are followed by a normal
step, so they also show the group is still usable after every rank raised.
"""
from __future__ import annotations

import datetime
import gc
import os
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from latentfast.testing import spawn_gloo
from latentfast.toy import ToyVAE
from latentfast.vision import BalanceGroup, EncodeCostModel, VisionEncoder, measure_link_bandwidth, offload_encode
from latentfast.distributed import check_collective_device
from latentfast.vision.balance import _Group
from latentfast.vision.demo import demo_balanced_encode, skewed_items

SIZE = 16
COSTS = {(4, SIZE, SIZE): 0.004, (5, SIZE, SIZE): 0.005, (8, SIZE, SIZE): 0.008}


def step_items(rank: int, seed: int = 0):
    """Rank 0: two multiview uint8 items (4-D and 5-D) and a plain clip -- the heavy rank.
    Rank 1: one plain 5-D clip. Rank 2: nothing."""
    g = torch.Generator().manual_seed(100 * seed + rank)

    def uint8(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    if rank == 0:
        items = [uint8(3, 16, SIZE, SIZE), uint8(2, 3, 12, SIZE, SIZE), torch.rand(3, 5, SIZE, SIZE, generator=g) * 2 - 1]
        return items, [4, 3, 1], [4, 4, None]
    if rank == 1:
        return [torch.rand(2, 3, 8, SIZE, SIZE, generator=g) * 2 - 1], [1], [None]
    return [], [], []


def make_encoder(vae: ToyVAE, **options) -> VisionEncoder:
    return VisionEncoder(
        cost_model=EncodeCostModel(COSTS), parallel_dims=BalanceGroup(), encode_fn=lambda x: vae.encode_video(x), device="cpu", **options
    )


def capture(fn):
    """Run one scenario; return its value or the raised error as ``("raised", type, message, failed_ranks)``."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc).__name__, str(exc), getattr(exc, "failed_ranks", None))


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def frames_kept_by_cycles() -> list[str]:
    """Names of this package's balancing frames that only reference cycles keep alive. Such a
    cycle can hold the process group past destroy_process_group, which aborts the process."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    names = {o.f_code.co_name for o in gc.garbage if isinstance(o, types.FrameType)}
    gc.garbage.clear()
    gc.set_debug(0)
    return sorted(names & {"offload_encode", "encode_balanced", "_raise_if_failed", "_gather_units", "_local_units", "_units_out_and_encode", "_gather_status"})


def scenarios(rank: int, world_size: int) -> dict:
    gc.disable()  # cycles stay uncollected until frames_kept_by_cycles looks for them
    vae = ToyVAE()
    encoder = make_encoder(vae)
    out = {"available": encoder.balancing_available()}

    def balanced_equals_local(seed):
        items, views, frames = step_items(rank, seed)
        balanced = encoder.encode_balanced(items, views, frames)
        return same(balanced, encoder.encode_local(items, views, frames)), encoder.last_plan

    out["skewed"] = capture(lambda: balanced_equals_local(0))

    def late_bound():
        calls = []
        current = encoder.encode_fn
        encoder.encode_fn = lambda x: (calls.append(1), current(x))[1]  # a timer installed later
        try:
            items, views, frames = step_items(rank, 1)
            encoder.encode_balanced(items, views, frames)
        finally:
            encoder.encode_fn = current
        return len(calls)

    out["late_bound_calls"] = capture(late_bound)

    def raising_encode():
        real = encoder.encode_fn
        if rank == 1:
            encoder.encode_fn = lambda x: (_ for _ in ()).throw(ValueError("boom on purpose"))
        try:
            items, views, frames = step_items(rank, 2)
            return encoder.encode_balanced(items, views, frames)
        finally:
            encoder.encode_fn = real

    out["encode_raises"] = capture(raising_encode)
    out["after_encode_error"] = capture(lambda: balanced_equals_local(3)[0])

    def unknown_shape_on_rank0():
        items, views, frames = step_items(rank, 4)
        if rank == 0:
            items = items + [torch.rand(3, 7, SIZE, SIZE)]
            views, frames = views + [1], frames + [None]
        return encoder.encode_balanced(items, views, frames)

    out["bad_input"] = capture(unknown_shape_on_rank0)
    out["after_input_error"] = capture(lambda: balanced_equals_local(5)[0])
    out["frames_kept_by_cycles"] = frames_kept_by_cycles()
    gc.enable()

    def direct_mixed_dtypes():
        # Rank 0 owns five heavy units of odd sizes and mixed dtypes (several travel in one packed
        # message, so segment alignment matters), the others one light unit. The encode changes
        # shape, rank and dtype. numpy integers are accepted for the group arguments.
        g = torch.Generator().manual_seed(rank)
        dtypes = [torch.float16, torch.int64, torch.bfloat16, torch.uint8, torch.float32] if rank == 0 else [torch.int16]
        tensors = [torch.randint(0, 50, (2, 3 + i), generator=g).to(dt) for i, dt in enumerate(dtypes)]
        seconds = [(10.0 if rank == 0 else 1.0)] * len(tensors)

        def encode(t):
            return (t.double().cumsum(-1) * 3).unsqueeze(0)

        latents, plan = offload_encode(tensors, seconds, encode, group=None, group_rank=np.int64(rank), group_size=np.int64(world_size),
                                       device="cpu", capacity=np.int64(8), return_plan=True)  # fmt: skip
        return same(latents, [encode(t).contiguous() for t in tensors]), plan.moved_units

    out["direct"] = capture(direct_mixed_dtypes)

    def settings_that_differ(**per_rank):
        tensors = [torch.full((2,), float(rank))]
        options = {name: values[rank] for name, values in per_rank.items()}
        return offload_encode(tensors, [1.0], torch.neg, group=None, group_rank=rank, group_size=world_size, device="cpu", **options)

    out["capacity_differs"] = capture(lambda: settings_that_differ(capacity=[8, 9, 8]))
    out["bandwidth_differs"] = capture(lambda: settings_that_differ(bandwidth=[None, 1e9, None]))
    out["over_capacity"] = capture(lambda: settings_that_differ(capacity=[1, 1, 1]) if rank else offload_encode(
        [torch.zeros(1)] * 2, [1.0] * 2, torch.neg, group=None, group_rank=rank, group_size=world_size, device="cpu", capacity=1))
    out["after_setting_errors"] = capture(lambda: balanced_equals_local(6)[0])

    def transfer_aware():
        link = measure_link_bandwidth(nbytes=1 << 16, repeats=2)
        aware = make_encoder(vae, link_bandwidth=link)
        items, views, frames = step_items(rank, 7)
        views = [np.int64(v) for v in views]  # numpy integers welcome where an int is expected
        result = same(aware.encode_balanced(items, views, frames), aware.encode_local(items, views, frames))
        return result, link, aware.last_plan


    def merged_costs():
        own = {(4, 8, 8): 1.0 + rank}
        if rank == 1:
            own[(8, 8, 8)] = 5.0
        merged = EncodeCostModel(own).merged_across_ranks()
        return sorted(merged.seconds_by_shape.items())

    out["merged_costs"] = capture(merged_costs)
    out["transfer_aware"] = capture(transfer_aware)

    def host_copies_per_gather():
        group = _Group(dist.group.WORLD, rank, world_size, torch.device("cpu"), None)
        calls, real = [], torch.Tensor.cpu
        torch.Tensor.cpu = lambda self, *args, **kwargs: (calls.append(1), real(self, *args, **kwargs))[1]
        try:
            rows = group.all_gather([float(rank), 2.0 * rank], "a test gather")
        finally:
            torch.Tensor.cpu = real
        return len(calls), rows

    out["host_copies"] = capture(host_copies_per_gather)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def group_results(request):
    return request.param, spawn_gloo(scenarios, request.param, timeout_s=60)


def assert_group_still_balances(group_results, name):
    """After a failed step every rank can still run a balanced step equal to local encoding."""
    world_size, results = results_of(group_results, name)
    assert results == [True] * world_size


def results_of(group_results, name):
    world_size, per_rank = group_results
    for rank, result in enumerate(per_rank):
        assert not isinstance(result, BaseException), f"rank {rank} crashed: {result!r}"
    return world_size, [r[name] for r in per_rank]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_balanced_equals_local_encoding_and_work_moves(group_results):
    world_size, results = results_of(group_results, "skewed")
    assert all(r[0] is True for r in results), results
    plans = [r[1] for r in results]
    assert all(p == plans[0] for p in plans)  # every rank computed the same plan
    assert plans[0].moved_units > 0 and plans[0].makespan < plans[0].home_makespan
    assert results_of(group_results, "available")[1] == [True] * world_size


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rank_without_items_and_late_bound_encode(group_results):
    world_size, calls = results_of(group_results, "late_bound_calls")
    assert sum(calls) == 4 + 3 + 1 + 1  # every encode call went through the later-installed timer
    if world_size == 3:
        assert calls[2] > 0  # the rank with no items of its own did encode work


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_encode_error_raises_on_every_rank_naming_the_rank(group_results):
    _, results = results_of(group_results, "encode_raises")
    for rank, result in enumerate(results):
        assert result[0] == "raised" and result[1] == "OffloadEncodeError", result
        assert result[3] == [1]
        assert "boom on purpose" in result[2]
        assert ("this rank" if rank == 1 else "rank(s) [1]") in result[2]
    assert_group_still_balances(group_results, "after_encode_error")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_invalid_input_on_one_rank_raises_everywhere(group_results):
    _, results = results_of(group_results, "bad_input")
    for result in results:
        assert result[0] == "raised" and result[3] == [0], result
        assert "(7, 16, 16)" in result[2]  # the unknown shape is named
    assert_group_still_balances(group_results, "after_input_error")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_failed_steps_leave_no_reference_cycles(group_results):
    world_size, results = results_of(group_results, "frames_kept_by_cycles")
    assert results == [[]] * world_size


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_offload_encode_any_dtype_and_rank(group_results):
    _, results = results_of(group_results, "direct")
    assert all(r[0] is True for r in results), results
    assert results[0][1] >= 2


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario, setting", [("capacity_differs", "capacity"), ("bandwidth_differs", "bandwidth")])
def test_settings_that_differ_between_ranks_raise_on_every_rank(group_results, scenario, setting):
    """A capacity that differed between ranks used to abort the process inside gloo (the metadata
    gathers had different sizes); now the fixed-size header carries it and every rank raises."""
    _, results = results_of(group_results, scenario)
    for result in results:
        assert result[0] == "raised" and result[1] == "OffloadEncodeError", result
        assert f"{setting} must be the same on every rank" in result[2] and result[3] == [1], result
    assert_group_still_balances(group_results, "after_setting_errors")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_more_units_than_capacity_raises_on_every_rank(group_results):
    _, results = results_of(group_results, "over_capacity")
    for result in results:
        assert result[0] == "raised" and "more than capacity=1" in result[2] and result[3] == [0], result


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_transfer_aware_balanced_step_with_a_measured_link(group_results):
    _, results = results_of(group_results, "transfer_aware")
    assert all(r[0] is True for r in results), results
    links = {r[1] for r in results}
    assert len(links) == 1 and links.pop() > 0  # the same measured figure on every rank
    plans = [r[2] for r in results]
    assert all(p == plans[0] for p in plans) and plans[0].bandwidth == results[0][1]
    assert plans[0].step_seconds <= plans[0].home_makespan


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gathered_rows_come_back_in_one_host_copy(group_results):
    world_size, results = results_of(group_results, "host_copies")
    for copies, rows in results:
        assert copies == 1 and rows == [[float(r), 2.0 * r] for r in range(world_size)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cost_tables_merge_by_max(group_results):
    world_size, results = results_of(group_results, "merged_costs")
    assert all(r == [((4, 8, 8), float(world_size)), ((8, 8, 8), 5.0)] for r in results), results


def absent_peer(rank: int, world_size: int, folder: str):
    """Rank 1 stays alive but never enters until rank 0 is done: rank 0 must fail at its 2 s timeout with
    the timeout's message, not hang (a hang meets the test's own timeout)."""
    done = os.path.join(folder, "rank0-done")
    if rank == 1:
        while not os.path.exists(done):  # waits on rank 0's result, not on the clock
            time.sleep(0.05)
        return "skipped"
    try:
        return capture(lambda: offload_encode([torch.zeros(2)], [1.0], torch.neg, group=None, group_rank=0,
                                              group_size=world_size, device="cpu", timeout=datetime.timedelta(seconds=2)))  # fmt: skip
    finally:
        open(done, "w").close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_timeout_is_honored_when_a_peer_never_enters(tmp_path):
    results = spawn_gloo(absent_peer, 2, str(tmp_path), timeout_s=300)
    assert results[1] == "skipped"
    result = results[0]
    assert result[0] == "raised" and result[1] == "OffloadEncodeError", result
    assert "the header gather" in result[2] and "timed out" in result[2].lower(), result


def test_arguments_checked_against_the_group():
    with pytest.raises(ValueError, match="group_rank must be in"):
        offload_encode([], [], torch.neg, group=None, group_rank=2, group_size=2, device="cpu")
    with pytest.raises(TypeError, match="group_rank and group_size must be ints"):
        offload_encode([], [], torch.neg, group=None, group_rank=0.0, group_size=2, device="cpu")
    assert not dist.is_initialized()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_runs_a_balanced_step_equal_to_local_encoding():
    config = dict(views=2, frames=4, size=32, heavy_items=2, hidden=16)
    result = demo_balanced_encode(world_size=2, repeats=1, device_seconds=0.0, **config)
    assert result["equal_to_local"] is True and result["items_per_rank"] == [2, 1]
    assert result["moved_units"] > 0 and result["planned_speedup"] > 1
    assert result["unbalanced_s"] > 0 and result["balanced_s"] > 0
    # The balanced latents the spawned ranks got, against this process's own encoding of the same items.
    vae = ToyVAE(hidden=config["hidden"])
    local = VisionEncoder(encode_fn=vae.encode_video, device="cpu")
    for rank, sums in enumerate(result["checksums_per_rank"]):
        items, views, frames = skewed_items(rank, 2, **{k: config[k] for k in ("views", "frames", "size", "heavy_items")})
        expected = [(float(t.double().sum()), float(t.double().square().sum())) for t in local.encode_local(items, views, frames)]
        assert np.allclose(sums, expected, rtol=1e-6, atol=1e-6), (rank, sums, expected)


def test_collective_device_must_be_the_current_cuda_device_under_nccl():
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    check_collective_device(cuda1, "nccl", 1)
    check_collective_device(torch.device("cpu"), "gloo", None)
    check_collective_device(cuda1, "gloo", 0)  # gloo does not bind a device
    with pytest.raises(ValueError, match=r"current CUDA device \(cuda:0\).*got cuda:1.*set_device"):
        check_collective_device(cuda1, "nccl", 0)
    with pytest.raises(ValueError, match="got cpu"):
        check_collective_device(torch.device("cpu"), "nccl", 0)
    check_collective_device(cuda0, "nccl", 0)


def test_packed_message_round_trips_mixed_dtypes_and_odd_sizes():
    from latentfast.distributed import pack as _pack, unpack as _unpack

    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 3, generator=g).half(),
        torch.randn(2, 3, generator=g),
        torch.randint(-(2**40), 2**40, (3,), generator=g),
        torch.rand(5, generator=g) > 0.5,
        torch.zeros(0, 4, dtype=torch.bfloat16),
        torch.randn(4, 6, generator=g).bfloat16()[:, ::2],  # non-contiguous
        torch.randn(1, 1, 1, generator=g, dtype=torch.float64),
    ]
    buffer = _pack(tensors, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.ndim == 1
    unpacked = _unpack(buffer, [(t.dtype, tuple(t.shape)) for t in tensors])
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(unpacked, tensors))


CUDA_STEP = """
import os, sys, tempfile, torch, torch.distributed as dist
from latentfast.toy import ToyVAE
from latentfast.vision import BalanceGroup, EncodeCostModel, VisionEncoder
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1), rank=0, world_size=1)
vae = ToyVAE().cuda()
items = [torch.randint(0, 256, (3, 8, 16, 16), dtype=torch.uint8), torch.rand(3, 4, 16, 16, device="cuda") * 2 - 1]
encoder = VisionEncoder(cost_model=EncodeCostModel({(4, 16, 16): 0.01}), parallel_dims=BalanceGroup(), encode_fn=vae.encode_video,
                        device="cuda")  # no index: units land on cuda:0 and must be accepted there
assert encoder.balancing_available()
balanced = encoder.encode_balanced(items, [2, 1], [4, None])
local = encoder.encode_local(items, [2, 1], [4, None])
assert all(b.is_cuda and torch.equal(b, l) for b, l in zip(balanced, local))
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_balanced_encode_with_device_cuda_runs_under_nccl():
    """device="cuda" used to reject every unit (they land on cuda:0, and cuda:0 != cuda)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CUDA_STEP], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
