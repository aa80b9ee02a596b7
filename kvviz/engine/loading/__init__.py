"""kvviz.engine.loading: a folder marker (the modules below are imported by their own names)."""
