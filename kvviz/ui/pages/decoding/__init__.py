"""The Decoding strategies page: beam search and speculative decoding."""
