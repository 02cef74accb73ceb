"""Feature gradient replay (dual GradCache): cache B samples' features, differentiate b of them,
replay only those through the generator.

* :class:`FeatureGradientReplay` / :class:`FeatureGradientReplayResult` -- the cache and what
  ``finalize`` returns (old names: ``MultiRepresentationFreshVideoGradCache[Result]``);
* :class:`MultiEncoderMMD` -- the multi-encoder mixed-RBF MMD loss (exact or Nyström);
* :func:`scatter_cotangents` -- the batched, compiled split of leaf gradients into cotangents;
* :class:`ReplayRNG`, :func:`replay_backward`, :func:`selection_correction_factor` -- what a
  trainer needs to replay a microbatch and apply the B/b correction;
* :func:`demo_replay_step` -- one step on the toys, checked against plain backpropagation.
"""
from __future__ import annotations

from .demo import demo_replay_step
from .gradcache import (
    FeatureGradientReplay,
    FeatureGradientReplayResult,
    MultiRepresentationFreshVideoGradCache,
    MultiRepresentationFreshVideoGradCacheResult,
)
from .mmd import MultiEncoderMMD
from .rng import ReplayRNG, replay_backward, selection_correction_factor
from .scatter import ScatteredCotangents, scatter_cotangents

__all__ = [
    "FeatureGradientReplay",
    "FeatureGradientReplayResult",
    "MultiEncoderMMD",
    "MultiRepresentationFreshVideoGradCache",
    "MultiRepresentationFreshVideoGradCacheResult",
    "ReplayRNG",
    "ScatteredCotangents",
    "demo_replay_step",
    "replay_backward",
    "scatter_cotangents",
    "selection_correction_factor",
]
