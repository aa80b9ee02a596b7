"""The Batching page."""
