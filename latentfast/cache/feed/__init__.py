"""Feeding a training loop from a cache: the batch gather, cold-read advice, samplers, DataLoader pieces and the device path."""
