"""The Serving page: many requests at once."""
