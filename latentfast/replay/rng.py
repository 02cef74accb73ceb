"""Replay helpers: reproduce a collected forward, push the cached cotangents through it, and the
B/b selection correction.

A replay step runs in three stages:

1. **collect** every microbatch without a graph; before each selected one,
   ``rng = ReplayRNG.capture()`` records the random state its forward will consume;
2. :meth:`FeatureGradientReplay.finalize` turns the cached features into cotangents;
3. **replay** each selected microbatch: ``with rng.replay(): features = forward(...)`` re-runs the
   forward with the same dropout masks and sampled noise, then
   ``replay_backward(features, cotangents)`` accumulates ``dL/d parameters``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch

from ..devices import as_device
from ..errors import ArgumentTypeError, InvalidArgumentError


class ReplayRNG:
    """The CPU random state and that of every used CUDA device, captured at collection time.

    ``capture(devices=None)``: with ``devices=None`` every CUDA device is captured when CUDA has
    been initialized in this process (so it costs nothing on a CPU-only run); pass the devices
    explicitly to be narrower. Only the default generators are covered: a forward that draws from
    its own ``torch.Generator`` must carry that generator's state itself.
    """

    def __init__(self, cpu_state: torch.Tensor, cuda_states: Mapping[int, torch.Tensor]):
        self.cpu_state = cpu_state
        self.cuda_states = dict(cuda_states)

    @classmethod
    def capture(cls, devices: Iterable[torch.device | int | str] | None = None) -> "ReplayRNG":
        if devices is None:
            indices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else range(0)
        else:
            indices = []
            for device in devices:
                device = as_device(device, name="devices[...]")
                if device.type != "cuda":
                    continue  # the CPU state is always captured
                indices.append(device.index if device.index is not None else torch.cuda.current_device())
        return cls(torch.get_rng_state(), {index: torch.cuda.get_rng_state(index) for index in indices})

    def restore(self) -> None:
        """Set the captured states as the current ones (the next draws repeat the collected ones)."""
        torch.set_rng_state(self.cpu_state)
        for index, state in self.cuda_states.items():
            torch.cuda.set_rng_state(state, index)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured states, then put the states from before the body back,
        so replaying does not disturb the random stream of the rest of training."""
        saved = ReplayRNG.capture(list(self.cuda_states))
        self.restore()
        try:
            yield
        finally:
            saved.restore()


def replay_backward(features: Mapping[str, torch.Tensor], cotangents: Mapping[str, torch.Tensor]) -> None:
    """Backpropagate cached cotangents through replayed features (one backward for all branches).

    ``features[name]``: the replayed forward's output with its graph; ``cotangents[name]``: the
    matching ``dL/d feature`` from :class:`FeatureGradientReplayResult` (``fsdp_cotangents`` under
    FSDP/DDP averaging, ``local_cotangents`` otherwise), on any device -- it is moved to the
    feature's device and dtype. Parameter gradients accumulate into ``.grad`` as usual. Works
    inside ``torch.autocast`` (the replayed forward's features may be half precision; the
    cotangents come in the dtype the features were collected in).

    Under DDP/FSDP wrap the replayed forward and this call in
    :func:`~latentfast.replay.gradient_sync` so the gradients are reduced once per step.
    """
    if not isinstance(features, Mapping) or not isinstance(cotangents, Mapping):
        raise ArgumentTypeError(
            f"features and cotangents must be mappings, got {type(features).__name__} and {type(cotangents).__name__}"
        )
    if set(features) != set(cotangents):
        raise InvalidArgumentError(f"features keys {sorted(features)} differ from cotangents keys {sorted(cotangents)}")
    outputs, grads = [], []
    for name, feature in features.items():
        cotangent = cotangents[name]
        if not isinstance(feature, torch.Tensor) or not isinstance(cotangent, torch.Tensor):
            raise ArgumentTypeError(f"features[{name!r}] and cotangents[{name!r}] must be tensors")
        if feature.shape != cotangent.shape:
            raise InvalidArgumentError(
                f"features[{name!r}] has shape {tuple(feature.shape)} but its cotangent has {tuple(cotangent.shape)}:"
                " the replayed microbatch differs from the collected one"
            )
        if not feature.requires_grad:
            raise InvalidArgumentError(f"features[{name!r}] has no graph: replay the forward with gradients enabled")
        outputs.append(feature)
        grads.append(cotangent.to(device=feature.device, dtype=feature.dtype, non_blocking=True))
    torch.autograd.backward(outputs, grads)


def selection_correction_factor(global_samples, gradient_global_samples: int | None = None) -> float:
    """``B / b``: the factor that makes the b-row gradient an unbiased estimate of the B-row one.

    The full gradient is ``sum_i dL/dx_i * dx_i/dtheta`` over all B rows; replay computes the sum
    over the b selected rows only. When the selected rows are a uniformly random subset (the data
    order is shuffled, so the collection-order suffix is one), ``B/b`` times that sum has the full
    gradient as its expectation. ``FeatureGradientReplay`` does not apply it: a trainer applies it
    once per step, after every ``replay_backward`` and the gradient reduction and before the
    optimizer step (e.g. ``p.grad.mul_(factor)``, or folded into ``loss_scale``), and it is
    separate from the world-size factor already inside ``fsdp_cotangents``.

    Accepts a :class:`FeatureGradientReplayResult` or the two global counts ``(B, b)``.
    """
    if gradient_global_samples is None:
        result = global_samples
        global_samples, gradient_global_samples = result.global_samples, result.gradient_global_samples
    big, small = int(global_samples), int(gradient_global_samples)
    if not 0 < small <= big:
        raise InvalidArgumentError(f"need 0 < gradient_global_samples <= global_samples, got b={small}, B={big}")
    return big / small
