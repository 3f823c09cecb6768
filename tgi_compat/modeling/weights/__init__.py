"""Checkpoint formats: safetensors folders, GGUF files, hub snapshots (see loader.py)."""
