"""A running inference server's KV cache, read from its own metrics (vLLM, SGLang, llama.cpp)."""
