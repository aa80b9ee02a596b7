"""What several pages share: charts on screen, plain text, the measurement pages' helpers."""
