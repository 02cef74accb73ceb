"""The pure-torch reference (:mod:`latentfast.reference`) as the ``torch`` backend of every op, on
every device: the fallback when nothing compiled can run, and the oracle of the parity tests."""
from __future__ import annotations

from .. import _ops, reference
from . import DEVICE_TYPES, register_kernel

for _op in _ops.SCHEMAS:
    for _device_type in DEVICE_TYPES:
        register_kernel(_op, _device_type, "torch")(getattr(reference, _op))
