"""Decoding strategies beside the plain loop: beam search and speculative decoding, and the stream they share."""
