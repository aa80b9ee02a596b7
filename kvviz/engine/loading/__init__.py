"""Checkpoints in, a LoadedModel out: safetensors and GGUF read with their checks, each family's loader, save."""
