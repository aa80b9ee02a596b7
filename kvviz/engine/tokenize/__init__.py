"""kvviz.engine.tokenize: a folder marker (the modules below are imported by their own names)."""
