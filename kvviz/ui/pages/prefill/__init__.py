"""The Prefill vs decode page."""
