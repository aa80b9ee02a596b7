"""Loops over one cache across calls: a chat conversation with its turns, and n parallel samples of one prompt."""
