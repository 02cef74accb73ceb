"""Feature gradient replay (dual GradCache): cache B samples' features, differentiate b of them,
replay only those through the generator.

* :class:`FeatureGradientReplay` / :class:`FeatureGradientReplayResult` -- the cache and what
  ``finalize`` returns (the original training code's names for them are in :mod:`latentfast.compat`);
* :class:`MultiEncoderMMD` -- the multi-encoder mixed-RBF MMD loss (exact or Nyström);
* :func:`scatter_cotangents` -- the batched, compiled split of leaf gradients into cotangents;
* :class:`ReplayRNG`, :func:`replay_backward`, :func:`selection_correction_factor` -- what a
  trainer needs to replay a microbatch and apply the B/b correction;
* :func:`gradient_sync` -- one gradient reduction per step under DDP/FSDP, not one per replay.

``latentfast.replay.demo`` runs one step on the toy models against plain backpropagation.
"""
from __future__ import annotations

from .gradcache import (
    FeatureGradientReplay,
    FeatureGradientReplayResult,
)
from .mmd import MultiEncoderMMD
from .rng import ReplayRNG, replay_backward, selection_correction_factor
from .scatter import ScatteredCotangents, scatter_cotangents
from .sync import gradient_sync

__all__ = [
    "FeatureGradientReplay",
    "FeatureGradientReplayResult",
    "MultiEncoderMMD",
    "ReplayRNG",
    "ScatteredCotangents",
    "gradient_sync",
    "replay_backward",
    "scatter_cotangents",
    "selection_correction_factor",
]
