"""The Cache vs no cache page."""
