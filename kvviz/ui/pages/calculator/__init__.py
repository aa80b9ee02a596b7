"""The KV memory calculator page and its parts."""
