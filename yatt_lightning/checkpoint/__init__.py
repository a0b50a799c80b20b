"""Checkpoints: the sharded folder format (``folder``), the background writer, verification, and export
to a Hugging Face folder."""
