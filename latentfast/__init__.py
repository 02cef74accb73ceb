"""latentfast: compiled kernels for the latent cache, vision encode units and feature gradient replay."""
from __future__ import annotations

from . import _ops  # noqa: F401  (defines the ops; backends loads the native library and registers kernels)
from . import backends, ops, reference  # noqa: F401
from .backends import describe

__version__ = "0.1.0"
__all__ = ["backends", "describe", "ops", "reference", "__version__"]
