"""The KV caches: the cache API, static/concat, paged with its block pool, quantized and windowed, one make_cache."""
