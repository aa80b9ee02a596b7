"""The Chat page: a conversation over one cache, its views and the one-click scenario."""
