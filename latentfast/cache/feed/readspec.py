"""One description of how a batch is read: :class:`ReadSpec`, what ``read_batch``, the
:class:`~latentfast.cache.LatentLoader`, its workers and the per-item dataset share.

``read_batch(cache, indices, fields=..., pad=..., ...)`` builds one from its keywords (so every
existing call keeps working); ``read_batch(cache, indices, spec)`` takes one as it is. A spec is a
frozen value: a loader changes the epoch of its draws with :meth:`ReadSpec.at_epoch`, which makes a
new one, so a worker holding the old spec can never read a batch with half-changed options.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...checks import as_int
from ...errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """The options of a batch read (see :func:`latentfast.cache.read_batch` for each one's meaning).

    ``fields`` / ``packed`` are kept as tuples (a single name is read as a one-name tuple), ``pad`` as
    a dict; ``sample``/``flip`` without ``fields`` read the ``latent`` field. :attr:`records` says
    whether the batch is a dict of records (anything beyond the latent-only tuple of a plain read).
    """

    fields: tuple | None = None
    pad: dict | None = None
    pad_to: Any = None
    packed: tuple = ()
    sample: bool = False
    flip: float | None = None
    seed: int | None = None
    epoch: int = 0
    dtype: torch.dtype | None = None
    width: int | None = None
    device: Any = "cpu"
    cold: Any = "auto"
    backend: str = "auto"

    def __post_init__(self):
        # normalised once here, so every reader of the spec sees one form (frozen: object.__setattr__)
        if isinstance(self.fields, str):
            object.__setattr__(self, "fields", (self.fields,))
        elif self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))
        if isinstance(self.packed, str):
            object.__setattr__(self, "packed", (self.packed,))
        elif not isinstance(self.packed, tuple):
            object.__setattr__(self, "packed", tuple(self.packed))
        if not (self.cold == "auto" if self.cold.__class__ is str else self.cold is True or self.cold is False):
            raise InvalidArgumentError(f"cold must be 'auto', True or False, got {self.cold!r}")

    @property
    def draws(self) -> bool:
        """Whether the ``latent`` entry is drawn (``sample`` or ``flip``)."""
        return self.sample is not False or self.flip is not None

    @property
    def records(self) -> bool:
        """Whether the batch is a dict of records (``fields``, ``pad``, ``pad_to``, ``packed`` or a draw)."""
        return self.fields is not None or self.pad is not None or self.pad_to is not None or bool(self.packed) or self.draws

    @property
    def names(self) -> tuple:
        """The fields a records batch holds (``("latent",)`` for a draw without ``fields``)."""
        return ("latent",) if self.fields is None else self.fields

    def at_epoch(self, epoch: int) -> ReadSpec:
        """This spec with the draws' ``epoch`` (the same object when it already has it)."""
        epoch = as_int("epoch", epoch, minimum=0)
        return self if epoch == self.epoch else dataclasses.replace(self, epoch=epoch)

    def replace(self, **changes) -> ReadSpec:
        return dataclasses.replace(self, **changes)


SPEC_OPTIONS = frozenset(f.name for f in dataclasses.fields(ReadSpec))
