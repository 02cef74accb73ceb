"""Triton kernels of latentfast, ``latentfast.kernels``.

One module per op; each exposes the op's kernel form (see ``latentfast/_ops.py``). Importing a
module here imports Triton; the op layer does that lazily, on first use.
"""
