"""The one generation loop and what it runs on: the request checks, sampling, stops, events, captures, FLOPs."""
