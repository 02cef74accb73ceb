"""Gradient reduction once per step, not once per replayed microbatch.

Under DDP every backward all-reduces the gradients, and under FSDP every backward reduce-scatters
them, so replaying 8 microbatches costs 8 reductions although the optimizer only needs the sum.
:func:`gradient_sync` defers the reduction for every replay but the last::

    for i, (condition, rng) in enumerate(replays):
        with gradient_sync(model, enabled=i == len(replays) - 1), rng.replay():
            replay_backward(rollout(condition), cotangents[i])

The deferred gradients accumulate locally and the last backward reduces their sum, which equals
reducing each replay (the reduction is linear) up to floating-point summation order.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..errors import ArgumentTypeError


def _fsdp_classes() -> tuple[type | None, type | None]:
    """(FSDP2's ``FSDPModule``, FSDP1's ``FullyShardedDataParallel``), None where this torch lacks one."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 (or built without distributed)
        FSDPModule = None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = None
    return FSDPModule, FullyShardedDataParallel


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Reduce gradients across ranks in this block only if ``enabled``.

    Wrap each replayed microbatch's forward **and** ``replay_backward`` in it (DDP decides in the
    forward whether the backward will reduce), with ``enabled=True`` for the last replay only.

    - ``DistributedDataParallel``: ``enabled=False`` is ``model.no_sync()``;
    - FSDP2 (``fully_shard``; ``model`` or any of its submodules): ``set_requires_gradient_sync
      (enabled)`` on every FSDP module, set back to ``True`` (FSDP's default) on exit;
    - FSDP1 (``FullyShardedDataParallel``, the root): ``enabled=False`` is ``model.no_sync()``;
    - any other module: nothing (single process, or gradients reduced by hand afterwards).
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"gradient_sync: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(enabled, bool):
        raise ArgumentTypeError(f"gradient_sync: enabled must be a bool, got {type(enabled).__name__}")
    from torch.nn.parallel import DistributedDataParallel

    fsdp2, fsdp1 = _fsdp_classes()
    if isinstance(model, DistributedDataParallel) or (fsdp1 is not None and isinstance(model, fsdp1)):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
        return
    sharded = [m for m in model.modules() if fsdp2 is not None and isinstance(m, fsdp2)]
    for module in sharded:
        module.set_requires_gradient_sync(enabled, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_gradient_sync(True, recurse=False)
