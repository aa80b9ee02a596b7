"""Serving: many requests at once over one paged pool (continuous batching, chunked prefill,
preemption by recompute, prefix caching), with vLLM V1's scheduling semantics."""
