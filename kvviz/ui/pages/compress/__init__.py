"""The Compression lab page: KV dtypes, the sliding window, perplexity by position."""
