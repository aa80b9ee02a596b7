"""Text <-> token ids: the byte-level and tokenizer.json tokenizers, GGUF's BPE, and chat templates."""
