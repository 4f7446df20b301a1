"""Checkpoints on object storage: storage by URI, manifest-last catalog, background writer."""
