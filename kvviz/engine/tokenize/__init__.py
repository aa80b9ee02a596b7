"""Tokenizers rebuilt from a model file's own metadata."""
