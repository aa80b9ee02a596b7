"""The Generate page: the live loop, step mode, the run view, replay and export."""
