"""The Live server page: a running vLLM / SGLang / llama.cpp server's KV cache, read from its /metrics."""
