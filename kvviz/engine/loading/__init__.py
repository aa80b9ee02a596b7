"""Where model files come from: packages that ship them, joined and verified once."""
