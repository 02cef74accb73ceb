"""Builders that fill a cache: lines of text images, image buckets and video clips, imported latents, and the manifests that list their sources."""
