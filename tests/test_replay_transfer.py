"""Moving replay tensors: the packed copy of small tensors, offload's copies, and the device a
process group's collectives run on (checked here on the CPU through the helper)."""
from __future__ import annotations

import pytest
import torch

from latentfast.errors import InvalidArgumentError
from latentfast.distributed import collective_device
from latentfast.replay.transfer import _packed_copy, copy_tensors


def _mixed_tensors():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.tensor(3.25),  # 0-dim float32
        torch.tensor(7, dtype=torch.long),
        torch.randn(3, 5, generator=generator, dtype=torch.float64),
        torch.randn(7, generator=generator).to(torch.bfloat16),  # 14 bytes: the next one starts unaligned
        torch.tensor([True, False, True]),
        torch.randn(2, 3, generator=generator).half().t(),  # non-contiguous
        torch.empty(0, 4),
    ]


def test_packed_copy_round_trips_every_dtype_and_shape():
    tensors = _mixed_tensors()
    copies = _packed_copy(tensors, torch.device("cpu"))
    buffers = {c.untyped_storage().data_ptr() for c in copies if c.numel()}
    assert len(buffers) == 1  # one buffer, so one transfer between devices
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
        assert copy.data_ptr() % copy.element_size() == 0  # aligned for its dtype


def test_copy_tensors_always_makes_new_memory():
    tensors = _mixed_tensors()
    copies = copy_tensors(tensors, "cpu")
    for original, copy in zip(tensors, copies):
        assert torch.equal(copy, original)
        if original.numel():
            assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()


@pytest.mark.gpu
def test_copy_tensors_from_cuda_packs_the_small_ones():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    small = [t.cuda() for t in _mixed_tensors()]
    large = [torch.randn(1 << 16, device="cuda"), torch.randn(3, 1 << 15, device="cuda")]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        copies = copy_tensors([*small, *large], "cpu")
    device_to_host = [e for e in prof.events() if "DtoH" in e.name or "Device -> Pinned" in e.name
                      or "Device -> Pageable" in e.name]  # fmt: skip
    assert len(device_to_host) == 1 + len(large), [e.name for e in device_to_host]
    for original, copy in zip([*small, *large], copies):
        assert copy.device.type == "cpu" and torch.equal(copy, original.cpu())


def test_collective_device_follows_what_the_backend_serves():
    cpu, cuda1 = torch.device("cpu"), torch.device("cuda", 1)
    assert collective_device(cpu, "gloo") == cpu
    assert collective_device(cuda1, "nccl") == cuda1
    assert collective_device(cuda1, "gloo") == cuda1  # gloo also serves CUDA tensors
    # NCCL cannot gather CPU features: they go to the current CUDA device for the collective
    assert collective_device(cpu, "nccl", current_cuda=cuda1) == cuda1
    assert collective_device("cpu", "cpu:gloo,cuda:nccl") == cpu
    assert collective_device(cpu, "cuda:nccl", current_cuda=0) == torch.device("cuda", 0)
    assert collective_device(cpu, "my_custom_backend") == cpu  # unknown backends: trust the data's device
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match=r"backend 'nccl' serves \['cuda'\] tensors, the features are on cpu"):
            collective_device(cpu, "nccl")
    with pytest.raises(InvalidArgumentError, match="backend 'xccl' serves"):
        collective_device(cpu, "xccl")


@pytest.mark.gpu
def test_cpu_features_under_nccl_use_the_current_cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert collective_device("cpu", "nccl") == torch.device("cuda", torch.cuda.current_device())
